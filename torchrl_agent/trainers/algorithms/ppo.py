"""PPO: a critic (the policy's backbone + a value head, its own AdamW at ``algorithm.critic_lr``)
and per-token GAE inside each row's response over its values (``gamma = lmbda = 1`` in
``configs/algorithm/ppo.yaml``), whitened over the batch; the critic is updated on the batch
before the policy (clipped value loss, ``algorithm.value_clip``). Both, and the policy loss, are
:class:`~torchrl_agent.objectives.PPOLoss`: the PPO users import is the PPO the trainer runs."""

from __future__ import annotations

from torchrl_agent.models import model_path
from torchrl_agent.objectives import PPOLoss
from torchrl_agent.trainers.algorithms.registry import Algorithm, clip_loss_kwargs, register_algorithm
from torchrl_agent.trainers.critic import Critic, ValueModel

__all__ = ["PPO", "build_critic", "ppo_loss"]


def ppo_loss(cfg) -> PPOLoss:
    """The run's :class:`~torchrl_agent.objectives.PPOLoss`: the ``algorithm`` section's clipping, KL
    and entropy settings, GAE's ``gamma``/``lmbda`` and ``value_clip``; ``critic_coef=None`` since the
    critic is a separate model with its own optimizer (:meth:`~torchrl_agent.objectives.PPOLoss.value_loss`)."""
    a = cfg.algorithm
    return PPOLoss(critic_coef=None, value_clip=a.value_clip, gamma=a.gamma, lmbda=a.lmbda, **clip_loss_kwargs(cfg))


def build_critic(cfg, parts) -> Critic:
    """The value model, initialised from the policy's weights (``model.path``), in float32 (as the
    policy's master weights; the critic is small next to the policy), on the trainer's device (``parts``:
    :class:`~torchrl_agent.trainers.algorithms.hooks.AlgorithmParts`)."""
    a = cfg.algorithm
    value_model = ValueModel.from_pretrained(model_path(cfg.model), parts.tokenizer.pad_token_id)
    return Critic(value_model.to(parts.device), parts.loss, lr=a.critic_lr, weight_decay=a.weight_decay,
                  grad_clip=a.grad_clip)


PPO = register_algorithm(Algorithm("ppo", loss=ppo_loss, critic=build_critic,
                                   summary="GAE per token over a critic's values"))

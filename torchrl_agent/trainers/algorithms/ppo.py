"""PPO: a critic (the policy's backbone + a value head, its own AdamW at ``algorithm.critic_lr``)
and per-token GAE inside each row's response over its values (``gamma = lmbda = 1`` in
``configs/algorithm/ppo.yaml``), whitened over the batch; the critic is updated on the batch
before the policy (clipped value loss, ``algorithm.value_clip``)."""

from __future__ import annotations

from torchrl_agent.models import model_path
from torchrl_agent.trainers.algorithms.registry import Algorithm, register_algorithm
from torchrl_agent.trainers.critic import Critic, ValueModel

__all__ = ["PPO", "build_critic"]


def build_critic(cfg, trainer) -> Critic:
    """The value model, initialised from the policy's weights (``model.path``), in float32 (as the
    policy's master weights; the critic is small next to the policy), on the trainer's device."""
    a = cfg.algorithm
    value_model = ValueModel.from_pretrained(model_path(cfg.model), trainer.tokenizer.pad_token_id)
    return Critic(value_model.to(trainer.device), lr=a.critic_lr, weight_decay=a.weight_decay,
                  value_clip=a.value_clip, grad_clip=a.grad_clip, aggregation=a.aggregation,
                  norm_length=a.loss_norm_length or cfg.rollout.max_new_tokens)


PPO = register_algorithm(Algorithm("ppo", critic=build_critic, summary="GAE per token over a critic's values"))

"""Config values into the objects of a run: the rollout engine, the collector, the advantage module
and the policy loss (the environment's builders live below, in :mod:`torchrl_agent.envs.factory`,
and are re-exported here)."""

from __future__ import annotations

from torchrl_agent.collectors import StepCollector
from torchrl_agent.envs.factory import build_env, build_memory, prompt_budget
from torchrl_agent.models import model_path
from torchrl_agent.modules import TransformersPolicy
from torchrl_agent.trainers.algorithms import get_algorithm

__all__ = ["build_advantage", "build_collector", "build_env", "build_loss", "build_memory", "build_policy",
           "prompt_budget"]


def build_policy(cfg, model, tokenizer):
    """The rollout engine of ``rollout.engine``: ``transformers`` (shares ``model``) or ``vllm``
    (its own copy of the weights, refreshed by ``update_weights`` after every update)."""
    r = cfg.rollout
    if r.engine == "transformers":
        return TransformersPolicy(model, tokenizer, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                  batch_size=r.batch_size)
    if r.engine == "vllm":
        from torchrl_agent.modules.vllm_policy import VLLMPolicy

        if cfg.model.lora_rank > 0:
            raise ValueError("rollout.engine=vllm with model.lora_rank > 0 is not supported yet")
        return VLLMPolicy(model_path(cfg.model), tokenizer, dtype=cfg.model.dtype, seed=cfg.seed,
                          max_new_tokens=r.max_new_tokens, temperature=r.temperature, max_num_seqs=r.batch_size)
    raise ValueError(f"rollout.engine: unknown engine {r.engine!r}; use transformers or vllm")


def build_collector(cfg, env, policy) -> StepCollector:
    """The training collector: complete groups of ``env``'s episodes, seeded by ``cfg.seed``."""
    return StepCollector(env, policy, seed=cfg.seed, lockstep=cfg.rollout.lockstep, progress=cfg.progress)


def build_advantage(cfg):
    """The advantage module of ``algorithm.name``'s registered :class:`~.algorithms.Algorithm`
    (``None`` for an algorithm with a critic: GAE over its values, see
    :class:`~torchrl_agent.trainers.algorithms.AlgorithmHooks`)."""
    algorithm = get_algorithm(cfg.algorithm.name)
    return algorithm.advantage(cfg) if algorithm.advantage is not None else None


def build_loss(cfg):
    """The policy loss of ``algorithm.name`` (:meth:`Algorithm.build_loss
    <torchrl_agent.trainers.algorithms.Algorithm.build_loss>`): a :class:`~torchrl_agent.objectives.ClipPolicyLoss`
    with the ``algorithm`` section's settings, or the algorithm's own (PPO's :class:`~torchrl_agent.objectives.PPOLoss`)."""
    return get_algorithm(cfg.algorithm.name).build_loss(cfg)

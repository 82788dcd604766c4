"""Config values into the objects of a run: the rollout engine, the collector, the advantage module
and the policy loss (the environment's builders live below, in :mod:`torchrl_agent.envs.factory`,
and are re-exported here)."""

from __future__ import annotations

import copy

from torchrl_agent.collectors import StepCollector
from torchrl_agent.envs.factory import build_env, build_memory, prompt_budget
from torchrl_agent.models import model_path
from torchrl_agent.modules import TransformersPolicy
from torchrl_agent.objectives import ClipPolicyLoss
from torchrl_agent.trainers.algorithms import get_algorithm

__all__ = ["build_advantage", "build_collector", "build_env", "build_loss", "build_memory", "build_policy",
           "prompt_budget", "rollout_config"]


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


def rollout_config(cfg, split: str = "train"):
    """``cfg`` with this rank's share of the groups of ``split`` (``env.num_groups`` for ``"train"``,
    ``env.eval_episodes`` for ``"eval"``): under torchrun every rollout engine collects whole groups
    of its own (:class:`~torchrl_agent.collectors.DistributedStepCollector`); ``cfg`` itself in a
    single process."""
    from torchrl_agent.collectors.distributed import DistributedStepCollector, rollout_rank

    if rollout_rank()[1] == 1:
        return cfg
    cfg = copy.deepcopy(cfg)
    key = "num_groups" if split == "train" else "eval_episodes"
    total = getattr(cfg.env, key)
    try:
        groups, _ = DistributedStepCollector.groups_of(total)
    except ValueError as err:
        raise ValueError(f"env.{key}: {err}") from None
    setattr(cfg.env, key, groups)
    return cfg


def build_collector(cfg, env, policy, *, split: str = "train"):
    """The collector of ``env`` (built from :func:`rollout_config`): complete groups of episodes,
    seeded by ``cfg.seed``. A single process: a :class:`~torchrl_agent.collectors.StepCollector`;
    under torchrun a :class:`~torchrl_agent.collectors.DistributedStepCollector` (every rank its
    groups with its own engine, the rows gathered on every rank)."""
    from torchrl_agent.collectors.distributed import DistributedStepCollector, rollout_rank
    from torchrl_agent.trainers.distributed import is_main_process

    train = split == "train"
    lockstep, progress = cfg.rollout.lockstep and train, cfg.progress and train
    if rollout_rank()[1] == 1:
        return StepCollector(env, policy, seed=cfg.seed, lockstep=lockstep, progress=progress)
    total = cfg.env.num_groups if train else cfg.env.eval_episodes
    return DistributedStepCollector(env, policy, num_groups=total, seed=cfg.seed, lockstep=lockstep,
                                    progress=progress and is_main_process())


def build_advantage(cfg):
    """The advantage module of ``algorithm.name``'s registered :class:`~.algorithms.Algorithm`
    (``None`` for an algorithm with a critic: GAE over its values, see
    :class:`~torchrl_agent.trainers.algorithms.AlgorithmHooks`)."""
    algorithm = get_algorithm(cfg.algorithm.name)
    return algorithm.advantage(cfg) if algorithm.advantage is not None else None


def build_loss(cfg) -> ClipPolicyLoss:
    """The policy loss of the ``algorithm`` config."""
    a = cfg.algorithm
    return ClipPolicyLoss(eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip, aggregation=a.aggregation,
                          kl_coef=a.kl_coef, entropy_coef=a.entropy_coef, ratio=a.ratio, max_log_ratio=a.max_log_ratio,
                          kl_type=a.kl_type, norm_length=a.loss_norm_length or cfg.rollout.max_new_tokens)

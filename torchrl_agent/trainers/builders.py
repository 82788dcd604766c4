"""Config values into the objects of a run: the rollout engine, the collector, the advantage module
and the policy loss (the environment's builders live below, in :mod:`torchrl_agent.envs.factory`,
and are re-exported here)."""

from __future__ import annotations

import copy

from torchrl_agent.collectors import StepCollector
from torchrl_agent.envs.factory import build_env, build_memory, prompt_budget
from torchrl_agent.models import model_path
from torchrl_agent.modules import TransformersPolicy
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
        budget = prompt_budget(cfg, tokenizer)  # the engine's context fits every prompt the env sends
        return VLLMPolicy(model_path(cfg.model), tokenizer, dtype=cfg.model.dtype, seed=cfg.seed,
                          max_new_tokens=r.max_new_tokens, temperature=r.temperature, max_prompt_tokens=budget,
                          max_model_len=r.max_model_len or budget + r.max_new_tokens,
                          max_num_seqs=r.max_num_seqs or r.batch_size, gpu_memory_utilization=r.gpu_memory_utilization,
                          tensor_parallel_size=r.tensor_parallel_size, enforce_eager=r.enforce_eager,
                          sleep_mode=r.sleep_mode)
    raise ValueError(f"rollout.engine: unknown engine {r.engine!r}; use transformers or vllm")


def engine_ranks(cfg) -> int:
    """Ranks per rollout engine: ``rollout.tensor_parallel_size`` for vLLM, 1 for transformers."""
    return cfg.rollout.tensor_parallel_size if cfg.rollout.engine == "vllm" else 1


def rollout_config(cfg, split: str = "train"):
    """``cfg`` with this rank's share of the groups of ``split`` (``env.num_groups`` for ``"train"``,
    ``env.eval_episodes`` for ``"eval"``): under torchrun every rollout engine collects whole groups
    of its own (:class:`~torchrl_agent.collectors.DistributedStepCollector`); ``cfg`` itself in a
    single process."""
    from torchrl_agent.collectors.distributed import DistributedStepCollector, rollout_rank

    if rollout_rank(engine_ranks(cfg))[1] == 1:
        return cfg
    cfg = copy.deepcopy(cfg)
    key = "num_groups" if split == "train" else "eval_episodes"
    total = getattr(cfg.env, key)
    try:
        groups, _ = DistributedStepCollector.groups_of(total, engine_ranks(cfg))
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
    tp = engine_ranks(cfg)
    if rollout_rank(tp)[1] == 1:
        return StepCollector(env, policy, seed=cfg.seed, lockstep=lockstep, progress=progress)
    total = cfg.env.num_groups if train else cfg.env.eval_episodes
    return DistributedStepCollector(env, policy, num_groups=total, seed=cfg.seed, lockstep=lockstep,
                                    progress=progress and is_main_process(), tp_size=tp)


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

"""Config values into the objects of a run: the rollout engine, the collector, the advantage module
and the policy loss (the environment's builders live below, in :mod:`torchrl_agent.envs.factory`,
and are re-exported here)."""

from __future__ import annotations

import copy
import logging

from torchrl_agent.collectors import StepCollector
from torchrl_agent.envs.factory import build_env, build_memory, prompt_budget
from torchrl_agent.models import model_path
from torchrl_agent.modules import TransformersPolicy
from torchrl_agent.trainers.algorithms import get_algorithm

__all__ = ["build_advantage", "build_collector", "build_env", "build_loss", "build_memory", "build_policy",
           "prompt_budget", "rollout_config", "vllm_engine_kwargs"]

logger = logging.getLogger("torchrl_agent")


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
        return VLLMPolicy(tokenizer=tokenizer, **vllm_engine_kwargs(cfg, tokenizer))
    raise ValueError(f"rollout.engine: unknown engine {r.engine!r}; use transformers or vllm")


def vllm_engine_kwargs(cfg, tokenizer) -> dict:
    """The keyword arguments of :class:`~torchrl_agent.modules.VLLMPolicy` for ``cfg`` (all picklable:
    also the engine server's of :class:`~torchrl_agent.collectors.MultiProcessStepCollector`)."""
    r = cfg.rollout
    budget = prompt_budget(cfg, tokenizer)  # the engine's context fits every prompt the env sends
    return dict(model_path=str(model_path(cfg.model)), dtype=cfg.model.dtype, seed=cfg.seed,
                max_new_tokens=r.max_new_tokens, temperature=r.temperature, max_prompt_tokens=budget,
                max_model_len=r.max_model_len or budget + r.max_new_tokens,
                max_num_seqs=r.max_num_seqs or r.batch_size, gpu_memory_utilization=r.gpu_memory_utilization,
                tensor_parallel_size=r.tensor_parallel_size, enforce_eager=r.enforce_eager, sleep_mode=r.sleep_mode)


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


def build_collector(cfg, env, policy, *, split: str = "train", tokenizer=None):
    """The collector of a run, per ``collector.kind``: complete groups of episodes, seeded by ``cfg.seed``.

    - ``step`` (default): ``env`` (built from :func:`rollout_config`) stepped with ``policy``: a
      :class:`~torchrl_agent.collectors.StepCollector` in a single process; under torchrun a
      :class:`~torchrl_agent.collectors.DistributedStepCollector` (every rank its groups with its
      own engine, the rows gathered on every rank). Evaluation (``split="eval"``) always uses it.
    - ``multiprocess``: a :class:`~torchrl_agent.collectors.MultiProcessStepCollector`, collector
      processes over one vLLM engine server (``env`` and ``policy`` unused);
    - ``ray``: a :class:`~torchrl_agent.collectors.RayStepCollector`, Ray actors with an engine of
      ``rollout.engine`` each.
    """
    from torchrl_agent.collectors.distributed import DistributedStepCollector, rollout_rank
    from torchrl_agent.trainers.distributed import is_main_process

    train = split == "train"
    c = cfg.collector
    if train and c.kind != "step":
        return _sharded_collector(cfg, tokenizer)
    lockstep, progress = cfg.rollout.lockstep and train, cfg.progress and train
    tp = engine_ranks(cfg)
    if rollout_rank(tp)[1] == 1:
        return StepCollector(env, policy, seed=cfg.seed, lockstep=lockstep, progress=progress)
    total = cfg.env.num_groups if train else cfg.env.eval_episodes
    return DistributedStepCollector(env, policy, num_groups=total, seed=cfg.seed, lockstep=lockstep,
                                    progress=progress and is_main_process(), tp_size=tp)


def _sharded_collector(cfg, tokenizer):
    from torchrl_agent.collectors import ConfigEnvFactory

    c, r = cfg.collector, cfg.rollout
    common = dict(num_groups=cfg.env.num_groups, num_collectors=c.num_collectors, seed=cfg.seed,
                  max_batches_ahead=c.max_batches_ahead)
    if c.kind == "multiprocess":
        from torchrl_agent.collectors import MultiProcessStepCollector

        return MultiProcessStepCollector(ConfigEnvFactory(cfg), engine=vllm_engine_kwargs(cfg, tokenizer),
                                         engine_threads=c.engine_threads, **common)
    from torchrl_agent.collectors.ray import PolicyFactory, RayStepCollector

    if r.engine == "vllm":
        kwargs = vllm_engine_kwargs(cfg, tokenizer)
        factory = PolicyFactory("vllm", kwargs.pop("model_path"), dtype=kwargs.pop("dtype"), kwargs=kwargs)
    else:  # a transformers copy of the model in each actor, sampling each request from its seed
        factory = PolicyFactory("transformers", str(model_path(cfg.model)), dtype=cfg.model.dtype,
                                kwargs=dict(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                            batch_size=r.batch_size))
    return RayStepCollector(ConfigEnvFactory(cfg), factory, **common)


def build_advantage(cfg):
    """The advantage module of ``algorithm.name``'s registered :class:`~.algorithms.Algorithm`
    (``None`` for an algorithm with a critic: GAE over its values, see
    :class:`~torchrl_agent.trainers.algorithms.AlgorithmHooks`)."""
    algorithm = get_algorithm(cfg.algorithm.name)
    if algorithm.group_relative and cfg.env.group_size == 1:  # a run that cannot learn: said at start
        logger.warning("env.group_size=1 with algorithm.name=%s: its advantage compares each episode with the other "
                       "episodes of its group, so with one per group every advantage is 0 and nothing is learned; "
                       "set env.group_size >= 2 (e.g. 4), or an algorithm without groups (ppo, reinforce_pp, remax)",
                       cfg.algorithm.name)
    return algorithm.advantage(cfg) if algorithm.advantage is not None else None


def build_loss(cfg):
    """The policy loss of ``algorithm.name`` (:meth:`Algorithm.build_loss
    <torchrl_agent.trainers.algorithms.Algorithm.build_loss>`): a :class:`~torchrl_agent.objectives.ClipPolicyLoss`
    with the ``algorithm`` section's settings, or the algorithm's own (PPO's :class:`~torchrl_agent.objectives.PPOLoss`)."""
    return get_algorithm(cfg.algorithm.name).build_loss(cfg)

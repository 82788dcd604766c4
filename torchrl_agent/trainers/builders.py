"""Config values into the objects of a run: the rollout engine, the collector, the advantage module
and the policy loss (the environment's builders live below, in :mod:`torchrl_agent.envs.factory`,
and are re-exported here)."""

from __future__ import annotations

import copy
import logging

from torchrl_agent.collectors import StepCollector
from torchrl_agent.envs.factory import build_env, build_memory, prompt_budget
from torchrl_agent.trainers.algorithms import get_algorithm
from torchrl_agent.trainers.engines import get_engine, transformers_engine_kwargs, vllm_engine_kwargs

__all__ = ["build_advantage", "build_collector", "build_env", "build_loss", "build_memory", "build_policy",
           "prompt_budget", "rollout_config", "vllm_engine_kwargs"]

logger = logging.getLogger("torchrl_agent")


def build_policy(cfg, model, tokenizer):
    """The rollout engine of ``rollout.engine`` (:data:`~torchrl_agent.trainers.engines.ENGINE_REGISTRY`):
    ``transformers`` (shares ``model``; a VLM on image observations:
    :class:`~torchrl_agent.modules.VisionPolicy` with its processor), ``vllm`` (its own copy of the weights, refreshed by
    ``update_weights`` after every update), or any registered engine."""
    engine = get_engine(cfg.rollout.engine)
    if engine.check is not None:
        engine.check(cfg)
    return engine.build(cfg, model if engine.shares_weights else None, tokenizer)


def engine_ranks(cfg) -> int:
    """Ranks per rollout engine (``rollout.tensor_parallel_size`` for vLLM, 1 for transformers)."""
    return get_engine(cfg.rollout.engine).ranks(cfg)


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
      processes over one engine server (``env`` and ``policy`` unused): vLLM, or for a VLM on
      image observations (``rollout.engine=transformers``) the folder's transformers engine with the
      image bounds (:func:`~torchrl_agent.trainers.engines.transformers_engine_kwargs`);
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

        engine = vllm_engine_kwargs(cfg, tokenizer) if r.engine == "vllm" else transformers_engine_kwargs(cfg)
        return MultiProcessStepCollector(ConfigEnvFactory(cfg), engine=engine, engine_threads=c.engine_threads,
                                         **common)
    from torchrl_agent.collectors.ray import RayStepCollector

    return RayStepCollector(ConfigEnvFactory(cfg), get_engine(r.engine).ray_factory(cfg, tokenizer), **common)


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

"""ReMax: the episode reward minus the reward of one greedy episode from the group's initial state.

The baseline episodes come from a second environment and collector run at temperature 0
(:class:`GreedyBaseline`), collected right after every training batch from the same group seeds.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from tensordict import TensorDictBase

from torchrl_agent.envs.factory import build_env
from torchrl_agent.objectives import ReMaxAdvantage
from torchrl_agent.trainers.algorithms.registry import Algorithm, register_algorithm
from torchrl_agent.trainers.config import ConfigError

__all__ = ["GreedyBaseline", "REMAX"]


class GreedyBaseline:
    """ReMax's baseline: one greedy episode per group from the same initial state; its reward
    is written to the training rows as ``"reward_baseline"`` ``[N, 1]``.

    A second environment (``group_size`` 1, the greedy policy) is given the training
    environment's seed-generator state before each training collection, so that it draws the
    same group seeds; they are checked equal after both collections. Under torchrun (the trainer's
    :class:`~torchrl_agent.collectors.DistributedStepCollector`) each rank's engine plays the greedy
    episodes of its own groups, as it collects their training episodes, and the baseline rows are
    gathered like the training rows."""

    def __init__(self, cfg, parts) -> None:
        # imported here: the algorithm registry (read by `torchrl-agent config`) stays free of TorchRL's
        # collectors, which import vLLM where it is installed (seconds per process)
        from torchrl_agent.collectors import DistributedStepCollector, StepCollector

        greedy = copy.copy(parts.policy)
        greedy.temperature = 0.0
        env = dataclasses.replace(cfg.env, group_size=1)
        train = parts.collector
        if isinstance(train, DistributedStepCollector):
            mine, _ = train.groups_of(cfg.env.num_groups, train.tp_size)  # this rank's groups, as for training
            self.env = build_env(dataclasses.replace(cfg, env=dataclasses.replace(env, num_groups=mine)),
                                 parts.tokenizer, policy=greedy)
            self.collector = DistributedStepCollector(self.env, greedy, num_groups=cfg.env.num_groups, seed=cfg.seed,
                                                      lockstep=cfg.rollout.lockstep, tp_size=train.tp_size)
        else:
            self.env = build_env(dataclasses.replace(cfg, env=env), parts.tokenizer, policy=greedy)
            self.collector = StepCollector(self.env, greedy, seed=cfg.seed, lockstep=cfg.rollout.lockstep)

    def wrap(self, collector):
        def collect() -> TensorDictBase:
            train_base = getattr(collector.env, "base_env", collector.env)
            own_base = getattr(self.env, "base_env", self.env)
            own_base._rng = copy.deepcopy(train_base._rng)  # the same group seeds as the training batch
            rows = collector.collect()
            baseline = self.collector.collect()
            if own_base.group_seeds != train_base.group_seeds:
                raise RuntimeError("ReMax baseline episodes did not start from the training batch's states")
            g = self.collector.num_groups  # group ids are batch * num_groups + the group's index in the batch
            per_group = torch.zeros(g, dtype=torch.float64).index_add_(
                0, baseline["group_id"].reshape(-1) % g, baseline["reward"].reshape(-1).double())
            local = rows["group_id"].reshape(-1) % g
            rows.set("reward_baseline", per_group[local].unsqueeze(-1).to(rows["reward"].dtype))
            return rows

        return collect

    def state_dict(self) -> dict:
        """The baseline collector's place in its seed stream (a resumed run draws the same episodes)."""
        return self.collector.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.collector.load_state_dict(state)


def check(cfg) -> None:
    if cfg.algorithm.dynamic_sampling:
        raise ConfigError("algorithm.dynamic_sampling is not supported with algorithm.name=remax")


REMAX = register_algorithm(Algorithm("remax", advantage=lambda cfg: ReMaxAdvantage(
    invalid_penalty=cfg.algorithm.invalid_penalty), baseline=GreedyBaseline, check=check,
    summary="episode reward minus a greedy episode's from the same state"))

"""Collection under ``torchrun``: every rank collects its share of the groups with its own engine.

The layout of ``docs/distributed.md`` ("colocated engines"): each training rank holds a rollout
engine of its own (a vLLM engine built with ``distributed_executor_backend="external_launcher"``,
see :class:`~torchrl_agent.modules.VLLMPolicy`, or a transformers copy of the model). A batch's
``num_groups`` groups are split over the ``dp_size`` engines (:func:`split_groups`, whole groups:
GiGPO and GRPO normalise within a group); rank ``r`` steps its groups with its engine as a
:class:`~torchrl_agent.collectors.shards.CollectorShard` (the single-process ids and episodes), then
the rows of every rank are all-gathered, so every rank holds the whole batch in the single-process
order (``step_count``, then ``traj_id``). With an engine that samples each request from its
``request_seed`` (vLLM) the rows are those of one :class:`~torchrl_agent.collectors.StepCollector`
over all the groups.

An engine split over ``tp_size`` ranks (tensor parallelism) is one engine: its ranks collect the
same groups (the same prompts in the same order, which vLLM's external launcher requires) and only
the first rank of each engine contributes rows. Every rank must call :meth:`collect` together (it
is a collective).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torchrl.collectors import BaseCollector

from torchrl_agent.collectors.shards import CollectorShard, merge_shard_batches, split_groups
from torchrl_agent.collectors.step_collector import StepCollector, _BatchStats
from torchrl_agent.modules.policy import LLMPolicy

__all__ = ["DistributedStepCollector", "rollout_rank"]


def rollout_rank(tp_size: int = 1) -> tuple[int, int, int]:
    """``(engine index, engines, rank within the engine)`` of this process: ranks ``e * tp_size ..
    (e + 1) * tp_size - 1`` form engine ``e`` (vLLM's external launcher groups consecutive ranks,
    tensor-parallel innermost). ``(0, 1, 0)`` without a process group."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, 0
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"the world size ({world}) must be a multiple of the engine's tensor-parallel size "
                         f"({tp_size})")
    return rank // tp_size, world // tp_size, rank % tp_size


class DistributedStepCollector(BaseCollector):
    """Groups ``group_offset ..`` of the ``num_groups`` groups of every batch, collected by this rank's
    engine, and the other ranks' rows gathered (see the module notes).

    Args:
        env: this engine's transformed text environment, with ``groups_of(num_groups)[0]`` groups
            (:meth:`groups_of`).
        policy: this rank's engine.
        num_groups: the groups of a whole batch (all engines).
        seed, lockstep, progress: as for :class:`~torchrl_agent.collectors.StepCollector`.
        tp_size: ranks per engine (tensor parallelism).

    ``stats`` holds the batch's figures summed over the engines (``collect_time_s``: the slowest
    engine's, ``shard_collect_time_s``: each engine's).
    """

    init_random_frames = 0

    def __init__(self, env, policy: LLMPolicy, *, num_groups: int, seed: int = 0, lockstep: bool = False,
                 progress: bool = False, tp_size: int = 1):
        super().__init__()
        self.engine, self.engines, self.tp_rank = rollout_rank(tp_size)
        self.tp_size = tp_size
        groups, offset = self.groups_of(num_groups, tp_size)
        have = getattr(env, "num_groups", None) or env.base_env.num_groups
        if have != groups:
            raise ValueError(f"engine {self.engine} collects {groups} of the {num_groups} groups, its env has {have}")
        self.num_groups, self.seed = num_groups, seed
        self.shard = CollectorShard(env, policy, groups_total=num_groups, group_offset=offset, seed=seed)
        self.shard.collector.lockstep, self.shard.collector.progress = lockstep, progress
        self.env, self.policy = env, policy
        self.group_size = self.shard.collector.group_size
        self.batches, self._frames = 0, 0
        self.total_frames, self.total_batches = -1, None
        self.requested_frames_per_batch = self.frames_per_batch = None
        self.replay_buffer = self.postproc = None
        self.stats = _BatchStats(self)

    @staticmethod
    def groups_of(num_groups: int, tp_size: int = 1) -> tuple[int, int]:
        """``(groups, first group)`` this rank's engine collects of a batch of ``num_groups``."""
        engine, engines, _ = rollout_rank(tp_size)
        if num_groups < engines:
            raise ValueError(f"env.num_groups={num_groups} is smaller than the number of rollout engines ({engines}): "
                             "every engine collects whole groups; raise env.num_groups or use fewer ranks")
        return split_groups(num_groups, engines)[engine]

    def owner(self, rows: TensorDictBase) -> torch.Tensor:
        """The engine that collected each row ``[N]`` (from its ``group_id``)."""
        local = rows["group_id"].reshape(-1) % self.num_groups
        starts = torch.tensor([first for _, first in split_groups(self.num_groups, self.engines)])
        return torch.searchsorted(starts, local, right=True) - 1

    @torch.no_grad()
    def collect(self) -> TensorDictBase:
        """The next batch on every rank: rows ``[N]`` of all the groups, in the single-process order."""
        t0 = time.perf_counter()
        packed, figures = self.shard.collect(self.batches)
        mine = (packed, figures) if self.tp_rank == 0 else None
        if dist.is_available() and dist.is_initialized():
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        shards = [s for s in everyone if s is not None]
        summed = ("env_steps", "generated_tokens", "generation_slots", "prompt_budget_truncations")
        # tokens per second over the slowest rank's collection (the ranks collect at the same time; the gather left out)
        return merge_shard_batches(self, shards, t0, summed, max(s["collect_time_s"] for _, s in shards))

    # ------------------------------------------------------------------ TorchRL collector API
    iterator = StepCollector.iterator
    _budget_spent = StepCollector._budget_spent

    @property
    def _iter(self) -> int:
        return self.batches - 1

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        self.seed, self.batches, self._frames = seed, 0, 0
        self.shard.set_seed(seed)
        return seed

    def state_dict(self) -> dict:
        return {"batches": self.batches, "seed": self.seed, "frames": self._frames}

    def load_state_dict(self, state: dict) -> None:
        self.shard.load_state_dict(state)
        self.seed, self.batches, self._frames = state["seed"], state["batches"], state.get("frames", 0)

    def update_policy_weights_(self, weights=None, *args, **kwargs) -> None:
        """Load ``weights`` (a full state dict, on every rank) into this rank's engine."""
        if weights is None:
            raise ValueError("DistributedStepCollector.update_policy_weights_ needs the weights (a state dict)")
        self.shard.update_weights(dict(weights))

    def get_model(self, model_id: str):
        if model_id != "policy":
            raise KeyError(f"{type(self).__name__} has one model, 'policy', not {model_id!r}")
        return self.policy

    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        self.shard.collector.shutdown(close_env=close_env, raise_on_error=raise_on_error)

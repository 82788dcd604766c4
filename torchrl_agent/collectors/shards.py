"""What the sharded collectors share: the split of the groups, the shard that steps them, the
coordinator's batch loop, and picklable environment factories.

A sharded collector (:class:`~torchrl_agent.collectors.MultiProcessStepCollector`: processes;
:class:`~torchrl_agent.collectors.RayStepCollector`: Ray actors) splits the ``num_groups`` groups
of a batch over ``num_collectors`` workers (:func:`split_groups`). Each worker holds a
:class:`CollectorShard`: a :class:`~torchrl_agent.collectors.StepCollector` over its groups whose
:class:`~torchrl_agent.collectors.step_collector.ShardLayout` gives its environments the
single-process ids (``group_id``, ``traj_id``) and makes its env skip the other shards' group
seeds, so it plays the same episodes. With a policy that samples each request from its
``request_seed`` (vLLM; :class:`~torchrl_agent.modules.TransformersPolicy` and
:class:`~torchrl_agent.modules.http_policy.HTTPPolicy` with ``request_seeds=True``) the rows are
the single-process collector's rows.

:class:`ShardedCollector` is the coordinator both collectors derive from: it hands batches out
(``max_batches_ahead``), gathers the shards' rows back in the single-process order (``step_count``,
then ``traj_id``), keeps the budget, the seed and the state; a subclass only sends commands to
its workers (:meth:`ShardedCollector._send`) and gathers their answers (:meth:`ShardedCollector._gather`).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_leaf_nontensor,
    lazy_stack,
)
from torchrl.collectors import BaseCollector
from torchrl.envs import EnvBase

from torchrl_agent.collectors.step_collector import ShardLayout, StepCollector, _BatchStats
from torchrl_agent.modules.policy import LLMPolicy

__all__ = ["CollectorShard", "ConfigEnvFactory", "ShardedCollector", "TextEnvFactory", "merge_shard_batches",
           "pack_rows", "split_groups", "unpack_rows"]


def split_groups(num_groups: int, num_shards: int) -> list[tuple[int, int]]:
    """``(groups, first group)`` of each shard: ``num_groups`` split as evenly as possible, in order."""
    sizes = [num_groups // num_shards + (r < num_groups % num_shards) for r in range(num_shards)]
    return [(size, sum(sizes[:r])) for r, size in enumerate(sizes)]


def pack_rows(rows: TensorDictBase) -> dict:
    """Rows ``[n]`` (a lazy stack of row TensorDicts, as a collector returns them) as one plain message
    for another process: per key one tensor (the rows' tensors stacked, or concatenated with their
    shapes where they differ, as the token ids) or one list (text and other non-tensor data).

    Pickling the rows themselves pickles every tensor of every row (about 1 ms a row each way for an
    ALFWorld row, ``benchmarks/collector_throughput.py``); this message pickles a few objects per key.
    Rows whose keys differ from row to row travel as they are. :func:`unpack_rows` inverts it."""
    parts = list(rows.tensordicts) if isinstance(rows, LazyStackedTensorDict) else list(rows.unbind(0))
    if not parts:
        return {"rows": rows}
    keys = sorted(parts[0].keys(True, True, is_leaf=is_leaf_nontensor), key=str)
    if any(sorted(p.keys(True, True, is_leaf=is_leaf_nontensor), key=str) != keys for p in parts[1:]) or parts[0].batch_size:
        return {"rows": rows}
    dense, ragged, data = {}, {}, {}
    for key in keys:
        values = [p[key] for p in parts]  # a tensor, or a non-tensor's content
        if not all(isinstance(v, torch.Tensor) for v in values):
            data[key] = values
        elif all(v.shape == values[0].shape for v in values):
            dense[key] = torch.stack(values)
        else:
            ragged[key] = (torch.cat([v.reshape(-1) for v in values]), [tuple(v.shape) for v in values])
    return {"n": len(parts), "dense": dense, "ragged": ragged, "data": data}


def unpack_rows(packed: dict) -> list[TensorDictBase]:
    """The rows of a :func:`pack_rows` message, one TensorDict each (its tensors may be views of one
    tensor per key)."""
    if "rows" in packed:
        return list(packed["rows"].unbind(0))
    n = packed["n"]
    batch = TensorDict(batch_size=[n])
    for key, value in packed["dense"].items():
        batch.set(key, value)
    for key, values in packed["data"].items():
        # one NonTensorData per row: from_list would read a list-valued row as a stack of its items
        batch.set(key, NonTensorStack(*(NonTensorData(v, batch_size=[]) for v in values), batch_size=[n]))
    rows = list(batch.unbind(0))
    for key, (flat, shapes) in packed["ragged"].items():
        for row, piece, shape in zip(rows, flat.split([math.prod(s) for s in shapes]), shapes):
            row.set(key, piece.view(shape))
    return rows


def merge_shard_batches(collector, shards: list[tuple[dict, dict]], t0: float, summed: tuple[str, ...],
                        generation_s: float | None = None) -> TensorDictBase:
    """One batch of a collector made of shards: the rows of the shards' batches ``(packed rows,
    figures)``, as rows ``[N]`` in the single-process order (by step, then trajectory). Counts the
    batch and its frames on ``collector`` and sets its ``stats``: the ``summed`` figures added over
    the shards, the seconds since ``t0`` (``collect_time_s``), env steps per second over them, and
    generated tokens per second over ``generation_s`` (default: the same seconds)."""
    rows = [row for packed, _ in shards for row in unpack_rows(packed)]
    rows.sort(key=lambda r: (int(r["step_count"]), int(r["traj_id"])))  # the single-process order
    collector.batches += 1
    collector._frames += len(rows)
    elapsed = time.perf_counter() - t0
    figures = {key: sum(stats[key] for _, stats in shards) for key in summed}
    collector.stats = _BatchStats(collector, {
        "collect_time_s": elapsed, **figures, "env_steps_per_s": figures["env_steps"] / elapsed,
        "tokens_per_s": figures["generated_tokens"] / (elapsed if generation_s is None else generation_s),
        "shard_collect_time_s": [stats["collect_time_s"] for _, stats in shards]})
    return lazy_stack(rows)


class CollectorShard:
    """A worker's :class:`~torchrl_agent.collectors.StepCollector`: groups ``group_offset ..
    group_offset + env.num_groups - 1`` of the ``groups_total`` groups of every batch.

    Args:
        env: the shard's transformed text environment (its ``num_groups`` groups).
        policy: the shard's policy (an engine of its own, or a client of a shared one).
        groups_total: the groups of a whole batch (all shards).
        group_offset: the shard's first group.
        seed: the collector's seed (the same on every shard).
    """

    def __init__(self, env: EnvBase, policy: LLMPolicy, *, groups_total: int, group_offset: int, seed: int):
        self.collector = StepCollector(env, policy, seed=seed)
        g = self.collector.group_size
        self.collector.layout = ShardLayout(groups_total, groups_total * g, group_offset, group_offset * g)

    def collect(self, batch: int) -> tuple[dict, dict]:
        """Batch ``batch``'s rows ``[n]`` of this shard (packed for the coordinator: :func:`pack_rows`)
        and its figures (``env_steps``, ...)."""
        if self.collector.batches != batch:
            raise RuntimeError(f"the shard is at batch {self.collector.batches}, asked for batch {batch}")
        rows = self.collector.collect()
        return pack_rows(rows), dict(self.collector.stats)

    def prepare_next_batch(self) -> None:
        """Reset the shard's games for its next batch (:meth:`StepCollector.prepare_next_batch`)."""
        self.collector.prepare_next_batch()

    def set_seed(self, seed: int) -> None:
        self.collector.set_seed(seed)

    def load_state_dict(self, state: dict) -> None:
        self.collector.load_state_dict(state)

    def update_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load the trained weights into the shard's engine: its ``update_weights`` (vLLM), or its
        model (a transformers engine holding a copy of the trained model)."""
        policy = self.collector.policy
        if type(policy).update_weights is not LLMPolicy.update_weights:
            policy.update_weights(state)
        elif isinstance(getattr(policy, "model", None), torch.nn.Module):
            policy.model.load_state_dict(state)
        else:
            raise TypeError(f"{type(policy).__name__} holds no weights in the collector: update the weights where "
                            "its engine runs (e.g. the HTTP server)")

    def close(self) -> None:
        self.collector.shutdown()


class ShardedCollector(BaseCollector):
    """The coordinator of ``num_collectors`` :class:`CollectorShard` workers (see the module notes).

    Subclasses start the workers and implement :meth:`_send` (one command to every worker, in
    order) and :meth:`_gather` (every shard's answer to ``("collect", epoch, batch)``, in shard
    order). Commands: ``("collect", epoch, batch)``, ``("seed", seed)``, ``("load", state)``.
    ``num_shards`` (default ``num_collectors``): the shards the groups are split into
    (:attr:`shards`: ``(groups, first group)`` each); a worker may hold several.
    """

    init_random_frames = 0  # read by TorchRL's Trainer

    def __init__(self, *, num_groups: int, num_collectors: int, seed: int, total_frames: int,
                 total_batches: int | None, replay_buffer, postproc, max_batches_ahead: int,
                 num_shards: int | None = None):
        super().__init__()
        if not 1 <= num_collectors <= num_groups:
            raise ValueError(f"num_collectors must be in 1..num_groups={num_groups}, got {num_collectors}")
        num_shards = num_collectors if num_shards is None else num_shards
        if not num_collectors <= num_shards <= num_groups:
            raise ValueError(f"num_shards must be in num_collectors..num_groups={num_groups}, got {num_shards}")
        if max_batches_ahead < 0:
            raise ValueError(f"max_batches_ahead must be >= 0, got {max_batches_ahead}")
        if total_batches is not None and total_batches < 1:
            raise ValueError(f"total_batches must be >= 1 or None, got {total_batches}")
        self.num_groups, self.num_collectors, self.seed = num_groups, num_collectors, seed
        self.shards = split_groups(num_groups, num_shards)  # (groups, first group) per shard
        self.total_frames, self.total_batches = total_frames, total_batches
        self.requested_frames_per_batch = self.frames_per_batch = None  # a batch is one episode per env
        self.replay_buffer, self.postproc, self.max_batches_ahead = replay_buffer, postproc, max_batches_ahead
        self.batches, self._frames, self._granted, self._epoch = 0, 0, 0, 0
        self.stats: _BatchStats = _BatchStats(self)
        self._closed = False

    # ------------------------------------------------------------------ the workers (subclasses)
    def _send(self, command: tuple) -> None:
        """Send ``command`` to every worker (workers run their commands in order)."""
        raise NotImplementedError

    def _gather(self, batch: int) -> list[tuple[dict, dict]]:
        """Every shard's ``(packed rows, figures)`` (:meth:`CollectorShard.collect`) of ``(self._epoch,
        batch)``, in shard order; answers of an earlier epoch are dropped."""
        raise NotImplementedError

    def _drop_in_flight(self) -> None:
        """Forget the answers of the current epoch not gathered yet (called before a restart)."""

    # ------------------------------------------------------------------ collection
    def _grant(self, batch: int) -> None:
        """Command batches ``self._granted .. batch + max_batches_ahead`` from every shard (the ones
        ahead only within ``total_batches``)."""
        last = batch + self.max_batches_ahead
        if self.total_batches is not None:
            last = max(batch, min(last, self.total_batches - 1))
        while self._granted <= last:
            self._send(("collect", self._epoch, self._granted))
            self._granted += 1

    def collect(self) -> TensorDictBase:
        """The next batch: one episode in every environment of every shard, rows ``[N]`` in the
        single-process order."""
        if self._closed:
            raise RuntimeError("the collector was shut down")
        t0 = time.perf_counter()
        batch = self.batches
        self._grant(batch)
        shards = self._gather(batch)
        return merge_shard_batches(self, shards, t0, ("env_steps", "generated_tokens", "generation_slots"))

    # the same loop and budget as the single-process collector's
    iterator = StepCollector.iterator
    _budget_spent = StepCollector._budget_spent

    @property
    def _iter(self) -> int:
        return self.batches - 1

    def __len__(self) -> int:
        return StepCollector.__len__(self)

    # ------------------------------------------------------------------ control
    def _restart_at(self, command: tuple, batches: int) -> None:
        self._drop_in_flight()
        self._epoch += 1  # batches still in flight belong to the old epoch: dropped when they arrive
        self._send(command)
        self.batches = self._granted = batches

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Restart collection from ``seed`` on every shard."""
        self.seed, self._frames = seed, 0
        self._restart_at(("seed", seed), 0)
        return seed

    def state_dict(self) -> dict:
        return {"batches": self.batches, "seed": self.seed, "frames": self._frames}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self._frames = state["seed"], state.get("frames", 0)
        self._restart_at(("load", dict(state)), state["batches"])

    def get_model(self, model_id: str):
        raise KeyError("the policies live in the collector workers: pass the weights to update_policy_weights_")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.shutdown()


@dataclass
class TextEnvFactory:
    """A picklable ``env_factory``: ``make_env(name, num_groups=..., group_size=..., **env_kwargs)``
    under window memory, the env's prompt template and the action projection.

    Args:
        name: a registered environment (``"numberline"``, ``"alfworld"``, ...); also the prompt template.
        tokenizer_path: the model folder whose tokenizer renders the prompts.
        group_size, memory_window, action_format: as in the training config (``env.group_size``,
            ``memory.window``, ``env.action_format``).
        env_kwargs: more keyword arguments of the environment (``max_steps``, ...).
    """

    name: str
    tokenizer_path: str
    group_size: int = 1
    memory_window: int = 2
    action_format: str = "tags"
    env_kwargs: dict = field(default_factory=dict)

    def __call__(self, num_groups: int) -> EnvBase:
        from torchrl.envs import Compose, TransformedEnv
        from transformers import AutoTokenizer

        from torchrl_agent.envs import make_env
        from torchrl_agent.envs.transforms import ActionProjection, PromptTransform, WindowMemory

        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        env = make_env(self.name, num_groups=num_groups, group_size=self.group_size, **self.env_kwargs)
        return TransformedEnv(env, Compose(WindowMemory(self.memory_window), PromptTransform(tokenizer, self.name),
                                           ActionProjection(self.action_format)))


@dataclass
class ConfigEnvFactory:
    """A picklable ``env_factory`` from a training config: the trainer's own environment
    (:func:`~torchrl_agent.envs.factory.build_env`: memory, prompt budget, template, projection
    of ``cfg``) with ``num_groups`` groups.

    Args:
        cfg: a :class:`~torchrl_agent.trainers.config.TrainConfig` (``compose_config([...])``).
            ``memory.kind=summary`` needs the policy in the env, which a factory does not have.
    """

    cfg: Any

    def __post_init__(self):
        if self.cfg.memory.kind == "summary":
            raise ValueError("memory.kind=summary summarises with the policy: not available to an env factory")

    def __call__(self, num_groups: int) -> EnvBase:
        from transformers import AutoTokenizer

        from torchrl_agent.envs.factory import build_env
        from torchrl_agent.models import model_path

        cfg = copy.deepcopy(self.cfg)
        cfg.env.num_groups = num_groups
        return build_env(cfg, AutoTokenizer.from_pretrained(model_path(cfg.model)))

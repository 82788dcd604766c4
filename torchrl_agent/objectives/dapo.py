"""DAPO dynamic sampling: drop groups whose trajectories all have the same episode reward.

A group where every trajectory got the same episode reward has zero group-relative advantage
everywhere, so it carries no learning signal. The reference collects again (up to 10 times)
until the batch holds ``target_groups`` informative groups; the last try keeps everything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import NestedKey, TensorDictBase
from tensordict.nn import TensorDictModuleBase

from torchrl_agent.objectives._keys import KeysMixin
from torchrl_agent.objectives.functional import _as_1d, _check_ids, _check_reward, _dense_ids

__all__ = ["informative_group_mask", "DynamicSamplingFilter", "DynamicSamplingAccumulator"]


def informative_group_mask(
    reward: torch.Tensor,
    group_id: torch.Tensor,
    traj_id: torch.Tensor,
    *,
    atol: float = 1e-6,
) -> torch.Tensor:
    """Bool mask [N] of the rows whose group's episode rewards are not all equal.

    ``reward`` [N] (or [N, 1]) step rewards, ``group_id`` / ``traj_id`` [N] int64; the episode
    reward of a trajectory is the sum of its rows' rewards; a group is kept when
    ``max - min > atol`` over its trajectories' episode rewards (so a one-trajectory group is
    dropped). Vectorised (``index_add`` / ``scatter_reduce``).
    """
    reward = _check_reward(reward)
    n = reward.shape[0]
    group_id = _check_ids("group_id", group_id, n)
    traj_id = _check_ids("traj_id", traj_id, n)
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=reward.device)
    r = reward.double() if reward.device.type != "mps" else reward
    tinv, k = _dense_ids(traj_id)
    ep = torch.zeros(k, dtype=r.dtype, device=r.device).index_add_(0, tinv, r)[tinv]  # per row
    ginv, g = _dense_ids(group_id)
    gmax = torch.full((g,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, ginv, ep, "amax")
    gmin = torch.full((g,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, ginv, ep, "amin")
    return ((gmax - gmin) > atol)[ginv]


class DynamicSamplingFilter(KeysMixin, TensorDictModuleBase):
    """Keeps the rows of informative groups (see :func:`informative_group_mask`).

    Input: a rows TensorDict, batch [N], with ``reward`` [N,1], ``group_id`` [N], ``traj_id`` [N]
    (keys overridable with :meth:`set_keys`). Returns the subset ``rows[mask]``;
    :meth:`mask` returns the bool mask [N].
    """

    @dataclass
    class _AcceptedKeys:
        """Configurable tensordict keys."""

        reward: NestedKey = "reward"
        group_id: NestedKey = "group_id"
        traj_id: NestedKey = "traj_id"

    default_keys = _AcceptedKeys

    def __init__(self, *, atol: float = 1e-6) -> None:
        super().__init__()
        self.atol = atol
        self._tensor_keys = self._AcceptedKeys()
        self.out_keys = []
        self._keys_changed()

    def _keys_changed(self) -> None:
        self.in_keys = [self._tensor_keys.reward, self._tensor_keys.group_id, self._tensor_keys.traj_id]

    def mask(self, rows: TensorDictBase) -> torch.Tensor:
        """Bool mask [N] of the rows to keep."""
        if rows.ndim != 1:
            raise ValueError(f"expected a tensordict of rows with batch [N], got {tuple(rows.batch_size)}.")
        k = self.tensor_keys
        missing = [key for key in (k.reward, k.group_id, k.traj_id) if rows.get(key, None) is None]
        if missing:
            raise KeyError(f"DynamicSamplingFilter: keys {missing} not found in the tensordict.")
        return informative_group_mask(rows.get(k.reward), rows.get(k.group_id), rows.get(k.traj_id), atol=self.atol)

    def forward(self, rows: TensorDictBase) -> TensorDictBase:
        return rows[self.mask(rows)]


class DynamicSamplingAccumulator:
    """Accumulates informative groups over up to ``max_tries`` collections.

    Usage::

        acc = DynamicSamplingAccumulator(target_groups=16)
        while not acc.ready:
            acc.add(collect_rows())   # rows TensorDict, batch [N]
        batch = acc.pop()             # at most 16 groups, then the accumulator is reset

    Each :meth:`add` counts one try. Before the last try only informative groups are kept; the
    ``max_tries``-th try keeps every group it brings. Groups are kept whole, in order of first
    appearance. With ``trim=True`` (default) only ``target_groups`` are held (extra groups are
    dropped); ``trim=False`` keeps every group a try brings, as the reference does (its batch
    may then exceed the target). With ``relabel=True`` (default) ``group_id`` and ``traj_id``
    are renumbered ``0, 1, ...`` across tries, so ids reused by successive collections never
    merge two groups. :meth:`fill` runs the whole loop for a collection function.
    """

    def __init__(
        self,
        target_groups: int,
        *,
        max_tries: int = 10,
        filter: DynamicSamplingFilter | None = None,
        relabel: bool = True,
        trim: bool = True,
    ) -> None:
        if int(target_groups) < 1:
            raise ValueError(f"`target_groups` must be >= 1, got {target_groups}.")
        if int(max_tries) < 1:
            raise ValueError(f"`max_tries` must be >= 1, got {max_tries}.")
        self.target_groups = int(target_groups)
        self.max_tries = int(max_tries)
        self.filter = filter if filter is not None else DynamicSamplingFilter()
        self.relabel = relabel
        self.trim = trim
        self.last_tries = 0
        self.reset()

    def reset(self) -> None:
        self.tries = 0
        self.num_groups = 0
        self._parts: list[TensorDictBase] = []
        self._next_traj = 0

    @property
    def ready(self) -> bool:
        """True when ``target_groups`` groups are held or ``max_tries`` tries were made."""
        return self.num_groups >= self.target_groups or self.tries >= self.max_tries

    def add(self, rows: TensorDictBase) -> bool:
        """Adds one collection of rows (batch [N]); returns :attr:`ready`."""
        if self.ready:
            raise RuntimeError("DynamicSamplingAccumulator is full: call pop() before adding more rows.")
        self.tries += 1
        k = self.filter.tensor_keys
        keep = self.filter.mask(rows)
        if self.tries >= self.max_tries:
            keep = torch.ones_like(keep)  # the last try keeps everything
        if not bool(keep.any()):
            return self.ready
        rows = rows[keep.nonzero().squeeze(-1)]  # (index tensors also work on lazy stacks)
        if rows.numel():
            group_id = _as_1d("group_id", rows.get(k.group_id)).long()
            uniq, first = _first_appearance(group_id)
            room = self.target_groups - self.num_groups if self.trim else uniq.numel()
            ginv, _ = _dense_ids(group_id)
            order_rank = torch.empty_like(first)
            order_rank[torch.argsort(first)] = torch.arange(first.numel(), device=first.device)
            rank = order_rank[ginv]  # rank of each row's group by first appearance
            fits = rank < room
            rows = rows[fits.nonzero().squeeze(-1)]
            rank = rank[fits]
            if rows.numel():
                if self.relabel:
                    rows = rows.clone(False)
                    new_gid = (rank + self.num_groups).reshape(rows.get(k.group_id).shape)
                    rows.set(k.group_id, new_gid.to(rows.get(k.group_id).dtype))
                    tinv, nt = _dense_ids(_as_1d("traj_id", rows.get(k.traj_id)).long())
                    new_tid = (tinv + self._next_traj).reshape(rows.get(k.traj_id).shape)
                    rows.set(k.traj_id, new_tid.to(rows.get(k.traj_id).dtype))
                    self._next_traj += nt
                self._parts.append(rows)
                self.num_groups += int(min(room, uniq.numel()))
        return self.ready

    def fill(self, collect) -> TensorDictBase | None:
        """Calls ``collect()`` (returns a rows TensorDict) until :attr:`ready`, then :meth:`pop` s.

        The number of tries made is left in :attr:`last_tries`."""
        while not self.ready:
            self.add(collect())
        return self.pop()

    def pop(self) -> TensorDictBase | None:
        """Returns the accumulated rows (``None`` if none) and resets the accumulator."""
        parts = self._parts
        self.last_tries = self.tries
        self.reset()
        if not parts:
            return None
        return torch.cat(parts, 0)


def _first_appearance(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids (sorted) and the index of each one's first row."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    first = torch.full((uniq.numel(),), ids.numel(), dtype=torch.long, device=ids.device)
    first.scatter_reduce_(0, inv, torch.arange(ids.numel(), device=ids.device), "amin")
    return uniq, first

"""Functional advantage estimators for LLM agents (GiGPO, GRPO, GRPO pass@k, RLOO, REINFORCE++-baseline, ReMax).

Every function takes one entry per **row** (one environment step of one trajectory), in any
order, and is fully vectorised: groups, anchor groups and trajectories are handled with
``unique`` / ``bincount`` / ``scatter_add`` / ``scatter_reduce`` tensor ops, never with a Python
loop over rows or groups. The semantics are the reference ones stated in ``docs/algorithms.md``:

- statistics are taken over **rows** (a longer trajectory weighs more in its group);
- a normalisation set of one row has mean 0 and std 1;
- the std is the unbiased (Bessel) one;
- a set whose values are all equal (up to the rounding of ``reward``'s dtype) gives exactly 0,
  unlike the float32 reference, whose rounding noise divided by ``std + 1e-6`` gives spurious
  advantages;
- the invalid-action penalty ``c`` is applied to a row's own score and step return, after
  discounting.

Statistics are accumulated in float64 whatever the input dtype; the output has the dtype of
``reward`` (float64 in, float64 out; float32 in, float32 out).
"""

from __future__ import annotations

import warnings
from difflib import SequenceMatcher
from typing import Literal

import torch

__all__ = [
    "episode_scores",
    "group_normalize",
    "discounted_step_returns",
    "gigpo_advantage",
    "graph_state_ids",
    "graphgpo_advantage",
    "grpo_advantage",
    "hgpo_advantage",
    "rloo_advantage",
    "reinforce_pp_baseline_advantage",
    "grpo_passk_advantage",
    "remax_advantage",
    "similarity_anchor_ids",
]

Norm = Literal["mean_std", "mean"]
_NORMS = ("mean_std", "mean")


# --------------------------------------------------------------------------- input checks
def _as_1d(name: str, x: torch.Tensor | None, n: int | None = None) -> torch.Tensor | None:
    """Accepts ``[N]`` or ``[N, 1]`` and returns ``[N]``; raises a clear error otherwise."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}.")
    if x.ndim == 2 and x.shape[-1] == 1:
        x = x.squeeze(-1)
    if x.ndim != 1:
        raise ValueError(f"`{name}` must have shape [N] or [N, 1], got {tuple(x.shape)}.")
    if n is not None and x.shape[0] != n:
        raise ValueError(f"`{name}` has {x.shape[0]} rows, expected {n} (the number of rows of `reward`).")
    return x


def _check_reward(reward: torch.Tensor) -> torch.Tensor:
    reward = _as_1d("reward", reward)
    if not reward.is_floating_point():
        raise TypeError(f"`reward` must be a floating-point tensor, got {reward.dtype}.")
    return reward


def _check_ids(name: str, x: torch.Tensor, n: int) -> torch.Tensor:
    x = _as_1d(name, x, n)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"`{name}` must be an integer tensor (int64), got {x.dtype}.")
    return x.long()


def _check_valid(valid: torch.Tensor | None, n: int, device) -> torch.Tensor:
    if valid is None:
        return torch.ones(n, dtype=torch.bool, device=device)
    valid = _as_1d("valid", valid, n)
    if valid.is_floating_point():
        return valid != 0
    return valid.bool()


def _check_norm(norm: str) -> None:
    if norm not in _NORMS:
        raise ValueError(f"`norm` must be one of {_NORMS}, got {norm!r}.")


def _acc_dtype(reward: torch.Tensor) -> torch.dtype:
    # float64 accumulation whatever the input; float64 is unavailable on some accelerators (mps).
    return torch.float32 if reward.device.type == "mps" else torch.float64


def _dense_1d(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Maps int ids [N] to dense ids ``0..K-1`` (sorted order); returns (inverse [N], K).

    Small id ranges use a ``bincount`` remap (O(N + range)); others (e.g. 64-bit hashes) ``unique``.
    """
    n = x.numel()
    if n == 0:
        return x.long(), 0
    lo, hi = int(x.min()), int(x.max())
    if hi - lo + 1 <= 6 * n + 1024:
        shifted = x - lo
        remap = torch.cumsum(torch.bincount(shifted, minlength=hi - lo + 1) > 0, 0) - 1
        return remap.index_select(0, shifted), int(remap[-1]) + 1
    uniq, inverse = torch.unique(x, return_inverse=True)
    return inverse, uniq.numel()


def _dense_ids(*ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense ids of one id or of a tuple of ids taken row-wise (lexicographic); (inverse [N], K)."""
    inverse, k = _dense_1d(ids[0])
    for other in ids[1:]:
        inv2, k2 = _dense_1d(other)
        inverse, k = _dense_1d(inverse * k2 + inv2)
    return inverse, k


def _pair_ids(ginv: torch.Tensor, kg: int, anchor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense ids of the (group, anchor) pairs; fast when no anchor value is shared by two groups."""
    ainv, ka = _dense_1d(anchor)
    lo = torch.full((ka,), kg, dtype=ginv.dtype, device=ginv.device).scatter_reduce_(0, ainv, ginv, "amin")
    hi = torch.full((ka,), -1, dtype=ginv.dtype, device=ginv.device).scatter_reduce_(0, ainv, ginv, "amax")
    if bool((lo == hi).all()):  # every anchor value lives in one group: the anchor alone is the key
        return ainv, ka
    return _dense_1d(ginv * ka + ainv)


def _group_amax(zeros: torch.Tensor, inv: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``max(0, max of values [N] in each set)`` [K] (``zeros`` [K]). ``index_reduce`` is about twice
    ``scatter_reduce``'s speed on CPU here; it warns once that it is a beta API (silenced)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")
        return zeros.index_reduce(0, inv, values, "amax")


def _normalize(x, inv, k, *, norm, eps, singleton_zero=False, value_dtype=None, unbiased=True, zero_at_mean=False,
               mag=None):
    """:func:`group_normalize` on dense ids ``inv`` [N] in ``0..k-1``; ``x`` in the accumulation dtype.

    ``unbiased=False``: the population std (HGPO). ``zero_at_mean=True``: every row equal to its
    set's mean up to rounding gets exactly 0, not only all-equal sets (HGPO drops zero items, so
    "exactly at the mean" must not depend on the rounding of the mean). ``mag`` [N]: the magnitude
    of the terms each ``x`` was computed from (default ``|x|``), the scale of "equal up to rounding"
    when ``x`` is a difference that cancels (``10 * 0.1 ** 2 - 0.1`` is ``1.4e-17``, not 0)."""
    scale_ulp = 4 * torch.finfo(value_dtype or x.dtype).eps
    zeros = torch.zeros(k, dtype=x.dtype, device=x.device)
    count = torch.bincount(inv, minlength=k).to(x.dtype)
    single = count == 1
    mean = zeros.scatter_add(0, inv, x) / count  # a set of one row: its value, so that its row is 0
    if not singleton_zero:
        mean = torch.where(single, 0.0, mean)
    dev = x - mean.index_select(0, inv)
    if zero_at_mean and int(count.max()) <= 65536:
        # a row is 0 when |x - mean| is within the rounding of the mean (a sum of `count` values):
        # 4 * count ulps of the set's magnitude, at least the all-equal tolerance below. An all-equal
        # set then needs no test of its own: its rows are within (1 - 1/n) * 4 ulp(value_dtype) of the
        # exact mean, and the computed mean is off by at most n / 2 ulp(float64) of the magnitude,
        # inside the tolerance for sets of up to 2 ** 16 rows (float32 values; any size in float64)
        absmax = _group_amax(zeros, inv, x.abs() if mag is None else torch.maximum(x.abs(), mag))
        tol = torch.maximum(scale_ulp * absmax, 4 * count * torch.finfo(x.dtype).eps * absmax)
        if not singleton_zero:  # a set of one row keeps its value
            tol = torch.where(single, -1.0, tol)
        dev = dev * (dev.abs() > tol.index_select(0, inv))  # (bool mask products: `where` is slower on CPU)
    else:
        # all-equal sets (of >= 2 rows) give exactly 0, whatever the rounding of the mean: a set is
        # all-equal when max - min is within a few ulps (of the values' dtype) of its magnitude
        gmax = torch.full((k,), -torch.inf, dtype=x.dtype, device=x.device).scatter_reduce_(0, inv, x, "amax")
        gmin = torch.full((k,), torch.inf, dtype=x.dtype, device=x.device).scatter_reduce_(0, inv, x, "amin")
        mag_g = torch.maximum(gmax.abs(), gmin.abs())
        if mag is not None:
            mag_g = torch.maximum(mag_g, torch.zeros_like(mag_g).scatter_reduce_(0, inv, mag, "amax"))
        tol = scale_ulp * mag_g
        all_equal = (gmax - gmin) <= tol
        zero_set = (all_equal & ~single) | (single & singleton_zero)
        zero_row = zero_set.index_select(0, inv)
        if zero_at_mean:  # |x - mean| within the rounding of the mean (a sum of `count` values) is exactly 0
            tol = torch.maximum(tol, 4 * count * torch.finfo(x.dtype).eps * mag_g)
            zero_row = zero_row | ((dev.abs() <= tol.index_select(0, inv)) & ~single.index_select(0, inv))
        dev = dev * ~zero_row
    if norm == "mean_std":
        sq = zeros.scatter_add(0, inv, dev * dev)
        std = torch.where(single, 1.0, (sq / (count - int(unbiased)).clamp_min(1)).sqrt())
        dev = dev * (1.0 / (std + eps)).index_select(0, inv)
    return dev


def _episode_scores(r, tinv, kt, valid, invalid_penalty, score_penalty=None):
    ep = torch.zeros(kt, dtype=r.dtype, device=r.device).scatter_add_(0, tinv, r)
    s = ep.index_select(0, tinv) - invalid_penalty * (~valid).to(r.dtype)
    if score_penalty is not None:  # e.g. the KL-in-reward penalty of the row (reference: token_level_rewards)
        s = s - _as_1d("score_penalty", score_penalty, r.shape[0]).to(r.dtype)
    return s


def _positions(tinv: torch.Tensor, kt: int, step: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Rank [N] of each row inside its trajectory (ordered by ``step``) and the longest length."""
    counts = torch.bincount(tinv, minlength=kt)
    t_max = int(counts.max())
    smin = torch.full((kt,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=step.device)
    pos = step - smin.scatter_reduce_(0, tinv, step, "amin").index_select(0, tinv)
    # fast path: steps are consecutive inside every trajectory (no gap, no duplicate) -> rank = step - min
    if bool((pos < counts.index_select(0, tinv)).all()) and int(torch.bincount(tinv * t_max + pos).max()) <= 1:
        return pos, t_max
    # general case: sort by (trajectory, step) with two stable sorts and take the rank in the segment
    order = torch.argsort(step, stable=True)
    order = order[torch.argsort(tinv[order], stable=True)]
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(tinv)
    pos[order] = torch.arange(tinv.numel(), device=tinv.device) - starts[tinv[order]]
    return pos, t_max


def _discount_matrix(t_max: int, gamma: float, r: torch.Tensor) -> torch.Tensor:
    """``G`` [T, T] with ``G[k, t] = gamma ** (k - t)`` for ``k >= t``, else 0 (``r``'s dtype and device)."""
    idx = torch.arange(t_max, device=r.device)
    lag = idx[:, None] - idx[None, :]  # lag[k, t] = k - t
    return torch.where(lag >= 0, torch.as_tensor(gamma, dtype=r.dtype, device=r.device) ** lag.clamp_min(0), 0.0)


def _discounted(r, tinv, kt, step, gamma, with_magnitude=False, positions=None):
    """Discounted returns [N]; ``with_magnitude``: also ``sum_k |r_k| gamma**(k - t)`` (the scale of
    their rounding), as a tuple. ``positions``: :func:`_positions`' result, if already computed."""
    pos, t_max = positions if positions is not None else _positions(tinv, kt, step)
    flat = tinv * t_max + pos  # row -> cell of the padded [num_traj, T] matrix
    padded = torch.zeros(kt * t_max, dtype=r.dtype, device=r.device).index_copy_(0, flat, r).view(kt, t_max)
    # the magnitude of non-negative rewards' returns is the returns themselves
    signed = with_magnitude and not bool((r >= 0).all())
    if signed:
        padded = torch.cat([padded, padded.abs()])
    out = (padded @ _discount_matrix(t_max, gamma, r)).view(-1)  # R[:, t] = sum_{k >= t} r[:, k] * gamma**(k - t)
    returns = out.index_select(0, flat)
    if not with_magnitude:
        return returns
    return returns, out.index_select(0, flat + kt * t_max) if signed else returns


# --------------------------------------------------------------------------- building blocks
def group_normalize(
    x: torch.Tensor,
    group_id: torch.Tensor,
    *,
    norm: Norm = "mean_std",
    eps: float = 1e-6,
    singleton_zero: bool = False,
    value_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Normalises ``x`` [N] inside the sets of rows sharing ``group_id`` [N] (any int64 ids).

    ``mean_std``: ``(x - mean) / (std + eps)`` (unbiased std); ``mean``: ``x - mean``.
    A set of one row has mean 0 and std 1 (``singleton_zero=True`` gives 0 instead, as GiGPO's
    step term). A set of >= 2 rows whose values are all equal gives exactly 0: "equal" means
    ``max - min <= 4 * finfo(value_dtype).eps * max(|max|, |min|)``, i.e. equal up to the
    rounding of the values' own dtype (``value_dtype``, default ``x.dtype``; e.g. float32 step rewards
    ``0.1 + 0.2 + 0.3`` and ``0.6`` differ in float64 but are the same float32 episode reward).
    Returns a tensor [N] of ``x``'s dtype.
    """
    _check_norm(norm)
    x = _as_1d("x", x)
    if not x.is_floating_point():
        raise TypeError(f"`x` must be a floating-point tensor, got {x.dtype}.")
    group_id = _check_ids("group_id", group_id, x.shape[0])
    if x.numel() == 0:
        return x.clone()
    inv, k = _dense_ids(group_id)
    out = _normalize(x.to(_acc_dtype(x)), inv, k, norm=norm, eps=eps, singleton_zero=singleton_zero,
                     value_dtype=value_dtype or x.dtype)
    return out.to(x.dtype)


def episode_scores(
    reward: torch.Tensor,
    traj_id: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    invalid_penalty: float = 0.1,
) -> torch.Tensor:
    """Per-row score ``S_row = episode_reward(traj) - c * (1 - valid_row)``.

    ``reward`` [N] float (the env reward of each step), ``traj_id`` [N] int64, ``valid`` [N] bool.
    ``episode_reward`` is the sum of the trajectory's step rewards. Returns [N] in ``reward``'s dtype.
    """
    reward = _check_reward(reward)
    n = reward.shape[0]
    traj_id = _check_ids("traj_id", traj_id, n)
    valid = _check_valid(valid, n, reward.device)
    tinv, kt = _dense_ids(traj_id)
    return _episode_scores(reward.to(_acc_dtype(reward)), tinv, kt, valid, invalid_penalty).to(reward.dtype)


def discounted_step_returns(
    reward: torch.Tensor,
    traj_id: torch.Tensor,
    step: torch.Tensor,
    *,
    gamma: float = 0.95,
) -> torch.Tensor:
    """Discounted return of each row inside its trajectory: ``R_t = r_t + gamma * R_{t+1}``.

    Rows are ordered inside each trajectory by ``step`` [N] (int64); their rank, not the raw
    value, is the time index. Vectorised as a reverse discounted cumsum: rows are scattered into a
    padded ``[num_traj, T]`` matrix and multiplied by the upper-triangular Toeplitz matrix
    ``G[k, t] = gamma**(k - t)`` (``k >= t``), which only uses non-negative powers of ``gamma``
    (numerically stable, unlike the ``gamma**-t`` rescaled cumsum). Returns [N] in ``reward``'s dtype.
    """
    reward = _check_reward(reward)
    n = reward.shape[0]
    traj_id = _check_ids("traj_id", traj_id, n)
    step = _check_ids("step", step, n)
    r = reward.to(_acc_dtype(reward))
    if n == 0:
        return reward.clone()
    tinv, kt = _dense_ids(traj_id)
    return _discounted(r, tinv, kt, step, gamma).to(reward.dtype)


# --------------------------------------------------------------------------- estimators
def _scores_and_groups(reward, group_id, traj_id, valid, invalid_penalty, score_penalty=None):
    """Checks the common inputs; returns (acc reward, valid, scores, group inverse, K groups, traj inverse, K trajs)."""
    reward = _check_reward(reward)
    n = reward.shape[0]
    group_id = _check_ids("group_id", group_id, n)
    traj_id = _check_ids("traj_id", traj_id, n)
    valid = _check_valid(valid, n, reward.device)
    r = reward.to(_acc_dtype(reward))
    ginv, kg = _dense_ids(group_id)
    tinv, kt = _dense_ids(traj_id)
    return r, valid, _episode_scores(r, tinv, kt, valid, invalid_penalty, score_penalty), ginv, kg, tinv, kt


def grpo_advantage(
    reward: torch.Tensor,
    group_id: torch.Tensor,
    traj_id: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    invalid_penalty: float = 0.1,
    norm: Norm = "mean_std",
    eps: float = 1e-6,
    score_penalty: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO: ``A = norm(S_row, rows of the same group)``, ``S_row = episode_reward - c*(1-valid)``.

    Args: ``reward`` [N] float step rewards, ``group_id`` / ``traj_id`` [N] int64, ``valid`` [N]
    bool (``None``: all valid). ``score_penalty`` [N] (optional) is subtracted from ``S_row``
    (the KL-in-reward penalty ``beta * sum_t kl_t`` of the row; every estimator below takes it).
    Returns ``A`` [N] in ``reward``'s dtype.
    """
    _check_norm(norm)
    r, _, s, ginv, kg, _, _ = _scores_and_groups(reward, group_id, traj_id, valid, invalid_penalty, score_penalty)
    if r.numel() == 0:
        return reward.reshape(-1).clone()
    return _normalize(s, ginv, kg, norm=norm, eps=eps, value_dtype=reward.dtype).to(reward.dtype)


def gigpo_advantage(
    reward: torch.Tensor,
    group_id: torch.Tensor,
    traj_id: torch.Tensor,
    step: torch.Tensor,
    anchor: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    gamma: float = 0.95,
    omega: float = 1.0,
    invalid_penalty: float = 0.1,
    norm: Norm = "mean_std",
    eps: float = 1e-6,
    score_penalty: torch.Tensor | None = None,
) -> torch.Tensor:
    """GiGPO: ``A = A_E + omega * A_S``.

    - ``A_E`` = :func:`grpo_advantage` (episode term);
    - ``R_t`` = discounted step return inside the trajectory (``gamma``), then
      ``R_t -= c * (1 - valid_t)`` (penalty after discounting, never propagated);
    - ``A_S = norm(R_t, rows of the same (group_id, anchor))``; an anchor group of one row gets 0.

    Args: ``reward`` [N] float, ``group_id`` / ``traj_id`` / ``step`` / ``anchor`` [N] int64,
    ``valid`` [N] bool. ``score_penalty`` (see :func:`grpo_advantage`) enters the episode term only,
    as in the reference (its step term uses the env step rewards). Returns [N] in ``reward``'s dtype.
    """
    _check_norm(norm)
    r, valid, s, ginv, kg, tinv, kt = _scores_and_groups(reward, group_id, traj_id, valid, invalid_penalty,
                                                         score_penalty)
    n = r.numel()
    step = _check_ids("step", step, n)
    anchor = _check_ids("anchor", anchor, n)
    if n == 0:
        return reward.reshape(-1).clone()
    a_episode = _normalize(s, ginv, kg, norm=norm, eps=eps, value_dtype=reward.dtype)
    step_return = _discounted(r, tinv, kt, step, gamma) - invalid_penalty * (~valid).to(r.dtype)
    ainv, ka = _pair_ids(ginv, kg, anchor)  # anchor groups: (group, anchor) pairs
    a_step = _normalize(step_return, ainv, ka, norm=norm, eps=eps, singleton_zero=True, value_dtype=reward.dtype)
    return (a_episode + omega * a_step).to(reward.dtype)


def _traj_matrix(values: torch.Tensor, tinv: torch.Tensor, kt: int, pos: torch.Tensor, t_max: int,
                 fill: int = -1) -> torch.Tensor:
    """``values`` [N] scattered into the flat padded ``[num_traj * T]`` matrix (``fill`` elsewhere):
    cell ``tinv * T + pos`` holds the row at rank ``pos`` of its trajectory."""
    out = torch.full((kt * t_max,), fill, dtype=values.dtype, device=values.device)
    return out.index_copy_(0, tinv * t_max + pos, values)


def hgpo_advantage(
    reward: torch.Tensor,
    group_id: torch.Tensor,
    traj_id: torch.Tensor,
    step: torch.Tensor,
    anchor: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    history_length: int = 2,
    gamma: float = 0.95,
    alpha: float = 1.0,
    base_group: bool = False,
    invalid_penalty: float = 0.1,
    norm: Norm = "mean_std",
    eps: float = 1e-6,
    score_penalty: torch.Tensor | None = None,
) -> torch.Tensor:
    """HGPO (Hierarchy-of-Groups): the step return normalised in history-context groups of lengths 1..K+1.

    - ``R_t`` = GiGPO's discounted step return (``gamma``), minus ``c * (1 - valid_t)``;
    - for ``k = 1 .. K + 1`` (``K = history_length``), a row at rank ``s >= k - 1`` of its trajectory
      joins the group ``(group_id, anchor_{s-k+1}, ..., anchor_s)`` (the anchors of its last ``k``
      steps); in each group of ``n >= 2`` rows ``a_k = norm(R_t)`` with the **population** std;
    - items ``(k, a_k)``, with ``(0, A_E)`` first when ``base_group`` (``A_E`` as :func:`grpo_advantage`);
      items equal to 0 are dropped (all-equal groups, rows at their group's mean); then
      ``A = sum_k w_k a_k / (sum_k w_k + eps)`` with ``w_k = (k + 1) ** alpha``; no item: ``A = 0``.

    Args: ``reward`` [N] float, ``group_id`` / ``traj_id`` / ``step`` / ``anchor`` [N] int64,
    ``valid`` [N] bool. ``score_penalty`` enters ``A_E`` only (as :func:`gigpo_advantage`).
    Returns [N] in ``reward``'s dtype.
    """
    _check_norm(norm)
    if int(history_length) < 0:
        raise ValueError(f"`history_length` must be >= 0, got {history_length}.")
    r, valid, s, ginv, kg, tinv, kt = _scores_and_groups(reward, group_id, traj_id, valid, invalid_penalty,
                                                         score_penalty)
    n = r.numel()
    step = _check_ids("step", step, n)
    anchor = _check_ids("anchor", anchor, n)
    if n == 0:
        return reward.reshape(-1).clone()
    vd = reward.dtype
    pos, t_max = _positions(tinv, kt, step)
    step_return, mag = _discounted(r, tinv, kt, step, gamma, with_magnitude=True, positions=(pos, t_max))
    penalty = invalid_penalty * (~valid).to(r.dtype)
    step_return, mag = step_return - penalty, mag + penalty
    # the context of a row at rank s: (group, anchor_s) (dense id `key`), then the codes of anchor_{s-1},
    # ..., anchor_{s-K}; code `width` = "no such step". An anchor's code is its rank among its group's
    # anchors when every anchor value lives in one group (a small code range), else its dense id.
    ainv, ka = _dense_1d(anchor)
    lo = torch.full((ka,), kg, dtype=torch.long, device=r.device).scatter_reduce_(0, ainv, ginv, "amin")
    hi = torch.full((ka,), -1, dtype=torch.long, device=r.device).scatter_reduce_(0, ainv, ginv, "amax")
    if bool((lo == hi).all()):
        key, kk = ainv, ka
        per_group = torch.bincount(lo, minlength=kg)
        order = torch.argsort(lo, stable=True)
        local = torch.empty_like(lo)
        local[order] = torch.arange(ka, device=r.device) - (torch.cumsum(per_group, 0) - per_group).index_select(
            0, lo.index_select(0, order))
        code, width = local.index_select(0, ainv), int(per_group.max())
    else:
        key, kk = _dense_1d(ginv * ka + ainv)
        code, width = ainv, ka
    levels = int(history_length) + 1
    # the anchor codes in a padded [num_traj, K + T] matrix whose first K columns are "no such step"
    # (code `width`): the code of anchor_{s-j} of a row at rank s sits j cells before the row's own
    t_pad = t_max + levels - 1
    cell = tinv * t_pad + pos + (levels - 1)
    padded = torch.full((kt * t_pad,), width, dtype=torch.long, device=r.device).index_copy_(0, cell, code)
    # the level-k context of every row, levels stacked: ids of level k offset by the number of the levels before
    keys, offset = [key], kk
    for k in range(2, levels + 1):  # level k: the level-(k-1) context and the code of anchor_{s-k+1}
        key, kk = _dense_1d(key * (width + 1) + padded.index_select(0, cell - (k - 1)))
        keys.append(key + offset)
        offset += kk
    a = _normalize(step_return.repeat(levels), torch.cat(keys), offset, norm=norm, eps=eps, singleton_zero=True,
                   value_dtype=vd, unbiased=False, zero_at_mean=True, mag=mag.repeat(levels)).view(levels, n)
    a = a * (pos >= torch.arange(levels, device=r.device)[:, None])  # a row at rank s < k - 1: no level-k context
    w = torch.arange(2, levels + 2, dtype=r.dtype, device=r.device) ** alpha  # (k + 1) ** alpha
    num, den = w @ a, w @ (a != 0).to(r.dtype)
    if base_group:
        a0 = _normalize(s, ginv, kg, norm=norm, eps=eps, value_dtype=vd, zero_at_mean=True)
        num, den = a0 + num, (a0 != 0).to(r.dtype) + den  # weight (0 + 1) ** alpha = 1
    return (num / (den + eps)).to(reward.dtype)


def _graph_distances(u: torch.Tensor, v: torch.Tensor, m: int, sinks: torch.Tensor) -> torch.Tensor:
    """Hop distance [M] of every node to a sink over the edges ``u -> v`` [E]; -1 where none is reachable.

    A BFS from the sinks over the reversed edges, one level per iteration, every group at once (their
    nodes are disjoint): the tails of the edges into the last level that have no distance yet get the
    next one; edges whose tail is settled are dropped. At most the longest shortest path of iterations.
    """
    dist = torch.full((m,), -1, dtype=torch.long, device=u.device)
    dist[sinks] = 0
    d = 0
    while u.numel():
        tails = u[dist.index_select(0, v) == d]
        if tails.numel() == 0:
            break
        d += 1
        dist[tails] = d
        keep = dist.index_select(0, u) < 0
        u, v = u[keep], v[keep]
    return dist


def graphgpo_advantage(
    reward: torch.Tensor,
    group_id: torch.Tensor,
    traj_id: torch.Tensor,
    step: torch.Tensor,
    anchor: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    next_anchor: torch.Tensor | None = None,
    node: tuple[torch.Tensor, torch.Tensor] | None = None,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    episode_weight: float = 1.0,
    normalize_distance: bool = False,
    invalid_penalty: float = 0.1,
    norm: Norm = "mean_std",
    eps: float = 1e-6,
    score_penalty: torch.Tensor | None = None,
) -> torch.Tensor:
    """GraphGPO: ``A = w_E * A_E + w_S * A_S`` with the step return read off a state graph per group.

    - the graph of a group has one edge ``anchor -> next state`` per row (all trajectories, failed
      ones too); the next state of a row is ``next_anchor`` (given) or else the next row's anchor
      in the trajectory; the last row of a **won** trajectory (episode reward > 0) goes to the
      group's success sink; the last row of another trajectory without ``next_anchor`` goes to a
      dead end of its own (no out-edge);
    - ``d(x)``: hop distance to the sink (BFS); unreachable: ``dmax + 1`` (``dmax`` the group's largest
      finite distance; no success in the group: every state 1);
    - ``R_t = 10 * gamma ** d(next)`` (``normalize_distance``: ``10 * gamma ** (d(next) - d(anchor) + 1)``),
      minus ``c * (1 - valid_t)``;
    - ``A_S = norm(R_t, rows of the same (group_id, anchor))`` (singleton: 0), ``A_E`` as :func:`grpo_advantage`.

    Args: ``reward`` [N] float, ``group_id`` / ``traj_id`` / ``step`` / ``anchor`` [N] int64, ``valid``
    [N] bool, ``next_anchor`` [N] int64 (optional). ``node`` (optional): the graph's node ids
    ``(of the anchor, of the next state)`` [N] int64 when they differ from the anchors (similarity
    clusters, :func:`graph_state_ids`); the step groups stay the exact ``anchor`` s. ``score_penalty``
    enters ``A_E`` only. Returns [N] in ``reward``'s dtype.
    """
    _check_norm(norm)
    r, valid, s, ginv, kg, tinv, kt = _scores_and_groups(reward, group_id, traj_id, valid, invalid_penalty,
                                                         score_penalty)
    n = r.numel()
    step = _check_ids("step", step, n)
    anchor = _check_ids("anchor", anchor, n)
    next_anchor = None if next_anchor is None else _check_ids("next_anchor", next_anchor, n)
    if n == 0:
        return reward.reshape(-1).clone()
    vd = reward.dtype
    pos, t_max = _positions(tinv, kt, step)
    last = pos == (torch.bincount(tinv, minlength=kt) - 1).index_select(0, tinv)
    won = (torch.zeros(kt, dtype=r.dtype, device=r.device).scatter_add_(0, tinv, r) > 0).index_select(0, tinv)
    src, dst = (anchor, next_anchor) if node is None else (_check_ids("node", node[0], n),
                                                           _check_ids("node", node[1], n))
    # graph nodes: the (group, state) pairs of the rows' own states (`u`, 0..kp-1), then a success sink
    # per group (kp + g), then a dead end per group (kp + kg + g: a next state that is no row's state in
    # the group has no out-edge, so all of a group's such states are at the same distance)
    values, sinv = torch.unique(src, return_inverse=True)
    ks = values.numel()
    lo = torch.full((ks,), kg, dtype=torch.long, device=r.device).scatter_reduce_(0, sinv, ginv, "amin")
    one_group = bool((lo == torch.full_like(lo, -1).scatter_reduce_(0, sinv, ginv, "amax")).all())
    if one_group:  # every state lives in one group: the state is the node
        u, kp = sinv, ks
    else:
        pairs, u = torch.unique(ginv * ks + sinv, return_inverse=True)
        kp = pairs.numel()
    # the next row of the trajectory (a last row: itself)
    following = _traj_matrix(torch.arange(n, device=r.device), tinv, kt, pos, t_max).index_select(
        0, tinv * t_max + torch.where(last, pos, pos + 1))
    sink = last & won
    v = torch.where(sink, kp + ginv, u.index_select(0, following))
    if dst is None:  # the next row's state; a failed trajectory's last row: a dead end
        v = torch.where(last & ~won, kp + kg + ginv, v)
    else:  # the recorded next state: the next row's node when it is the next row's state, else looked up
        look = (~sink & (last | (dst != src.index_select(0, following)))).nonzero().squeeze(1)
        q, g = dst.index_select(0, look), ginv.index_select(0, look)
        j = torch.searchsorted(values, q).clamp_max(ks - 1)
        found = values.index_select(0, j) == q
        if one_group:
            found &= lo.index_select(0, j) == g
        else:  # the node of the (group, state) pair
            key = g * ks + j
            j = torch.searchsorted(pairs, key).clamp_max(kp - 1)
            found &= pairs.index_select(0, j) == key
        v[look] = torch.where(found, j, kp + kg + g)
    node_group = torch.cat([torch.zeros(kp, dtype=torch.long, device=r.device).scatter_(0, u, ginv),
                            torch.arange(kg, device=r.device).repeat(2)])
    dist = _graph_distances(u, v, kp + 2 * kg, kp + torch.arange(kg, device=r.device))
    # a node that cannot reach the sink: dmax + 1, dmax the group's largest finite distance (0: no success)
    far = torch.zeros(kg, dtype=torch.long, device=r.device).scatter_reduce_(0, node_group, dist, "amax") + 1
    dist = torch.where(dist >= 0, dist, far.index_select(0, node_group)).to(r.dtype)
    gamma_t = torch.as_tensor(gamma, dtype=r.dtype, device=r.device)
    if normalize_distance:
        step_return = 10.0 * gamma_t ** (dist.index_select(0, v) - dist.index_select(0, u) + 1)
    else:
        step_return = (10.0 * gamma_t ** dist).index_select(0, v)
    penalty = invalid_penalty * (~valid).to(r.dtype)
    # step groups: exact (group, anchor) pairs, as GiGPO (the graph's own ids when its states are the anchors)
    ainv, ka = (u, kp) if node is None else _pair_ids(ginv, kg, anchor)
    a_step = _normalize(step_return - penalty, ainv, ka, norm=norm, eps=eps, singleton_zero=True, value_dtype=vd,
                        mag=step_return + penalty)
    a_episode = _normalize(s, ginv, kg, norm=norm, eps=eps, value_dtype=vd)
    return (episode_weight * a_episode + step_weight * a_step).to(reward.dtype)


def rloo_advantage(
    reward: torch.Tensor,
    group_id: torch.Tensor,
    traj_id: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    invalid_penalty: float = 0.1,
    score_penalty: torch.Tensor | None = None,
) -> torch.Tensor:
    """RLOO: ``A = (S_row - mean_group) * n / (n - 1)`` with ``n`` the rows of the group.

    A group of one row keeps its raw score (mean 0, no rescaling); an all-equal group gives 0.
    Shapes as :func:`grpo_advantage`; returns [N] in ``reward``'s dtype.
    """
    r, _, s, ginv, kg, _, _ = _scores_and_groups(reward, group_id, traj_id, valid, invalid_penalty, score_penalty)
    if r.numel() == 0:
        return reward.reshape(-1).clone()
    centred = _normalize(s, ginv, kg, norm="mean", eps=0.0, value_dtype=reward.dtype)
    n = torch.bincount(ginv, minlength=kg).to(s.dtype)[ginv]
    scale = torch.where(n > 1, n / (n - 1).clamp_min(1), 1.0)
    return (centred * scale).to(reward.dtype)


def _weighted_whiten(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean_w) / sqrt(var_w + eps)`` with weights ``w`` [N] (token counts): the reference's
    ``masked_whiten`` over the tokens of rows whose tokens all hold ``x``. Unbiased over the total
    weight (Bessel on the token count); all-equal values (of positive weight) give exactly 0."""
    total = w.sum()
    if float(total) <= 1:
        return torch.zeros_like(x)
    mean = (w * x).sum() / total
    live = w > 0
    lo, hi = x[live].min(), x[live].max()
    ulp = 4 * torch.finfo(torch.float32).eps
    if float(hi - lo) <= ulp * float(torch.maximum(hi.abs(), lo.abs())):
        return torch.zeros_like(x)
    dev = x - mean
    var = (w * dev * dev).sum() / (total - 1)
    return dev / torch.sqrt(var + eps)


def reinforce_pp_baseline_advantage(
    reward: torch.Tensor,
    group_id: torch.Tensor,
    traj_id: torch.Tensor,
    valid: torch.Tensor | None = None,
    num_tokens: torch.Tensor | None = None,
    *,
    invalid_penalty: float = 0.1,
    eps: float = 1e-8,
    score_penalty: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++-baseline: ``S_row - mean_group`` (over rows), then whitened over the batch's **tokens**.

    The reference broadcasts the centred score over the row's response tokens and whitens over
    all the masked tokens of the batch: ``(x - mean) * rsqrt(var + eps)``, mean and unbiased
    variance over tokens. As every token of a row holds the same value, that is a whitening of
    the rows weighted by ``num_tokens`` [N] (the row's response length); the result is still one
    value per row. ``num_tokens=None`` weighs every row 1 (a whitening over rows).
    All-equal values give exactly 0. Shapes as :func:`grpo_advantage`; returns [N].
    """
    r, _, s, ginv, kg, _, _ = _scores_and_groups(reward, group_id, traj_id, valid, invalid_penalty, score_penalty)
    if r.numel() == 0:
        return reward.reshape(-1).clone()
    centred = _normalize(s, ginv, kg, norm="mean", eps=0.0, value_dtype=reward.dtype)
    w = torch.ones_like(centred) if num_tokens is None else _as_1d("num_tokens", num_tokens, r.numel()).to(s.dtype)
    if bool((w < 0).any()):
        raise ValueError("`num_tokens` must be >= 0.")
    return _weighted_whiten(centred, w, eps).to(reward.dtype)




def grpo_passk_advantage(
    reward: torch.Tensor,
    group_id: torch.Tensor,
    traj_id: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    invalid_penalty: float = 0.1,
    norm: Norm = "mean_std",
    eps: float = 1e-6,
    score_penalty: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO pass@k: only the best row of each group gets an advantage, ``(S_max - S_2nd) / (std + eps)``.

    Over the rows of a group (the reference walks rows, not trajectories): ``S_max`` and
    ``S_2nd`` are its two largest scores, ``std`` the unbiased std of all its scores (``norm="mean"``:
    no division). The first row holding ``S_max`` gets the advantage, every other row 0; a tie at
    the top gives 0 everywhere. A group of one row gets 0 (the reference raises). Returns [N].
    """
    _check_norm(norm)
    r, _, s, ginv, kg, _, _ = _scores_and_groups(reward, group_id, traj_id, valid, invalid_penalty, score_penalty)
    n = r.numel()
    if n == 0:
        return reward.reshape(-1).clone()
    neg_inf = torch.full((kg,), -torch.inf, dtype=s.dtype, device=s.device)
    gmax = neg_inf.clone().scatter_reduce_(0, ginv, s, "amax")
    is_max = s == gmax.index_select(0, ginv)
    idx = torch.arange(n, device=s.device)
    first = torch.full((kg,), n, dtype=torch.long, device=s.device).scatter_reduce_(
        0, ginv, torch.where(is_max, idx, n), "amin")
    best = first.index_select(0, ginv) == idx  # the first row with the group's max score
    second = neg_inf.clone().scatter_reduce_(0, ginv, torch.where(best, -torch.inf, s), "amax")
    count = torch.bincount(ginv, minlength=kg)
    gap = torch.where(count > 1, gmax - second, 0.0)
    if norm == "mean_std":
        mean = torch.zeros(kg, dtype=s.dtype, device=s.device).scatter_add_(0, ginv, s) / count.clamp_min(1)
        dev = s - mean.index_select(0, ginv)
        var = torch.zeros(kg, dtype=s.dtype, device=s.device).scatter_add_(0, ginv, dev * dev)
        std = (var / (count - 1).clamp_min(1)).sqrt()
        gap = gap / (std + eps)
    return torch.where(best, gap.index_select(0, ginv), 0.0).to(reward.dtype)


def remax_advantage(
    reward: torch.Tensor,
    traj_id: torch.Tensor,
    baseline: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    invalid_penalty: float = 0.1,
    score_penalty: torch.Tensor | None = None,
) -> torch.Tensor:
    """ReMax: ``A = S_row - b_row``, ``b_row`` [N] the episode reward of a greedy rollout from the
    row's initial state (the same for every row of a group). Returns [N]."""
    reward = _check_reward(reward)
    n = reward.shape[0]
    traj_id = _check_ids("traj_id", traj_id, n)
    valid = _check_valid(valid, n, reward.device)
    baseline = _as_1d("baseline", baseline, n)
    r = reward.to(_acc_dtype(reward))
    if n == 0:
        return reward.clone()
    tinv, kt = _dense_ids(traj_id)
    s = _episode_scores(r, tinv, kt, valid, invalid_penalty, score_penalty)
    return (s - baseline.to(s.dtype)).to(reward.dtype)


# --------------------------------------------------------------------------- similarity anchors
def similarity_anchor_ids(
    texts: list[str],
    group_id: torch.Tensor | list[int],
    *,
    threshold: float = 0.9,
) -> torch.Tensor:
    """Clusters anchor texts for GiGPO's similarity variant; returns int64 cluster ids [N].

    Inside each group, rows are walked in their order in ``texts``; a row joins the first cluster
    (in creation order) whose first member ``rep`` satisfies
    ``difflib.SequenceMatcher(None, text, rep).ratio() >= threshold``, else it starts a new
    cluster. This is the reference algorithm (same argument order); it is sped up only by exact
    shortcuts: identical texts match at once, and the cheap upper bounds ``real_quick_ratio`` /
    ``quick_ratio`` reject a cluster before the full ratio is computed. The ids are unique across
    groups, so they can be passed as ``anchor`` to :func:`gigpo_advantage`. A ``None`` text (a state
    whose text is unknown) gets a cluster of its own and is never a representative.
    """
    if not isinstance(texts, (list, tuple)) or not all(t is None or isinstance(t, str) for t in texts):
        raise TypeError("`texts` must be a list of str.")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"`threshold` must be in (0, 1], got {threshold}.")
    gids = group_id.reshape(-1).tolist() if isinstance(group_id, torch.Tensor) else list(group_id)
    if len(gids) != len(texts):
        raise ValueError(f"`group_id` has {len(gids)} entries but `texts` has {len(texts)}.")
    clusters: dict[int, list[tuple[str, int]]] = {}
    exact: dict[tuple[int, str], int] = {}
    out = []
    next_id = 0
    for text, gid in zip(texts, gids):
        if text is None:
            out.append(next_id)
            next_id += 1
            continue
        hit = exact.get((gid, text))
        if hit is None:
            for rep, cid in clusters.get(gid, ()):
                sm = SequenceMatcher(None, text, rep)
                if sm.real_quick_ratio() >= threshold and sm.quick_ratio() >= threshold and sm.ratio() >= threshold:
                    hit = cid
                    break
            if hit is None:
                hit = next_id
                next_id += 1
                clusters.setdefault(gid, []).append((text, hit))
            exact[(gid, text)] = hit
        out.append(hit)
    return torch.tensor(out, dtype=torch.int64)


def graph_state_ids(
    texts: list[str],
    group_id: torch.Tensor,
    traj_id: torch.Tensor,
    step: torch.Tensor,
    anchor: torch.Tensor,
    reward: torch.Tensor,
    next_anchor: torch.Tensor | None = None,
    next_texts: list[str | None] | None = None,
    *,
    threshold: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GraphGPO's similarity canonicaliser: graph node ids ``(of the anchor, of the next state)`` [N] int64.

    ``texts`` [N] are the anchor texts. The next state of a row is the next row of its trajectory;
    the last row's is ``"success"`` if the trajectory won (episode ``reward`` > 0), else the state
    ``next_anchor`` names; its text is ``next_texts`` [N] (the text of each row's next state) when
    given, else that of a row of the group with that anchor; unknown (no such row, or no
    ``next_anchor``): a node of its own. The states of each group are clustered as
    :func:`similarity_anchor_ids` does (greedy, first representative with
    ``SequenceMatcher.ratio() >= threshold``), visiting them in the reference's order: trajectory by
    trajectory (``traj_id``), step by step, the row's anchor then its next state. Pass the result as
    ``node`` to :func:`graphgpo_advantage` (which still sends a won trajectory's last row to the sink).
    """
    reward = _check_reward(reward)
    n = reward.shape[0]
    if len(texts) != n:
        raise ValueError(f"`texts` has {len(texts)} entries, expected {n} (the number of rows of `reward`).")
    group_id = _check_ids("group_id", group_id, n)
    traj_id = _check_ids("traj_id", traj_id, n)
    step = _check_ids("step", step, n)
    anchor = _check_ids("anchor", anchor, n)
    next_anchor = None if next_anchor is None else _check_ids("next_anchor", next_anchor, n)
    order = torch.argsort(step, stable=True)
    order = order[torch.argsort(traj_id[order], stable=True)].tolist()
    gids, tids, anchors = group_id.tolist(), traj_id.tolist(), anchor.tolist()
    episode: dict[int, float] = {}
    for tr, r in zip(tids, reward.tolist()):
        episode[tr] = episode.get(tr, 0.0) + r
    text_of = {(g, a): t for g, a, t in zip(gids, anchors, texts)}
    nexts = next_anchor.tolist() if next_anchor is not None else None
    seq, seq_groups = [], []
    for j, i in enumerate(order):
        follow = order[j + 1] if j + 1 < n and tids[order[j + 1]] == tids[i] else None
        if follow is not None:
            nxt = texts[follow]
        elif episode[tids[i]] > 0:
            nxt = "success"
        else:
            nxt = next_texts[i] if next_texts is not None else (
                None if nexts is None else text_of.get((gids[i], nexts[i])))
        seq += [texts[i], nxt]
        seq_groups += [gids[i], gids[i]]
    ids = similarity_anchor_ids(seq, seq_groups, threshold=threshold)
    out = torch.empty(2 * n, dtype=torch.int64)
    pos = torch.tensor(order, dtype=torch.int64)
    out[pos] = ids[0::2]
    out[n + pos] = ids[1::2]
    return out[:n].to(group_id.device), out[n:].to(group_id.device)

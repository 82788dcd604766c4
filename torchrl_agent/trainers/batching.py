"""Rows into batches: the rows a loss may use (faulted episodes left out), token-budget
micro-batches, ragged-to-padded tensors, row lengths.

A *row* is one env step: ragged ``("tokens", "prompt")`` and ``("tokens", "response")``. A
mini-batch (one optimizer step) runs as micro-batches of at most ``algorithm.micro_batch_tokens``
padded tokens (rows x longest prompt + response), whose weighted losses accumulate exactly the
mini-batch's gradient.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from torchrl_agent.trainers.distributed import accumulation_weights, loss_units

__all__ = ["drop_faulted", "fit_width", "micro_batches", "minibatch_advantage", "pad_ragged", "response_mask", "row_lengths",
           "token_budget_batches"]


def drop_faulted(rows: TensorDictBase) -> tuple[TensorDictBase | None, dict[str, int]]:
    """Leaves the episodes cut short by a fault (``worker_fault`` / ``env_fault``) out of the
    advantage groups and the loss: their rows are removed, a group that lost episodes is normalised
    over the rest, or dropped when fewer than 2 remain. Returns the rows (``None`` when none are
    left) and the counts ``env_faults``, ``fault_rows_dropped`` and ``fault_groups_dropped``."""
    traj, group = rows["traj_id"].reshape(-1), rows["group_id"].reshape(-1)
    fault = torch.zeros_like(traj, dtype=torch.bool)
    for key in ("worker_fault", "env_fault"):
        if key in rows.keys():
            fault |= rows[key].reshape(-1).bool()
    bad_traj = traj[fault].unique()
    keep = ~torch.isin(traj, bad_traj)
    pairs = torch.unique(torch.stack([group[keep], traj[keep]]), dim=1)
    groups, members = pairs[0].unique(return_counts=True)
    hurt = group[~keep].unique()  # groups that lost episodes; how many each has left (0: all faulted)
    left = torch.stack([members[groups == g].sum() for g in hurt]) if hurt.numel() else hurt
    dropped_groups = hurt[left < 2]
    keep &= ~torch.isin(group, dropped_groups)
    counts = {"env_faults": int(bad_traj.numel()), "fault_rows_dropped": int((~keep).sum()),
              "fault_groups_dropped": int(dropped_groups.numel())}
    if not keep.any():
        return None, counts
    return (rows if bool(keep.all()) else rows[keep.nonzero().reshape(-1)]), counts


def token_budget_batches(indices: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Splits ``indices`` into micro-batches whose padded size (rows x longest ``lengths[i]``) is at
    most ``budget`` tokens; a row longer than the budget goes alone. Longest rows first, so that rows
    of similar length share a micro-batch (less padding)."""
    batches: list[list[int]] = []
    for i in sorted(indices, key=lambda i: -lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def row_lengths(rows: TensorDictBase) -> tuple[list[int], list[int]]:
    """Per-row prompt + response token counts and response token counts."""
    responses = [len(r) for r in rows.get(("tokens", "response"), as_list=True)]
    prompts = [len(p) for p in rows.get(("tokens", "prompt"), as_list=True)]
    return [p + r for p, r in zip(prompts, responses)], responses


def micro_batches(rows: TensorDictBase, idx: list[int], active: bool = True, *, budget: int,
                  aggregation: str) -> list[tuple[list[int], float, bool]]:
    """This rank's rows ``idx`` of a mini-batch as ``(rows, loss weight, active)`` micro-batches of
    at most ``budget`` padded tokens (:func:`token_budget_batches`). The weights make the sum of
    the micro-batches' weighted losses the whole mini-batch's loss, so accumulating their gradients
    gives the mini-batch's gradient (:func:`~torchrl_agent.trainers.distributed.accumulation_weights`,
    exact over FSDP2 ranks). Every rank gets the same number of micro-batches: an ``active=False``
    one (weight 0, to run with a zero mask) fills in where a rank has fewer."""
    lengths, responses = row_lengths(rows)
    batches = token_budget_batches(idx, lengths, budget) if active else []
    weights, count = accumulation_weights([loss_units([responses[i] for i in b], aggregation) for b in batches])
    return [(b, w, True) for b, w in zip(batches, weights)] + [(idx[:1], 0.0, False)] * (count - len(batches))


def pad_ragged(values: list[torch.Tensor], width: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[len(values), width]`` float32, row ``i`` holding ``values[i]`` left-aligned, zeros after.

    On ``device``, by default the first value's (the CPU when ``values`` is empty)."""
    if device is None:
        device = values[0].device if values else None
    out = torch.zeros(len(values), width, device=device)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out


def fit_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` ``[n, W]`` cut or zero-padded to ``[n, width]``."""
    if x.shape[-1] >= width:
        return x[:, :width]
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def response_mask(rows: TensorDictBase, width: int | None = None) -> torch.Tensor:
    """``[N, T]`` bool, True on each row's response tokens, left-aligned: ``response_tokens`` [N, 1] long
    (the collector's), else the lengths of the rows' ``("tokens", "response")`` (rows built by hand)."""
    if "response_tokens" in rows.keys():
        lengths = rows["response_tokens"].reshape(-1).long()
    else:
        lengths = torch.tensor(row_lengths(rows)[1], dtype=torch.long)
    width = width or max(1, int(lengths.max()) if lengths.numel() else 1)
    return torch.arange(width)[None, :] < lengths[:, None]


def minibatch_advantage(advantage: torch.Tensor, idx, width: int) -> torch.Tensor:
    """The advantages of rows ``idx``: ``[n]`` for per-row ``[N, 1]`` advantages, ``[n, width]``
    (cut or zero-padded) for per-token ``[N, T]`` ones."""
    adv = advantage[idx].float()
    if adv.ndim == 1 or adv.shape[-1] == 1:
        return adv.reshape(-1)
    return fit_width(adv, width)

"""Input normalisation of the objectives, in one place: the layouts of TorchRL's LLM data.

TorchRL's LLM wrappers and collectors store per-token entries (``("log_probs", "full")``,
``("log_probs", "response")``, ...) as **ragged** lazy stacks (one tensor of its own length per
row) and scalars per step with trailing singleton dims (``("next", "reward")`` ``[B, 1, 1]``).
The objectives compute on dense rows: ``[N]`` per row, ``[N, T]`` per token (right-padded).

- :func:`get_tokens`: a per-token entry as a right-padded ``[N, T]`` tensor (tensordict's
  ``get(key, as_padded_tensor=True, padding_side="right")``) and the row lengths when ragged;
- :func:`length_mask`: the ``[N, T]`` bool mask of those lengths;
- :func:`as_rows`: a per-row entry ``[N]``, ``[N, 1]`` or ``[N, 1, 1]`` (any trailing singleton
  dims) as ``[N, 1]``; per-token ``[N, T]`` / ``[N, T, 1]`` as ``[N, T]``;
- :func:`broadcast_advantage`: an advantage of any of those shapes broadcast to ``[N, T]``.
"""

from __future__ import annotations

import torch
from tensordict import NestedKey, TensorDictBase

__all__ = ["as_rows", "broadcast_advantage", "get_tokens", "length_mask"]


def get_tokens(td: TensorDictBase, key: NestedKey, padding_value: float | bool = 0) -> tuple[
        torch.Tensor | None, torch.Tensor | None]:
    """Reads the per-token entry ``key`` of ``td`` (batch ``[N]``).

    Returns ``(value, lengths)``: ``value`` is ``[N, T]`` (a dense entry as stored, a trailing
    singleton dim dropped; a ragged one right-padded with ``padding_value`` to its longest row)
    and ``lengths`` ``[N]`` int64 is the row lengths of a ragged entry, ``None`` for a dense one.
    ``(None, None)`` when the key is missing.
    """
    try:
        value = td.get(key, None)
    except RuntimeError:  # ragged lazy stack: rows of different lengths cannot be stacked
        rows = td.get(key, as_list=True)
        lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long)
        value = td.get(key, as_padded_tensor=True, padding_side="right", padding_value=padding_value)
        if value.ndim == 3 and value.shape[-1] == 1:
            value = value.squeeze(-1)
        return value, lengths.to(value.device)
    if value is not None and value.ndim == 3 and value.shape[-1] == 1:
        value = value.squeeze(-1)
    return value, None


def length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[N, width]`` bool, True on the first ``lengths[i]`` tokens of row ``i``."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


def as_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """Flattens the leading dims of ``x`` to the ``n`` rows and drops trailing singleton dims:
    ``[N]``, ``[N, 1]``, ``[B, 1, 1]`` (``B * ... = N``) -> ``[N, 1]``; ``[N, T]``, ``[N, T, 1]``
    -> ``[N, T]``. Non-tensors (strings) are returned unchanged."""
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        return x
    if n == 0 or x.numel() % n:
        return x  # a wrong row count: left for the caller's shape check to name
    return x.reshape(n, -1)


def broadcast_advantage(adv: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """An advantage ``[N]``, ``[N, 1]``, ``[N, 1, 1]`` (per row) or ``[N, T]``, ``[N, T, 1]``
    (per token) as ``[N, T]`` = ``shape``."""
    n, t = shape
    if adv.ndim >= 1 and adv.shape[0] == n:
        if adv.numel() == n:
            return adv.reshape(n, 1).expand(shape)
        if adv.numel() == n * t and all(d == 1 for d in adv.shape[2:]):
            return adv.reshape(shape)
    raise ValueError(f"`advantage` must have shape [N], [N, 1], [N, 1, 1] or {tuple(shape)}, "
                     f"got {tuple(adv.shape)}.")

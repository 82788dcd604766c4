"""PPO for LLM rows: per-token GAE inside each row's response, clipped policy + clipped value loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import NestedKey, TensorDictBase
from tensordict.nn import TensorDictModuleBase

from torchrl_agent.objectives.clip_loss import Aggregation, ClipPolicyLoss, aggregate

__all__ = ["token_gae", "masked_whiten", "PPOLoss"]


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the masked entries of ``x`` (unbiased std).

    All-equal masked values give exactly 0; masked-out entries are returned as 0.
    """
    mask = mask.bool()
    n = mask.sum()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    vals = torch.where(mask, x, zero)
    if n == 0:
        return vals
    mean = vals.sum() / n
    dev = torch.where(mask, x - mean, zero)
    lo, hi = torch.where(mask, x, torch.inf).min(), torch.where(mask, x, -torch.inf).max()
    if n == 1 or lo == hi:
        return torch.where(mask & (lo != hi), dev, zero)
    std = ((dev * dev).sum() / (n - 1)).sqrt()
    return dev / (std + eps)


def token_gae(
    values: torch.Tensor,
    mask: torch.Tensor,
    scores: torch.Tensor,
    *,
    gamma: float = 1.0,
    lmbda: float = 1.0,
    whiten: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token GAE inside each row's response (the reference PPO for LLM agents).

    The reward is the row's score at its **last** response token and 0 elsewhere; the value after
    the last token is 0. With ``delta_t = r_t + gamma * V_{t+1} - V_t``::

        A_t = sum_{k >= t} (gamma * lmbda)**(k - t) * delta_k,   returns_t = A_t + V_t

    (for ``gamma = lmbda = 1``: ``A_t = score - V_t``). Advantages are then whitened over all the
    masked tokens of the batch (``whiten=True``); returns are computed before whitening.

    Args:
        values (Tensor): [N, T] value estimates at collection time (detached).
        mask (Tensor): [N, T] bool, True on response tokens (need not be contiguous).
        scores (Tensor): [N] or [N, 1] the row's score.

    Returns:
        ``(advantages, returns)``, both [N, T] float, 0 on masked-out tokens.
    """
    if values.ndim != 2 or mask.shape != values.shape:
        raise ValueError(f"`values` and `mask` must both be [N, T], got {tuple(values.shape)} and {tuple(mask.shape)}.")
    if scores.ndim == 2 and scores.shape[-1] == 1:
        scores = scores.squeeze(-1)
    if scores.shape != values.shape[:1]:
        raise ValueError(f"`scores` must have shape [N] or [N, 1] with N={values.shape[0]}, got {tuple(scores.shape)}.")
    values = values.detach()
    mask = mask.bool()
    n, t = mask.shape
    dtype = values.dtype
    zero = torch.zeros((), dtype=dtype, device=values.device)
    # compact the response tokens of each row to the left: position = rank among masked tokens
    pos = torch.cumsum(mask.long(), -1) - 1
    length = mask.sum(-1)
    rows, cols = mask.nonzero(as_tuple=True)
    v = torch.zeros(n, t, dtype=dtype, device=values.device)
    v[rows, pos[rows, cols]] = values[rows, cols]
    # reward: the score at the last token of each row
    r = torch.zeros(n, t, dtype=dtype, device=values.device)
    has = length > 0
    r[has.nonzero(as_tuple=True)[0], (length[has] - 1)] = scores[has].to(dtype)
    v_next = torch.cat([v[:, 1:], torch.zeros(n, 1, dtype=dtype, device=values.device)], -1)
    compact_mask = torch.arange(t, device=values.device)[None, :] < length[:, None]
    v_next = torch.where(torch.arange(t, device=values.device)[None, :] + 1 < length[:, None], v_next, zero)
    delta = torch.where(compact_mask, r + gamma * v_next - v, zero)
    # reverse discounted cumsum as a product with G[k, j] = (gamma * lmbda)**(k - j), k >= j
    idx = torch.arange(t, device=values.device)
    lag = idx[:, None] - idx[None, :]
    g = torch.where(lag >= 0, torch.as_tensor(gamma * lmbda, dtype=dtype, device=values.device) ** lag.clamp_min(0), zero)
    adv_c = delta @ g
    ret_c = adv_c + v
    advantages = torch.zeros_like(values)
    returns = torch.zeros_like(values)
    advantages[rows, cols] = adv_c[rows, pos[rows, cols]]
    returns[rows, cols] = ret_c[rows, pos[rows, cols]]
    if whiten:
        advantages = masked_whiten(advantages, mask, eps)
    return advantages, returns


class PPOLoss(ClipPolicyLoss):
    """PPO for LLM rows: :class:`ClipPolicyLoss` on per-token GAE advantages + clipped value loss.

    Call :meth:`compute_advantage` once on the whole collected batch (it writes ``advantage`` and
    ``value_target`` [N, T], whitening over the batch); then call the loss on mini-batches. If
    ``value_target`` is missing when the loss is called, :meth:`compute_advantage` is run on the
    given batch first.

    Extra keys (besides :class:`ClipPolicyLoss`'s, ``advantage`` here being [N, T]):

    - ``state_value`` [N, T]: current value-head output (carries grad);
    - ``old_state_value`` [N, T]: value-head output at collection time;
    - ``score`` [N] or [N, 1]: the row's score (e.g. :func:`~.functional.episode_scores`);
    - ``value_target`` [N, T]: GAE returns (written by :meth:`compute_advantage`).

    Value loss (``vclip = clamp(V, V_old - value_clip, V_old + value_clip)``)::

        loss_critic = critic_coef * 0.5 * agg(max((V - R)**2, (vclip - R)**2))

    Keyword Args:
        value_clip (float | None): defaults to 0.5; ``None`` disables value clipping.
        critic_coef (float): defaults to 1.0.
        gamma, lmbda (float): GAE parameters, both default to 1.0.
        Other keyword arguments go to :class:`ClipPolicyLoss` (KL defaults to 0 here, the
        reference PPO uses no KL term).
    """

    @dataclass
    class _AcceptedKeys(ClipPolicyLoss._AcceptedKeys):
        """Configurable tensordict keys, see the class docstring."""

        state_value: NestedKey = "state_value"
        old_state_value: NestedKey = "old_state_value"
        score: NestedKey = "score"
        value_target: NestedKey = "value_target"

    default_keys = _AcceptedKeys

    def __init__(
        self,
        actor_network: TensorDictModuleBase | None = None,
        *,
        value_clip: float | None = 0.5,
        critic_coef: float = 1.0,
        gamma: float = 1.0,
        lmbda: float = 1.0,
        aggregation: Aggregation = "token-mean",
        kl_coef: float = 0.0,
        **kwargs,
    ) -> None:
        super().__init__(actor_network, aggregation=aggregation, kl_coef=kl_coef, **kwargs)
        if value_clip is not None and value_clip <= 0:
            raise ValueError(f"`value_clip` must be > 0 (or None), got {value_clip}.")
        self.value_clip = value_clip
        self.critic_coef = float(critic_coef)
        self.gamma, self.lmbda = float(gamma), float(lmbda)

    def compute_advantage(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Writes per-token ``advantage`` and ``value_target`` [N, T] (GAE, whitened) in place."""
        mask = self._get(tensordict, "mask").bool()
        old_v = self._check_tokens("old_state_value", self._get(tensordict, "old_state_value"), mask.shape)
        adv, ret = token_gae(old_v, mask, self._get(tensordict, "score"), gamma=self.gamma, lmbda=self.lmbda)
        tensordict.set(self.tensor_keys.advantage, adv)
        tensordict.set(self.tensor_keys.value_target, ret)
        return tensordict

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Policy terms (see :class:`ClipPolicyLoss`) plus ``loss_critic`` and ``value_clip_fraction``."""
        if tensordict.get(self.tensor_keys.value_target, None) is None:
            tensordict = self.compute_advantage(tensordict.copy())
        out = super().forward(tensordict)
        mask = self._get(tensordict, "mask").bool()
        value = self._check_tokens("state_value", self._get(tensordict, "state_value"), mask.shape)
        old_value = self._check_tokens("old_state_value", self._get(tensordict, "old_state_value"), mask.shape)
        target = self._check_tokens("value_target", self._get(tensordict, "value_target"), mask.shape).detach()
        loss_v = (value - target) ** 2
        if self.value_clip is not None:
            old_value = old_value.detach()
            v_clipped = old_value + (value - old_value).clamp(-self.value_clip, self.value_clip)
            loss_v_clipped = (v_clipped - target) ** 2
            with torch.no_grad():
                frac = ((loss_v_clipped > loss_v) & mask).sum() / mask.sum().clamp_min(1)
            loss_v = torch.maximum(loss_v, loss_v_clipped)
            out.set("value_clip_fraction", frac.to(value.dtype))
        out.set("loss_critic", self.critic_coef * 0.5 * aggregate(loss_v, mask, self.aggregation))
        return out


"""PPO for LLM rows: per-token GAE inside each row's response, clipped policy + clipped value loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import NestedKey, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.objectives.value.functional import td0_advantage_estimate, vec_generalized_advantage_estimate

from torchrl_agent.objectives.clip_loss import Aggregation, ClipPolicyLoss, aggregate

__all__ = ["token_gae", "token_reinforce_pp", "masked_whiten", "clipped_value_loss", "PPOLoss"]


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) * rsqrt(var + eps)`` over the masked entries of ``x`` (unbiased variance), the
    reference's ``masked_whiten``.

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
    var = (dev * dev).sum() / (n - 1)
    return dev * torch.rsqrt(var + eps)


def _compact(x: torch.Tensor, mask: torch.Tensor):
    """Moves each row's masked entries to the left; returns (compacted [N, T], lengths [N], scatter-back fn)."""
    n, t = mask.shape
    pos = torch.cumsum(mask.long(), -1) - 1
    rows, cols = mask.nonzero(as_tuple=True)
    out = torch.zeros(n, t, dtype=x.dtype, device=x.device)
    out[rows, pos[rows, cols]] = x[rows, cols]

    def back(c: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(n, t, dtype=c.dtype, device=c.device)
        full[rows, cols] = c[rows, pos[rows, cols]]
        return full

    return out, mask.sum(-1), back


def _discount_matrix(t: int, factor: float, dtype, device) -> torch.Tensor:
    """``G[k, j] = factor**(k - j)`` for ``k >= j`` else 0 (reverse discounted cumsum as ``x @ G``)."""
    idx = torch.arange(t, device=device)
    lag = idx[:, None] - idx[None, :]
    return torch.where(lag >= 0, torch.as_tensor(factor, dtype=dtype, device=device) ** lag.clamp_min(0),
                       torch.zeros((), dtype=dtype, device=device))


def _token_rewards(mask, scores, token_rewards, dtype):
    """Compacted per-token rewards: ``token_rewards`` (optional, e.g. ``-beta * kl_t``) plus the
    row's score at its last response token."""
    if scores.ndim == 2 and scores.shape[-1] == 1:
        scores = scores.squeeze(-1)
    if scores.shape != mask.shape[:1]:
        raise ValueError(f"`scores` must have shape [N] or [N, 1] with N={mask.shape[0]}, got {tuple(scores.shape)}.")
    base = torch.zeros(mask.shape, dtype=dtype, device=mask.device) if token_rewards is None else \
        torch.where(mask, token_rewards.to(dtype), torch.zeros((), dtype=dtype, device=mask.device))
    r, length, back = _compact(base, mask)
    has = length > 0
    r[has.nonzero(as_tuple=True)[0], length[has] - 1] += scores[has].to(dtype)
    return r, length, back


def token_reinforce_pp(
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    token_rewards: torch.Tensor | None = None,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (the reference's ``compute_reinforce_plus_plus_outcome_advantage``).

    The reward is the row's score at its last response token (plus ``token_rewards`` [N, T] at
    every token when given, e.g. the KL-in-reward penalty); the return of token ``t`` is
    ``G_t = sum_{k >= t} gamma**(k - t) r_k`` inside the response; advantages are the returns
    whitened over all the masked tokens of the batch (:func:`masked_whiten`).

    Args: ``scores`` [N] or [N, 1], ``mask`` [N, T] bool. Returns ``(advantages, returns)`` [N, T].
    """
    mask = mask.bool()
    dtype = torch.float64 if mask.device.type != "mps" else torch.float32
    r, _, back = _token_rewards(mask, scores, token_rewards, dtype)
    returns = back(r @ _discount_matrix(mask.shape[-1], gamma, dtype, mask.device))
    out_dtype = scores.dtype if scores.is_floating_point() else torch.float32
    return masked_whiten(returns, mask, eps).to(out_dtype), returns.to(out_dtype)


def clipped_value_loss(
    value: torch.Tensor,
    old_value: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor,
    *,
    value_clip: float | None = 0.5,
    aggregation: Aggregation = "token-mean",
    norm_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's ``compute_value_loss``: ``agg(max((V - R)**2, (clip(V, V_old +- value_clip) - R)**2))``.

    All [N, T]; ``value`` carries grad. Returns ``(loss, clip_fraction)`` (scalars); ``value_clip=None``
    disables clipping (clip fraction 0).
    """
    target = target.detach()
    loss = (value - target) ** 2
    frac = torch.zeros((), dtype=value.dtype, device=value.device)
    if value_clip is not None:
        old_value = old_value.detach()
        v_clipped = old_value + (value - old_value).clamp(-value_clip, value_clip)
        loss_clipped = (v_clipped - target) ** 2
        with torch.no_grad():
            frac = ((loss_clipped > loss) & mask).sum() / mask.sum().clamp_min(1)
        loss = torch.maximum(loss, loss_clipped)
    return aggregate(loss, mask, aggregation, norm_length=norm_length), frac.to(value.dtype)


def token_gae(
    values: torch.Tensor,
    mask: torch.Tensor,
    scores: torch.Tensor,
    *,
    gamma: float = 1.0,
    lmbda: float = 1.0,
    whiten: bool = True,
    eps: float = 1e-8,
    token_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token GAE inside each row's response (the reference PPO for LLM agents).

    The reward is the row's score at its **last** response token and 0 elsewhere (plus
    ``token_rewards`` [N, T] at every token when given, e.g. the KL-in-reward penalty); the value
    after the last token is 0. With ``delta_t = r_t + gamma * V_{t+1} - V_t``::

        A_t = sum_{k >= t} (gamma * lmbda)**(k - t) * delta_k,   returns_t = A_t + V_t

    (for ``gamma = lmbda = 1``: ``A_t = score - V_t``). Advantages are then whitened over all the
    masked tokens of the batch (``whiten=True``, :func:`masked_whiten`); returns are computed
    before whitening. The recursion is TorchRL's
    :func:`~torchrl.objectives.value.functional.vec_generalized_advantage_estimate` (which drops
    discount factors ``(gamma * lmbda)**k`` below 1e-7) over the responses left-aligned; what is
    ours is the LLM layout: the score placed at the last response token and the mask compaction.

    Args:
        values (Tensor): [N, T] value estimates at collection time (detached).
        mask (Tensor): [N, T] bool, True on response tokens (need not be contiguous).
        scores (Tensor): [N] or [N, 1] the row's score.

    Returns:
        ``(advantages, returns)``, both [N, T] float, 0 on masked-out tokens.
    """
    if values.ndim != 2 or mask.shape != values.shape:
        raise ValueError(f"`values` and `mask` must both be [N, T], got {tuple(values.shape)} and {tuple(mask.shape)}.")
    values = values.detach()
    mask = mask.bool()
    n, t = mask.shape
    r, length, back = _token_rewards(mask, scores, token_rewards, values.dtype)
    v, _, _ = _compact(values, mask)  # each response left-aligned, r = V = 0 after it
    # TorchRL's GAE on [N, T, 1] (time at dim -2): a row is one trajectory (done at its last column);
    # a response ends at its last token (terminated: V after it is 0); the zero padding after it adds
    # nothing to the tokens before it.
    idx = torch.arange(t, device=values.device)[None, :]
    v_next = torch.cat([v[:, 1:], v.new_zeros(n, 1)], -1)[..., None]
    terminated = (idx >= length[:, None] - 1)[..., None]
    done = (idx == t - 1).expand(n, t)[..., None]
    if gamma * lmbda == 0:  # TD(0); TorchRL 0.14.1's vectorised GAE fails on gamma * lmbda = 0
        adv_c = td0_advantage_estimate(gamma, v[..., None], v_next, r[..., None], done, terminated)
    else:
        adv_c, _ = vec_generalized_advantage_estimate(gamma, lmbda, v[..., None], v_next, r[..., None], done,
                                                      terminated)
    adv_c = adv_c.squeeze(-1)
    advantages, returns = back(adv_c), back(adv_c + v)
    if whiten:
        advantages = masked_whiten(advantages, mask, eps)
    return advantages, returns


class PPOLoss(ClipPolicyLoss):
    """PPO for LLM rows: :class:`ClipPolicyLoss` on per-token GAE advantages + clipped value loss.

    This is the PPO the trainer runs for ``algorithm.name=ppo`` (with ``critic_coef=None``: its
    critic is a separate model with its own optimizer, trained by :meth:`value_loss`).

    Call :meth:`compute_advantage` once on the whole collected batch (it writes ``advantage`` and
    ``value_target`` [N, T], whitening over the batch); then call the loss on mini-batches. If
    ``value_target`` is missing when the loss is called, :meth:`compute_advantage` is run on the
    given batch first.

    Extra keys (besides :class:`ClipPolicyLoss`'s, ``advantage`` here being [N, T]):

    - ``state_value`` [N, T]: current value-head output (carries grad);
    - ``old_state_value`` [N, T]: value-head output at collection time;
    - ``score`` [N] or [N, 1]: the row's score (e.g. :func:`~.functional.episode_scores`);
    - ``token_reward`` [N, T], optional: a per-token reward added before GAE (the KL-in-reward
      penalty ``-beta * kl_t``, :func:`~torchrl_agent.objectives.kl_in_reward`);
    - ``value_target`` [N, T]: GAE returns (written by :meth:`compute_advantage`).

    Value loss (``vclip = clamp(V, V_old - value_clip, V_old + value_clip)``,
    :func:`clipped_value_loss`)::

        loss_critic = critic_coef * agg(max((V - R)**2, (vclip - R)**2))

    Keyword Args:
        value_clip (float | None): defaults to 0.5; ``None`` disables value clipping.
        critic_coef (float | None): defaults to 1.0; ``None``: no ``loss_critic`` in the output
            (a critic trained apart calls :meth:`value_loss`), as TorchRL's ``ClipPPOLoss``.
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
        token_reward: NestedKey = "token_reward"
        value_target: NestedKey = "value_target"

    default_keys = _AcceptedKeys

    def __init__(
        self,
        actor_network: TensorDictModuleBase | None = None,
        *,
        value_clip: float | None = 0.5,
        critic_coef: float | None = 1.0,
        gamma: float = 1.0,
        lmbda: float = 1.0,
        aggregation: Aggregation = "token-mean",
        kl_coef: float = 0.0,
        **kwargs,
    ) -> None:
        super().__init__(actor_network, aggregation=aggregation, kl_coef=kl_coef, **kwargs)
        if value_clip is not None and value_clip <= 0:
            raise ValueError(f"`value_clip` must be > 0 (or None), got {value_clip}.")
        if not (0.0 <= gamma <= 1.0 and 0.0 <= lmbda <= 1.0):
            raise ValueError(f"`gamma` and `lmbda` must be in [0, 1], got {gamma} and {lmbda}.")
        self.value_clip = value_clip
        self.critic_coef = None if critic_coef is None else float(critic_coef)
        self.gamma, self.lmbda = float(gamma), float(lmbda)

    def compute_advantage(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Writes per-token ``advantage`` and ``value_target`` [N, T] (GAE over ``old_state_value``,
        the ``score`` at each row's last token plus the optional ``token_reward``, whitened) in place."""
        mask = self._get(tensordict, "mask").bool()
        old_v = self._check_tokens("old_state_value", self._get(tensordict, "old_state_value"), mask.shape)
        token_reward = self._get(tensordict, "token_reward", required=False)
        if token_reward is not None:
            token_reward = self._check_tokens("token_reward", token_reward, mask.shape)
        adv, ret = token_gae(old_v, mask, self._get(tensordict, "score"), gamma=self.gamma, lmbda=self.lmbda,
                             token_rewards=token_reward)
        tensordict.set(self.tensor_keys.advantage, adv)
        tensordict.set(self.tensor_keys.value_target, ret)
        return tensordict

    def value_loss(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        """The clipped value loss (not scaled by ``critic_coef``) and its clip fraction, scalars,
        from ``state_value``, ``old_state_value``, ``value_target`` and ``mask`` [N, T]."""
        mask = self._get(tensordict, "mask").bool()
        value = self._check_tokens("state_value", self._get(tensordict, "state_value"), mask.shape)
        old_value = self._check_tokens("old_state_value", self._get(tensordict, "old_state_value"), mask.shape)
        target = self._check_tokens("value_target", self._get(tensordict, "value_target"), mask.shape)
        return clipped_value_loss(value, old_value, target, mask, value_clip=self.value_clip,
                                  aggregation=self.aggregation, norm_length=self.norm_length)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Policy terms (see :class:`ClipPolicyLoss`) plus ``loss_critic`` and ``value_clip_fraction``
        (unless ``critic_coef`` is ``None``)."""
        if tensordict.get(self.tensor_keys.value_target, None) is None and self.critic_coef is not None:
            tensordict = self.compute_advantage(tensordict.copy())
        out = super().forward(tensordict)
        if self.critic_coef is None:
            return out
        loss_v, frac = self.value_loss(tensordict)
        if self.value_clip is not None:
            out.set("value_clip_fraction", frac)
        out.set("loss_critic", self.critic_coef * loss_v)
        return out

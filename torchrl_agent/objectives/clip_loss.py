"""Clipped policy-gradient loss for LLM rows (GRPO / GiGPO / DAPO / GSPO / RLOO / REINFORCE++)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.objectives.common import LossModule

from torchrl_agent.objectives._inputs import broadcast_advantage, get_tokens, length_mask

__all__ = ["ClipPolicyLoss", "aggregate", "kl_estimate", "AGGREGATIONS", "KL_TYPES"]

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KL_TYPES = ("k1", "k2", "k3", "abs")


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from the sampled tokens' log-probs (the reference's
    ``kl_penalty``; J. Schulman, *Approximating KL divergence*). With ``d = logp - ref``:

    - ``k1``: ``d``; ``abs``: ``|d|``; ``k2``: ``0.5 * d**2``;
    - ``k3``: ``exp(-d) + d - 1``, clamped to ``[-10, 10]`` (the only clamped one, as the reference).

    Shapes: any, broadcast; returns a tensor of that shape.
    """
    d = log_prob - ref_log_prob
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return ((-d).exp() + d - 1).clamp(-10.0, 10.0)
    raise ValueError(f"`kl_type` must be one of {KL_TYPES}, got {kind!r}.")


def aggregate(value: torch.Tensor, mask: torch.Tensor, mode: Aggregation = "token-mean",
              norm_length: int | None = None) -> torch.Tensor:
    """Reduces a per-token ``value`` [N, T] over the ``mask`` [N, T] (bool) to a scalar.

    - ``token-mean``: sum over all masked tokens / number of masked tokens;
    - ``seq-mean-token-sum``: per row, sum over its tokens; then mean over rows;
    - ``seq-mean-token-mean``: per row, mean over its tokens; then mean over rows;
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): per row, sum over its tokens divided by a constant
      length ``L`` (``norm_length``, default ``T``); then mean over rows.

    Rows without any masked token are left out of the row means. Masked-out entries may hold any
    value (even non-finite): they are selected away, never multiplied by 0.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"`aggregation` must be one of {AGGREGATIONS}, got {mode!r}.")
    value = torch.where(mask, value, torch.zeros((), dtype=value.dtype, device=value.device))
    if mode == "token-mean":
        return value.sum() / mask.sum().clamp_min(1)
    per_row = value.sum(-1)
    count = mask.sum(-1)
    if mode == "seq-mean-token-mean":
        per_row = per_row / count.clamp_min(1)
    elif mode == "seq-mean-token-sum-norm":
        per_row = per_row / float(norm_length or mask.shape[-1])
    has_tokens = count > 0
    return (per_row * has_tokens).sum() / has_tokens.sum().clamp_min(1)


class ClipPolicyLoss(LossModule):
    """PPO-style clipped policy loss over padded per-token tensors, with KL and entropy terms.

    Per token (``A`` is the row's advantage broadcast over its tokens, or a per-token advantage)::

        rho   = exp(logp - logp_old)                    # "token" ratio
              = exp(mean_row(logp - logp_old))          # "sequence" ratio (GSPO), same for all tokens
        loss  = max(-A * rho, -A * clip(rho, 1 - eps_low, 1 + eps_high))
        loss  = min(loss, -A * dual_clip)   where A < 0 (dual clip; not in sequence mode)
        kl    = kl_estimate(logp, ref, kl_type)         # k3 by default: clamp(exp(ref-logp) - (ref-logp) - 1, +-10)

    and the scalars (each reduced with ``aggregation`` over the ``mask``)::

        loss_objective = agg(loss)                  (sequence ratio: always seq-mean-token-mean, as the reference)
        loss_kl        = kl_coef * agg(kl)          (only when kl_coef > 0)
        loss_entropy   = -entropy_coef * agg(H)     (only when an entropy is given and entropy_coef > 0)

    to be summed by the caller (TorchRL style).

    Input tensordict, batch ``[N]`` (keys overridable with :meth:`set_keys`):

    - ``log_prob`` [N, T] float: current policy, carries grad (written by ``actor_network`` if given);
    - ``old_log_prob`` [N, T]: policy at collection time (no grad);
    - ``ref_log_prob`` [N, T]: reference policy, only needed when ``kl_coef > 0``;
    - ``entropy`` [N, T] (optional): per-token entropy of the current policy;
    - ``mask`` [N, T] bool: True on response tokens; when the key is absent, derived from the
      lengths of a ragged ``log_prob``/``old_log_prob`` (all True for dense ones);
    - ``advantage`` [N], [N, 1], [N, 1, 1] or [N, T].

    Per-token entries may be TorchRL's ragged lazy stacks (e.g. ``set_keys(old_log_prob=("log_probs",
    "response"))`` on collector data): they are read right-padded, see :mod:`._inputs`.

    Output tensordict (no batch dim): ``loss_objective``, ``loss_kl``, ``loss_entropy`` and the
    detached diagnostics ``clip_fraction`` (share of tokens where the clipped branch is active),
    ``kl`` (``mean(logp_old - logp)``, approx KL old -> new), ``approx_kl`` (its k3 form, token mean),
    ``response_kl`` (``mean_rows(sum_t logp_old - logp)``, the KL of whole responses, k1), ``kl_ref`` (when KL is used),
    ``entropy`` (when given) and ``ratio_mean``.

    Args:
        actor_network (TensorDictModuleBase, optional): called on the input first; must write
            ``log_prob`` (and optionally ``entropy``). When ``None``, ``log_prob`` must be present.

    Keyword Args:
        eps_low (float): lower clip, ``1 - eps_low``. Defaults to 0.2.
        eps_high (float): upper clip, ``1 + eps_high`` (clip-higher: 0.28). Defaults to 0.2.
        dual_clip (float | None): dual-clip constant ``c > 1`` for ``A < 0``. ``None`` disables. Defaults to 3.0.
        aggregation (str): ``"token-mean"`` (default), ``"seq-mean-token-sum"``, ``"seq-mean-token-mean"``.
        kl_coef (float): k3 KL-to-reference coefficient. ``0`` disables. Defaults to 0.01.
        entropy_coef (float): entropy bonus coefficient. Defaults to 0.001.
        ratio (str): ``"token"`` (default) or ``"sequence"`` (GSPO: use e.g. eps 3e-4/4e-4 and
            ``max_log_ratio=10``; dual clip is not applied). The sequence ratio takes the reference's
            form ``log s_t = logp_t - sg(logp_t) + sg(mean_row(logp - logp_old))``: its value is the
            row's ratio, its gradient flows through each token's own log-prob.
        max_log_ratio (float): log-ratios are clamped to ``[-max, max]`` before ``exp`` (sequence
            ratio: to ``max`` from above only, as the reference). Defaults to 20.
        kl_type (str): the KL estimator, ``"k1"``, ``"k2"``, ``"k3"`` (default) or ``"abs"``, see
            :func:`kl_estimate`.
        norm_length (int, optional): the constant ``L`` of the ``seq-mean-token-sum-norm``
            aggregation (default: the padded width ``T`` of the batch).
    """

    @dataclass
    class _AcceptedKeys:
        """Configurable tensordict keys, see the class docstring."""

        log_prob: NestedKey = "log_prob"
        old_log_prob: NestedKey = "old_log_prob"
        ref_log_prob: NestedKey = "ref_log_prob"
        entropy: NestedKey = "entropy"
        mask: NestedKey = "mask"
        advantage: NestedKey = "advantage"

    default_keys = _AcceptedKeys
    _loss_mask_key = None
    out_keys = ["loss_objective", "loss_kl", "loss_entropy", "clip_fraction", "kl", "approx_kl", "response_kl",
                "kl_ref", "entropy", "ratio_mean"]

    def __init__(
        self,
        actor_network: TensorDictModuleBase | None = None,
        *,
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        dual_clip: float | None = 3.0,
        aggregation: Aggregation = "token-mean",
        kl_coef: float = 0.01,
        entropy_coef: float = 0.001,
        ratio: Literal["token", "sequence"] = "token",
        max_log_ratio: float = 20.0,
        kl_type: str = "k3",
        norm_length: int | None = None,
    ) -> None:
        super().__init__()
        if kl_type not in KL_TYPES:
            raise ValueError(f"`kl_type` must be one of {KL_TYPES}, got {kl_type!r}.")
        if norm_length is not None and norm_length < 1:
            raise ValueError(f"`norm_length` must be >= 1 (or None), got {norm_length}.")
        if not (0.0 <= eps_low < 1.0):
            raise ValueError(f"`eps_low` must be in [0, 1), got {eps_low}.")
        if eps_high < 0:
            raise ValueError(f"`eps_high` must be >= 0, got {eps_high}.")
        if dual_clip is not None and dual_clip <= 1.0:
            raise ValueError(f"`dual_clip` must be > 1 (or None to disable), got {dual_clip}.")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"`aggregation` must be one of {AGGREGATIONS}, got {aggregation!r}.")
        if ratio not in ("token", "sequence"):
            raise ValueError(f"`ratio` must be 'token' or 'sequence', got {ratio!r}.")
        if kl_coef < 0 or entropy_coef < 0:
            raise ValueError(f"`kl_coef` and `entropy_coef` must be >= 0, got {kl_coef} and {entropy_coef}.")
        self.actor_network = actor_network
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self.dual_clip = None if dual_clip is None else float(dual_clip)
        self.aggregation = aggregation
        # buffers (TorchRL's LossModule convention): they follow ``.to(device)`` and the state dict
        self.register_buffer("kl_coef", torch.tensor(float(kl_coef)))
        self.register_buffer("entropy_coef", torch.tensor(float(entropy_coef)))
        self.ratio = ratio
        self.max_log_ratio = float(max_log_ratio)
        self.kl_type = kl_type
        self.norm_length = norm_length

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        pass  # no value estimator

    @property
    def in_keys(self) -> list[NestedKey]:
        k = self.tensor_keys
        keys = [k.old_log_prob, k.mask, k.advantage]
        keys += list(self.actor_network.in_keys) if self.actor_network is not None else [k.log_prob]
        if self.kl_coef > 0:
            keys.append(k.ref_log_prob)
        return keys

    # ------------------------------------------------------------------ helpers
    def _get(self, td: TensorDictBase, name: str, required: bool = True) -> torch.Tensor | None:
        key = getattr(self.tensor_keys, name)
        value = td.get(key, None)
        if value is None and required:
            raise KeyError(f"{type(self).__name__}: key {key!r} (`{name}`) not found in the tensordict.")
        return value

    @staticmethod
    def _check_tokens(name: str, x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if x.ndim == 3 and x.shape[-1] == 1:
            x = x.squeeze(-1)
        if x.shape != shape:
            raise ValueError(f"`{name}` must have shape {tuple(shape)} (like `mask`), got {tuple(x.shape)}.")
        return x

    @staticmethod
    def _broadcast_advantage(adv: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return broadcast_advantage(adv, shape)

    def _tokens(self, td: TensorDictBase, name: str, required: bool = True):
        """A per-token entry as ``([N, T], lengths or None)``, ragged lazy stacks right-padded."""
        value, lengths = get_tokens(td, getattr(self.tensor_keys, name))
        if value is None and required:
            raise KeyError(f"{type(self).__name__}: key {getattr(self.tensor_keys, name)!r} (`{name}`) "
                           "not found in the tensordict.")
        return value, lengths

    def _inputs(self, tensordict: TensorDictBase):
        if self.actor_network is not None:
            tensordict = self.actor_network(tensordict.copy())  # shallow copy: the input is not modified
        log_prob, lengths = self._tokens(tensordict, "log_prob")
        old_log_prob, old_lengths = self._tokens(tensordict, "old_log_prob")
        mask, _ = get_tokens(tensordict, self.tensor_keys.mask, padding_value=False)
        if mask is None:  # no mask key: the lengths of ragged log-probs, else every token
            lengths = lengths if lengths is not None else old_lengths
            mask = (length_mask(lengths, log_prob.shape[-1]) if lengths is not None
                    else torch.ones(log_prob.shape, dtype=torch.bool, device=log_prob.device))
        if mask.ndim != 2:
            raise ValueError(f"`mask` must have shape [N, T], got {tuple(mask.shape)}.")
        mask = mask.bool()
        log_prob = self._check_tokens("log_prob", log_prob, mask.shape)
        old_log_prob = self._check_tokens("old_log_prob", old_log_prob, mask.shape)
        if old_log_prob.requires_grad:
            old_log_prob = old_log_prob.detach()
        adv = self._broadcast_advantage(self._get(tensordict, "advantage").detach(), mask.shape).to(log_prob.dtype)
        return tensordict, mask, log_prob, old_log_prob, adv

    def _log_ratio(self, log_prob, old_log_prob, mask):
        zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
        log_ratio = torch.where(mask, log_prob - old_log_prob, zero)  # padding may hold anything
        if self.ratio == "sequence":
            # GSPO: the row's ratio is the geometric mean of its token ratios; the value is the
            # row's, the gradient goes through each token's own log-prob (reference form)
            count = mask.sum(-1, keepdim=True).clamp_min(1)
            seq = (log_ratio.sum(-1, keepdim=True) / count).detach()
            log_ratio = torch.where(mask, log_prob - log_prob.detach() + seq, zero)
            return log_ratio.clamp(max=self.max_log_ratio)
        return log_ratio.clamp(-self.max_log_ratio, self.max_log_ratio)

    def _policy_terms(self, log_ratio, adv, mask):
        """Per-token clipped loss [N, T] and the clip indicator [N, T] (bool)."""
        ratio = log_ratio.exp()
        loss_unclipped = -adv * ratio
        loss_clipped = -adv * ratio.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)
        loss = torch.maximum(loss_unclipped, loss_clipped)
        clipped = loss_clipped > loss_unclipped
        if self.dual_clip is not None and self.ratio == "token":
            loss_dual = -adv * self.dual_clip
            dual = (adv < 0) & (loss_dual < loss)
            loss = torch.where(adv < 0, torch.minimum(loss, loss_dual), loss)
            clipped = clipped | dual
        return loss, clipped & mask, ratio

    # ------------------------------------------------------------------ forward
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Computes the loss terms; see the class docstring for keys and shapes."""
        tensordict, mask, log_prob, old_log_prob, adv = self._inputs(tensordict)
        log_ratio = self._log_ratio(log_prob, old_log_prob, mask)
        loss, clipped, ratio = self._policy_terms(log_ratio, adv, mask)
        objective_agg = "seq-mean-token-mean" if self.ratio == "sequence" else self.aggregation
        out = {"loss_objective": aggregate(loss, mask, objective_agg, self.norm_length)}
        n_tokens = mask.sum().clamp_min(1)
        with torch.no_grad():
            out["clip_fraction"] = clipped.sum().to(log_prob.dtype) / n_tokens
            out["ratio_mean"] = torch.where(mask, ratio, 0.0).sum() / n_tokens
            k1 = torch.where(mask, old_log_prob - log_prob, 0.0)  # logp_old - logp per token
            out["kl"] = k1.sum() / n_tokens
            # KL(sampling || current), k3 (>= 0; CleanRL's approx_kl): what algorithm.target_kl bounds
            out["approx_kl"] = torch.where(mask, kl_estimate(old_log_prob, log_prob, "k3"), 0.0).sum() / n_tokens
            # KL(sampling || current) of whole responses, k1: the mean over the rows of log pi_old(y) - log pi(y),
            # what algorithm.max_update_kl bounds over all the rows. Unlike k3 it is linear in the probability
            # that leaves the sampled tokens for ones the sampling policy seldom produced (a lost answer format)
            rows = mask.any(-1)
            out["response_kl"] = k1.sum(-1)[rows].sum() / rows.sum().clamp_min(1)

        if self.kl_coef > 0:
            ref, _ = self._tokens(tensordict, "ref_log_prob")
            ref = self._check_tokens("ref_log_prob", ref, mask.shape).detach()
            kl = kl_estimate(log_prob, torch.where(mask, ref, log_prob.detach()), self.kl_type)
            kl_ref = aggregate(kl, mask, self.aggregation, self.norm_length)
            out["loss_kl"] = self.kl_coef * kl_ref
            out["kl_ref"] = kl_ref.detach()

        entropy, _ = self._tokens(tensordict, "entropy", required=False)
        if entropy is not None:
            entropy = self._check_tokens("entropy", entropy, mask.shape)
            ent = aggregate(entropy, mask, self.aggregation, self.norm_length)
            out["entropy"] = ent.detach()
            if self.entropy_coef > 0:
                out["loss_entropy"] = -self.entropy_coef * ent
        return TensorDict(out, batch_size=[])

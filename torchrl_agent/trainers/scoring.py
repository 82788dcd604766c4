"""The trainer's log-probs of the rows' response tokens: the old and reference log-probs written
into the rows once per iteration (:meth:`Scorer.score`), and the loss's input with the current
log-probs (:meth:`Scorer.loss_inputs`).

Keys (the loss's ``tensor_keys``): :meth:`Scorer.score` writes ``old_log_prob`` (the policy that
collected the rows, before any step of this iteration) and, with a KL term, ``ref_log_prob`` (the
frozen reference), each ``[N, T]`` float32 on the CPU, zero after each response (``T``: the
longest). :meth:`Scorer.loss_inputs` returns ``log_prob``, ``entropy``, ``mask``, ``advantage``,
``old_log_prob`` and ``ref_log_prob`` for some rows, ``[n, T]`` on the model's device.

A VLM on image observations (``models.processor`` set) is scored by
:class:`~torchrl_agent.modules.VisionResponseLogProbs`: each row's image inputs are rebuilt from its
``pixels`` (uint8 ``[H, W, 3]``) with the engine's ``model.min_pixels`` / ``model.max_pixels``, so the
old, reference and current log-probs see the frame the response was sampled from.
"""

from __future__ import annotations

import logging

import torch
from tensordict import TensorDict, TensorDictBase

from torchrl_agent.modules import ResponseLogProbs, VisionResponseLogProbs
from torchrl_agent.trainers.batching import (
    fit_width,
    minibatch_advantage,
    pad_ragged,
    response_mask,
    row_lengths,
    token_budget_batches,
)
from torchrl_agent.trainers.distributed import split_over_ranks
from torchrl_agent.trainers.engines import image_bounds
from torchrl_agent.trainers.model_setup import TrainingModels

__all__ = ["Scorer"]

logger = logging.getLogger("torchrl_agent")


class Scorer:
    """The policy's and the reference's log-probs of the rows' responses (module docstring).

    Args:
        cfg: the run's :class:`~torchrl_agent.trainers.config.TrainConfig`.
        models: the run's :class:`~torchrl_agent.trainers.model_setup.TrainingModels`.
        keys: the loss's ``tensor_keys`` (where the log-probs are written and read).
        device: the trainer's device.
        collector: the training collector (under torchrun its ``owner`` tells each engine's rows apart).

    Attributes:
        actor: the policy's :class:`~torchrl_agent.modules.ResponseLogProbs` with gradients and entropies
            (:class:`~torchrl_agent.modules.VisionResponseLogProbs` for a VLM on image observations).
        recomputed_rows: the rows this rank recomputed last (its share).
    """

    def __init__(self, cfg, models: TrainingModels, keys, device: torch.device, collector=None) -> None:
        a = cfg.algorithm
        self.cfg, self.keys, self.device, self.collector = cfg, keys, device, collector
        self.model, self.reference, self.pad_token_id = models.model, models.reference, models.tokenizer.pad_token_id
        self.compute_dtype, self.autocast_enabled = models.compute_dtype, models.autocast_enabled
        self.processor = getattr(models, "processor", None)
        self.actor = self.log_probs(self.model, temperature=cfg.rollout.temperature, chunk_tokens=a.logprob_chunk_tokens)
        self.recomputed_rows: list[int] = []

    def log_probs(self, model, **kwargs) -> ResponseLogProbs:
        """The log-prob module of ``model`` (``kwargs``: :class:`~torchrl_agent.modules.ResponseLogProbs`'s):
        with a VLM's processor, :class:`~torchrl_agent.modules.VisionResponseLogProbs` with the engine's
        image bounds (the rows' ``pixels`` give the image inputs)."""
        if self.processor is None:
            return ResponseLogProbs(model, self.pad_token_id, **kwargs)
        return VisionResponseLogProbs(model, self.processor, **image_bounds(self.cfg), **kwargs)

    def autocast(self):
        """Computes in ``model.dtype`` over the float32 weights (a single process; under torchrun
        FSDP2's mixed-precision policy does it, and this is a no-op)."""
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast_enabled)

    @torch.no_grad()
    def recompute(self, model, rows: TensorDictBase) -> list[torch.Tensor]:
        """Per-row response log-probs under ``model`` (a list of 1-D float32 tensors, on CPU under
        torchrun), in micro-batches of ``algorithm.micro_batch_tokens`` padded tokens.

        Computed once over the ranks: each rank its share of the rows (balanced by tokens), then
        gathered (:func:`~torchrl_agent.trainers.distributed.split_over_ranks`); every rank calls it
        with the same rows and gets every row's log-probs. :attr:`recomputed_rows` holds the rows
        this rank computed."""
        a = self.cfg.algorithm
        module = self.log_probs(model, temperature=self.actor.temperature, with_entropy=False,
                                chunk_tokens=a.logprob_chunk_tokens)
        lengths, _ = row_lengths(rows)

        def compute(idx: list[int]) -> list[torch.Tensor]:
            with self.autocast():
                part = module(rows[idx])
            return [lp[: int(n)] for lp, n in zip(part["log_prob"], part["mask"].sum(-1))]

        out, self.recomputed_rows = split_over_ranks(
            compute, lengths, lambda share: token_budget_batches(share, lengths, a.micro_batch_tokens))
        return out

    def score(self, rows: TensorDictBase) -> TensorDictBase:
        """Writes into ``rows`` their old log-probs and, with a KL term (``algorithm.kl_coef > 0`` or
        ``kl_in_reward``), their reference log-probs (module docstring). Once per iteration, before
        the KL-in-reward penalty and the update.

        Every rank calls it with the same rows (a forward of the sharded model is collective)."""
        old = self.recompute(self.model, rows)
        width = max(1, max((len(x) for x in old), default=1))
        rows.set(self.keys.old_log_prob, pad_ragged(old, width, "cpu"))
        ref = self.reference_log_probs(rows)
        if ref is not None:
            rows.set(self.keys.ref_log_prob, pad_ragged(ref, width, "cpu"))
        return rows

    def reference_log_probs(self, rows: TensorDictBase) -> list[torch.Tensor] | None:
        """The KL reference's per-row log-probs (None without a KL term: neither ``kl_coef`` nor ``kl_in_reward``)."""
        a = self.cfg.algorithm
        if a.kl_coef <= 0 and not a.kl_in_reward:
            return None
        if self.cfg.model.lora_rank > 0:
            with self.model.disable_adapter():
                return self.recompute(self.model, rows)
        return self.recompute(self.reference, rows)

    def loss_inputs(self, rows: TensorDictBase, idx: list[int], active: bool = True) -> TensorDict:
        """The loss module's input for rows ``idx``, under its ``tensor_keys``: current log-probs and
        entropies (with grad, in the compute dtype; a VLM's from the rows' ``pixels``, which
        ``rows[idx]`` keeps), and the rows' old and reference log-probs (:meth:`score`) and
        advantages, ``[n, T]``, on the model's device."""
        keys = self.keys
        part = rows[idx]
        with self.autocast():
            current = self.actor(part)
        width = current["log_prob"].shape[-1]
        mask = current["mask"] & active
        batch = TensorDict({
            keys.log_prob: current["log_prob"], keys.entropy: current["entropy"], keys.mask: mask,
            keys.advantage: minibatch_advantage(part.get(keys.advantage), slice(None), width).to(mask.device),
        }, batch_size=[len(idx)])
        for key in (keys.old_log_prob, keys.ref_log_prob):
            if key in part.keys():
                batch[key] = fit_width(part.get(key), width).to(mask.device).contiguous()
        return batch

    def logprob_consistency(self, rows: TensorDictBase) -> dict[str, float]:
        """The engine's sampling log-probs against the trainer's recomputation of the same tokens
        (the rows' ``old_log_prob``, :meth:`score`): they should agree; a gap means the engine samples
        from another distribution than the one trained (stale weights, dtype, sampling settings)."""
        sampled = rows.get(("log_probs", "response"), as_padded_tensor=True)
        width = sampled.shape[-1]
        mask = response_mask(rows, width)
        recomputed = fit_width(rows.get(self.keys.old_log_prob), width)
        diff = (sampled.to(mask.device) - recomputed.to(mask.device)).abs()[mask]
        out = {"logprob_diff_max": float(diff.max()) if diff.numel() else 0.0,
               "logprob_diff_mean": float(diff.mean()) if diff.numel() else 0.0}
        owner = getattr(self.collector, "owner", None)
        if owner is not None:  # under torchrun: each rollout engine's rows apart
            engines = owner(rows).to(mask.device)[:, None].expand_as(mask)[mask]
            for e in range(self.collector.engines):
                mine = diff[engines == e]
                out[f"logprob_diff_max/engine{e}"] = float(mine.max()) if mine.numel() else 0.0
        threshold = self.cfg.rollout.logprob_warn_threshold
        if out["logprob_diff_max"] > threshold:
            logger.warning("engine and trainer log-probs differ by up to %.3g (> rollout.logprob_warn_threshold=%g)",
                           out["logprob_diff_max"], threshold)
        return out

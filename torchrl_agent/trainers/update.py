"""The update: epochs x mini-batches x micro-batches of the clipped loss, one AdamW step per
mini-batch (:class:`Updater`)::

    for epoch, minibatch of rows:                        # one optimizer step per mini-batch
        for micro, weight in micro_batches(minibatch):   # at most `micro_batch_tokens` padded tokens
            (weight * loss(scorer.loss_inputs(micro))).backward()  # accumulates the mini-batch's gradient
        clip -> AdamW step (skipped when the gradient norm is not finite)
        algorithm.max_kl: the step halved or undone while the mini-batch's KL to the sampling policy
            is over the budget (k3 per token)
    algorithm.max_update_kl: the whole update's displacement halved or undone while its KL to the
        sampling policy over all the rows is over the budget (k1 per response)

The rows carry ``old_log_prob`` / ``ref_log_prob`` (:meth:`Scorer.score
<torchrl_agent.trainers.scoring.Scorer.score>`) and ``advantage`` under the loss's ``tensor_keys``.
"""

from __future__ import annotations

import logging
import math

import torch
from tensordict import TensorDictBase

from torchrl_agent.trainers.batching import micro_batches
from torchrl_agent.trainers.distributed import clip_grad_norm, reduce_mean, shard_indices
from torchrl_agent.trainers.scoring import Scorer

__all__ = ["TrainingDivergedError", "Updater", "scheduled_lr"]

logger = logging.getLogger("torchrl_agent")


class TrainingDivergedError(RuntimeError):
    """Raised after ``algorithm.max_skipped_steps`` consecutive non-finite gradient norms."""


def scheduled_lr(a, i: int, n: int) -> float:
    """The learning rate of iteration ``i`` of ``n`` (``a``: the ``algorithm`` config section): a
    linear warm-up from 0 over the first ``w = int(lr_warmup_ratio * n)`` iterations, then
    ``algorithm.lr_schedule`` (verl's two):

    - ``constant``: ``lr``;
    - ``cosine``: ``lr * (m + (1 - m) * (1 + cos(pi * (i - w) / (n - 1 - w))) / 2)``, from ``lr`` after
      the warm-up to ``m * lr`` at the last iteration (``m = algorithm.min_lr_ratio``).
    """
    warmup = int(a.lr_warmup_ratio * n)
    if i < warmup:
        return a.lr * i / warmup
    if a.lr_schedule == "constant":
        return a.lr
    progress = min(1.0, (i - warmup) / max(1, n - 1 - warmup))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Updater:
    """Runs the update of the module docstring on scored rows (every rank under torchrun, each its
    share of every mini-batch).

    Args:
        cfg: the run's :class:`~torchrl_agent.trainers.config.TrainConfig`.
        model: the trained policy.
        loss: the policy loss (:class:`~torchrl_agent.objectives.ClipPolicyLoss` or an algorithm's).
        scorer: builds the loss's inputs (:meth:`~torchrl_agent.trainers.scoring.Scorer.loss_inputs`).

    Attributes:
        optimizer: AdamW over the model's parameters.
        consecutive_skips: optimizer steps skipped in a row (non-finite gradient norm).
    """

    def __init__(self, cfg, model, loss, scorer: Scorer) -> None:
        a = cfg.algorithm
        self.cfg, self.model, self.loss, self.scorer = cfg, model, loss, scorer
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay, eps=a.adam_eps)
        self.consecutive_skips = 0

    def micro_batches(self, rows: TensorDictBase, idx: list[int], active: bool) -> list[tuple[list[int], float, bool]]:
        """:func:`~torchrl_agent.trainers.batching.micro_batches` of this rank's rows ``idx`` of a mini-batch."""
        a = self.cfg.algorithm
        return micro_batches(rows, idx, active, budget=a.micro_batch_tokens, aggregation=a.aggregation)

    def update(self, rows: TensorDictBase, iteration: int) -> dict[str, float]:
        """Epochs of clipped-loss mini-batch steps over the scored rows at ``iteration``; returns
        averaged loss metrics and the update's counts.

        A mini-batch is one optimizer step, its rows run as token-budget micro-batches whose weighted
        losses accumulate exactly the mini-batch's gradient (every aggregation, any number of ranks).
        """
        a = self.cfg.algorithm
        n = rows.batch_size[0]
        for group in self.optimizer.param_groups:
            group["lr"] = scheduled_lr(a, iteration, self.cfg.iterations)
        consistency = self.scorer.logprob_consistency(rows)
        generator = torch.Generator().manual_seed(self.cfg.seed * 7919 + iteration)
        totals: dict[str, float] = {}
        steps = skipped = halvings = undone = 0
        kl_max = response_kl_max = 0.0  # the largest KL measured on the policy this update kept
        stopped = False  # algorithm.target_kl / max_kl: the update stopped early
        stop_kl = min((k for k in (a.target_kl, a.max_kl) if k is not None), default=None)
        theta_start = [p.detach().clone() for p in self.trained_parameters()] if a.max_update_kl is not None else None
        self.model.train()
        for _ in range(a.epochs):
            if stopped:
                break
            order = torch.randperm(n, generator=generator)
            for start in range(0, n, a.minibatch_size):
                # this rank's rows of the mini-batch (all of them in a single process)
                idx, active = shard_indices(order[start:start + a.minibatch_size])
                self.optimizer.zero_grad(set_to_none=True)
                step: dict[str, torch.Tensor] = {}
                measured = []
                for micro, weight, live in self.micro_batches(rows, idx, active):
                    losses = self.loss(self.scorer.loss_inputs(rows, micro, live))
                    total = sum(v for k, v in losses.items() if k.startswith("loss_"))
                    (weight * total).backward()  # sum over micro-batches (and ranks): the mini-batch's gradient
                    for k, v in [*losses.items(), ("loss", total)]:
                        step[k] = step.get(k, 0.0) + weight * v.detach()
                    measured.append((losses, weight, len(micro) if live else 0))
                # PPO's early stop (SB3's and CleanRL's target_kl): the policy has already moved this far
                # from the sampling one on this mini-batch (approx_kl: k3, >= 0, per token); no step
                kl_before = self.minibatch_kl(measured)
                kl_max, response_kl_max = max(kl_max, kl_before[0]), max(response_kl_max, kl_before[1])
                if stop_kl is not None and kl_before[0] > stop_kl:
                    stopped = True
                    break
                before = [p.detach().clone() for p in self.trained_parameters()] if a.max_kl is not None else None
                grad_norm, was_skipped = self.optimizer_step(iteration)
                skipped += was_skipped
                if was_skipped:
                    continue
                if before is not None:  # the KL budget: measured after the step, halved or undone
                    kl_after, halved = self.limit_step(rows, idx, active, before, iteration)
                    halvings += halved
                    if kl_after is None:  # undone: the weights are those measured by kl_before
                        undone += 1
                        stopped = True
                        break
                    kl_max, response_kl_max = max(kl_max, kl_after[0]), max(response_kl_max, kl_after[1])
                steps += 1
                for k, v in step.items():
                    totals[k] = totals.get(k, 0.0) + reduce_mean(v)
                totals["grad_norm"] = totals.get("grad_norm", 0.0) + grad_norm
        means = {k: v / steps for k, v in totals.items()} if steps else {"loss": float("nan")}
        whole = {}
        if theta_start is not None and steps:
            update_kl, update_halvings = self.limit_update(rows, theta_start, iteration)
            whole = {"update_kl": update_kl, "update_kl_halvings": update_halvings}
        return {**means, **consistency, "lr": self.optimizer.param_groups[0]["lr"], "skipped_steps": skipped,
                "approx_kl_max": kl_max, "response_kl_max": response_kl_max, "kl_step_halvings": halvings, "kl_steps_undone": undone,
                "update_steps": steps, "update_stopped_early": float(stopped), **whole}

    def optimizer_step(self, iteration: int) -> tuple[float, bool]:
        """Clips the accumulated gradient and steps; returns ``(grad_norm, skipped)``.

        A non-finite norm skips the step: the gradients are zeroed, the weights and the optimizer
        state stay as they are, and a warning names the step. ``algorithm.max_skipped_steps`` skips in
        a row raise :class:`TrainingDivergedError`, before any NaN reaches the weights or a checkpoint.
        """
        a = self.cfg.algorithm
        grad_norm = clip_grad_norm(self.model.parameters(), a.grad_clip)  # the same on every rank
        if torch.isfinite(grad_norm):
            self.optimizer.step()
            self.consecutive_skips = 0
            return float(grad_norm), False
        self.optimizer.zero_grad(set_to_none=True)
        self.consecutive_skips += 1
        logger.warning("iteration %d: gradient norm is %s, optimizer step skipped (%d in a row)",
                       iteration, float(grad_norm), self.consecutive_skips)
        if self.consecutive_skips >= a.max_skipped_steps:
            raise TrainingDivergedError(
                f"training diverged at iteration {iteration}: the gradient norm was not finite in "
                f"{self.consecutive_skips} optimizer steps in a row (algorithm.max_skipped_steps="
                f"{a.max_skipped_steps}); the weights were left as they were before. Likely causes: "
                f"algorithm.lr={a.lr:g} too high, algorithm.kl_coef={a.kl_coef:g} or "
                f"algorithm.entropy_coef={a.entropy_coef:g} too large, or non-finite advantages/rewards")
        return float(grad_norm), True

    def trained_parameters(self) -> list[torch.Tensor]:
        """The parameters the optimizer steps (LoRA: the adapters only)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    @staticmethod
    def minibatch_kl(measured: list[tuple[TensorDictBase, float, int]]) -> tuple[float, float]:
        """``(approx_kl, response_kl)`` of a mini-batch, KL(sampling || current) per token (k3) and of
        whole responses (k1, :class:`~torchrl_agent.objectives.ClipPolicyLoss`), averaged over the
        ranks, from its micro-batches' ``(loss outputs, loss weight, rows)``: the token mean weighs them
        as the loss does, the response mean by their rows."""
        token = reduce_mean(sum(weight * losses["approx_kl"] for losses, weight, _ in measured))
        rows = reduce_mean(float(sum(n for *_, n in measured)))
        response = reduce_mean(sum(n * losses["response_kl"] for losses, _, n in measured))
        return token, response / rows if rows > 0 else 0.0

    @torch.no_grad()
    def measure_kl(self, rows: TensorDictBase, idx: list[int], active: bool) -> tuple[float, float]:
        """:meth:`minibatch_kl` of the current policy on this rank's rows ``idx`` of a mini-batch: one
        forward pass, no gradient."""
        return self.minibatch_kl([(self.loss(self.scorer.loss_inputs(rows, micro, live)), weight,
                                   len(micro) if live else 0)
                                  for micro, weight, live in self.micro_batches(rows, idx, active)])

    @torch.no_grad()
    def update_kl(self, rows: TensorDictBase) -> float:
        """KL(sampling || current) of whole responses (k1) over ALL ``rows``: the mean over the rows of
        ``log pi_old(y) - log pi(y)``, measured mini-batch by mini-batch (:meth:`measure_kl`, no gradient),
        the same on every rank."""
        n, size = rows.batch_size[0], self.cfg.algorithm.minibatch_size
        total = 0.0
        for start in range(0, n, size):
            chunk = torch.arange(start, min(n, start + size))
            total += len(chunk) * self.measure_kl(rows, *shard_indices(chunk))[1]
        return total / n

    @torch.no_grad()
    def line_search(self, anchor: list[torch.Tensor], measure, within) -> tuple[object | None, int]:
        """TRPO's backtracking line search on the trained parameters: while ``within(measure())`` is
        false, their displacement from ``anchor`` is halved (``theta = (theta + anchor) / 2``), at most
        ``algorithm.max_kl_backtracks`` times; still outside, they are reset to ``anchor`` (AdamW's moments
        keep the gradients). Returns ``(the last measure, halvings)``, the measure ``None`` when reset.
        Every rank takes the same decisions (the measures are averaged over the ranks)."""
        params = self.trained_parameters()
        for halved in range(self.cfg.algorithm.max_kl_backtracks + 1):
            measured = measure()
            if within(measured):
                return measured, halved
            if halved < self.cfg.algorithm.max_kl_backtracks:
                for p, b in zip(params, anchor):
                    p.add_(b - p, alpha=0.5)
        for p, b in zip(params, anchor):
            p.copy_(b)
        return None, self.cfg.algorithm.max_kl_backtracks

    def limit_step(self, rows, idx, active, before: list[torch.Tensor], iteration: int
                   ) -> tuple[tuple[float, float] | None, int]:
        """``algorithm.max_kl``, a KL budget for every step of the update (a trust region): after an
        optimizer step the mini-batch's KL to the sampling policy (:meth:`minibatch_kl`, k3 per token) is
        measured again and the step is line-searched (:meth:`line_search`) from the weights ``before``
        it. Returns ``((approx_kl, response_kl) of the weights kept, halvings)``, the KL ``None`` when the
        step was undone."""
        a = self.cfg.algorithm
        kl, halved = self.line_search(before, lambda: self.measure_kl(rows, idx, active), lambda kl: kl[0] <= a.max_kl)
        if kl is None:
            logger.warning("iteration %d: an optimizer step moved the policy by more than approx_kl %s even at 1/%d "
                           "of its size (algorithm.max_kl): undone, the update stops here",
                           iteration, a.max_kl, 2 ** a.max_kl_backtracks)
        return kl, halved

    def limit_update(self, rows: TensorDictBase, start: list[torch.Tensor], iteration: int) -> tuple[float, int]:
        """``algorithm.max_update_kl``, a KL budget for the whole update: once its epochs are done,
        :meth:`update_kl` (k1 per response over all the rows) is line-searched (:meth:`line_search`)
        from the update's starting weights ``start``. Returns ``(update_kl of the weights kept,
        halvings)``; an undone update counts ``max_kl_backtracks + 1`` halvings and KL 0."""
        a = self.cfg.algorithm
        kl, halved = self.line_search(start, lambda: self.update_kl(rows), lambda kl: kl <= a.max_update_kl)
        if kl is None:
            logger.warning("iteration %d: the update moved the policy by more than %s per response over its rows "
                           "even at 1/%d of its size (algorithm.max_update_kl): undone",
                           iteration, a.max_update_kl, 2 ** a.max_kl_backtracks)
            return 0.0, halved + 1
        return kl, halved

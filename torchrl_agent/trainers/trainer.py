"""The training loop: collect -> advantages -> old/reference log-probs -> clipped loss -> AdamW.

One iteration (:meth:`Trainer.train`, the same loop on every rank under torchrun)::

    rows = collect_rows()                           # one row per env step, complete groups; score(rows) writes
                                                    # "old_log_prob" and "ref_log_prob" into them (no grad, once),
                                                    # then the advantages: per row (GRPO, GiGPO, ...) or per token
                                                    # (PPO's GAE, REINFORCE++)
    for epoch, minibatch of rows:                   # one optimizer step per mini-batch
        for micro, weight in micro_batches(minibatch):   # at most `micro_batch_tokens` padded tokens
            (weight * ClipPolicyLoss(loss_inputs(micro))).backward()  # accumulates the mini-batch's gradient
        clip -> AdamW step (skipped when the gradient norm is not finite)
    policy.update_weights(...)                      # engines with their own weights
    evaluate on the held-out panel every `eval_every` iterations

Under torchrun every rank collects its share of the groups with its own rollout engine and
receives the others' rows, recomputes its share of the old/reference log-probs (gathered), plays
its share of the evaluation panel and trains its share of each mini-batch (FSDP2); after every
update each rank loads the full weights into its engine; rank 0 alone writes the logs
(docs/distributed.md). The pieces live in files named for them:
:mod:`.builders` (config -> engine, collector, advantage, loss), :mod:`.model_setup` (precision,
LoRA, FSDP2, reference), :mod:`.batching` (micro-batches, padding), :mod:`.loggers` (metrics
files, TensorBoard, W&B, plot), :mod:`.algorithms` (each algorithm by name, and the hooks that run its parts).

Metrics go to ``metrics.jsonl`` and TensorBoard in the run directory, one line per iteration to
the console; :meth:`Trainer.train` returns the run summary printed as the last line by the CLI.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from torchrl_agent.collectors import episode_metrics
from torchrl_agent.modules import ResponseLogProbs
from torchrl_agent.trainers.algorithms import AlgorithmHooks, AlgorithmParts
from torchrl_agent.trainers.batching import (
    fit_width,
    micro_batches,
    minibatch_advantage,
    pad_ragged,
    response_mask,
    row_lengths,
    token_budget_batches,
)
from torchrl_agent.trainers.builders import (
    build_advantage,
    build_collector,
    build_env,
    build_loss,
    build_policy,
    prompt_budget,
    rollout_config,
)
from torchrl_agent.trainers.checkpointing import (
    CheckpointError,
    check_model_state,
    check_resume_config,
    fsync_path,
    load_weights,
    model_shapes,
    numpy_state,
    plain_numpy_state,
    prune_checkpoints,
    read_checkpoint,
    remove_unfinished,
    save_weights,
    write_checkpoint,
)
from torchrl_agent.trainers.config import TrainConfig
from torchrl_agent.trainers.distributed import (
    broadcast_object,
    clip_grad_norm,
    full_state_dict,
    init_distributed,
    is_distributed,
    is_main_process,
    load_full_state_dict,
    reduce_mean,
    shard_indices,
    split_over_ranks,
)
from torchrl_agent.trainers.loggers import (
    console_line,
    finite_record,
    init_wandb,
    plot_learning_curve,
    sharp_fall,
    write_record,
)
from torchrl_agent.trainers.model_setup import setup_models
from torchrl_agent.trainers.run_dir import (
    GuardedSink,
    RunDirLock,
    RunInterrupted,
    StopSignals,
    check_run_dir,
    checkpoint_history,
    metrics_iterations,
    new_run_dir,
    open_metrics,
    open_tensorboard,
    records_digest,
)
from torchrl_agent.trainers.validate import validate_config
from torchrl_agent.trainers.weight_sync import choose_weight_sync

__all__ = ["CheckpointError", "Trainer", "TrainingDivergedError", "build_env", "micro_batches", "prompt_budget",
           "token_budget_batches"]

logger = logging.getLogger("torchrl_agent")


class TrainingDivergedError(RuntimeError):
    """Raised after ``algorithm.max_skipped_steps`` consecutive non-finite gradient norms."""


class Trainer:
    """Runs the loop of the module docstring for a :class:`TrainConfig`."""

    def __init__(self, cfg: TrainConfig):
        validate_config(cfg)  # every value in range (the algorithm's settings too), before any model is loaded
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        # under torchrun: one process per device, each with its engine; rank 0 logs (docs/distributed.md)
        self.rank, self.world_size, self.device = init_distributed(cfg.device, timeout_s=cfg.collective_timeout_s)
        torch.manual_seed(cfg.seed)
        a = cfg.algorithm
        models = setup_models(cfg, self.device, reference=a.kl_coef > 0 or a.kl_in_reward)
        self.model, self.tokenizer, self.reference = models.model, models.tokenizer, models.reference
        self.rollout_model = models.rollout_model  # the transformers engine's weights (None: vLLM, ranks > 0)
        self.compute_dtype, self.autocast_enabled = models.compute_dtype, models.autocast_enabled
        self.consecutive_skips = 0  # optimizer steps skipped in a row (non-finite gradient norm)
        r = cfg.rollout
        # every rank holds a rollout engine and collects its share of the groups (under torchrun the
        # engines are built together: vLLM's set-up is collective; see docs/distributed.md)
        self.policy = build_policy(cfg, self.rollout_model, self.tokenizer)
        self.eval_policy = copy.copy(self.policy)  # the same engine, sampled at the evaluation temperature
        self.eval_policy.temperature = r.eval_temperature
        # (collector.kind=multiprocess/ray: the collector's processes build their own envs and engines;
        # this process's engine evaluates)
        sharded = cfg.collector.kind != "step"
        self.env = None if sharded else build_env(rollout_config(cfg), self.tokenizer, policy=self.policy)
        self.collector = build_collector(cfg, self.env, self.policy, tokenizer=self.tokenizer)
        self.weight_sync_s = 0.0  # the last weight sync's seconds
        # how the trained weights reach the engines after every update (trainers/weight_sync.py)
        self.weight_sync, self._sync_weights = choose_weight_sync(
            self.model, self.rollout_model, self.policy, self.collector, compute_dtype=self.compute_dtype,
            sharded_collector=sharded, distributed=is_distributed())
        self.recomputed_rows: list[int] = []  # the rows this rank recomputed last (its share)
        self.advantage = build_advantage(cfg)
        self.actor = ResponseLogProbs(self.model, self.tokenizer.pad_token_id, temperature=r.temperature,
                                      chunk_tokens=a.logprob_chunk_tokens)
        self.loss = build_loss(cfg)  # before the hooks: PPO's critic trains with this loss's value term
        # the algorithm's parts (baseline episodes, critic) and options (dynamic sampling, KL in the
        # reward) around collection and advantages: every rank, on the same gathered rows
        self.hooks = AlgorithmHooks(cfg, AlgorithmParts(self.tokenizer, self.device, self.loss, self.policy,
                                                        self.collector))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=a.lr, weight_decay=a.weight_decay,
                                           eps=a.adam_eps)
        # the run directory (run_dir.py): a new folder of its own, or run_dir=, held by a lock
        run_dir = cfg.run_dir or (str(new_run_dir()) if is_main_process() else None)
        self.run_dir = Path(broadcast_object(run_dir))  # rank 0's folder
        self.lock = RunDirLock(self.run_dir).acquire() if is_main_process() else None
        self.signals = StopSignals()  # SIGINT / SIGTERM: stop at the end of an iteration (train)
        try:
            self.resume_path = self._check_run_dir()
        except BaseException:
            self.close()
            raise
        self.iteration = 0
        self.history: list[dict] = []
        self.evals: list[tuple[int, float]] = []  # (iteration, held-out success)
        self.last_checkpoint: Path | None = None  # the newest checkpoint written (or resumed from)
        self.nonfinite_metrics = 0  # metric values written as null so far
        self._faults_seen = 0  # entries of the env's fault_log already reported

    # ------------------------------------------------------------------ pieces
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
        module = ResponseLogProbs(model, self.tokenizer.pad_token_id, temperature=self.actor.temperature,
                                  with_entropy=False, chunk_tokens=a.logprob_chunk_tokens)
        lengths, _ = row_lengths(rows)

        def compute(idx: list[int]) -> list[torch.Tensor]:
            with self.autocast():
                part = module(rows[idx])
            return [lp[: int(n)] for lp, n in zip(part["log_prob"], part["mask"].sum(-1))]

        out, self.recomputed_rows = split_over_ranks(
            compute, lengths, lambda share: token_budget_batches(share, lengths, a.micro_batch_tokens))
        return out

    def score(self, rows: TensorDictBase) -> TensorDictBase:
        """Writes into ``rows``, under the loss's ``tensor_keys``, their old log-probs (``old_log_prob``:
        under the policy that collected them, before any step of this iteration) and, with a KL term
        (``algorithm.kl_coef > 0`` or ``kl_in_reward``), their reference log-probs (``ref_log_prob``):
        ``[N, T]`` float32 on the CPU, zero after each response (``T``: the longest). Once per
        iteration, before the KL-in-reward penalty and the update.

        Every rank calls it with the same rows (a forward of the sharded model is collective)."""
        keys = self.loss.tensor_keys
        old = self.recompute(self.model, rows)
        width = max(1, max((len(x) for x in old), default=1))
        rows.set(keys.old_log_prob, pad_ragged(old, width, "cpu"))
        ref = self.reference_log_probs(rows)
        if ref is not None:
            rows.set(keys.ref_log_prob, pad_ragged(ref, width, "cpu"))
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

    def micro_batches(self, rows: TensorDictBase, idx: list[int], active: bool) -> list[tuple[list[int], float, bool]]:
        """:func:`micro_batches` of this rank's rows ``idx`` of a mini-batch, per the config."""
        a = self.cfg.algorithm
        return micro_batches(rows, idx, active, budget=a.micro_batch_tokens, aggregation=a.aggregation)

    def loss_inputs(self, rows: TensorDictBase, idx: list[int], active: bool = True) -> TensorDict:
        """The loss module's input for rows ``idx``, under its ``tensor_keys``: current log-probs and
        entropies (with grad, in the compute dtype), and the rows' old and reference log-probs
        (:meth:`score`) and advantages, ``[n, T]``, on the model's device."""
        keys = self.loss.tensor_keys
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

    def optimizer_step(self) -> tuple[float, bool]:
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
                       self.iteration, float(grad_norm), self.consecutive_skips)
        if self.consecutive_skips >= a.max_skipped_steps:
            raise TrainingDivergedError(
                f"training diverged at iteration {self.iteration}: the gradient norm was not finite in "
                f"{self.consecutive_skips} optimizer steps in a row (algorithm.max_skipped_steps="
                f"{a.max_skipped_steps}); the weights were left as they were before. Likely causes: "
                f"algorithm.lr={a.lr:g} too high, algorithm.kl_coef={a.kl_coef:g} or "
                f"algorithm.entropy_coef={a.entropy_coef:g} too large, or non-finite advantages/rewards")
        return float(grad_norm), True

    def scheduled_lr(self) -> float:
        """The learning rate of this iteration ``i`` of ``n``: a linear warm-up from 0 over the first
        ``w = int(lr_warmup_ratio * n)`` iterations, then ``algorithm.lr_schedule`` (verl's two):

        - ``constant``: ``lr``;
        - ``cosine``: ``lr * (m + (1 - m) * (1 + cos(pi * (i - w) / (n - 1 - w))) / 2)``, from ``lr`` after
          the warm-up to ``m * lr`` at the last iteration (``m = algorithm.min_lr_ratio``).
        """
        a = self.cfg.algorithm
        n, i = self.cfg.iterations, self.iteration
        warmup = int(a.lr_warmup_ratio * n)
        if i < warmup:
            return a.lr * i / warmup
        if a.lr_schedule == "constant":
            return a.lr
        progress = min(1.0, (i - warmup) / max(1, n - 1 - warmup))
        return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def update(self, rows: TensorDictBase) -> dict[str, float]:
        """Epochs of clipped-loss mini-batch steps over the rows; returns averaged loss metrics.

        A mini-batch is one optimizer step, its rows run as token-budget micro-batches whose weighted
        losses accumulate exactly the mini-batch's gradient (every aggregation, any number of ranks).
        """
        a = self.cfg.algorithm
        n = rows.batch_size[0]
        for group in self.optimizer.param_groups:
            group["lr"] = self.scheduled_lr()
        if self.loss.tensor_keys.old_log_prob not in rows.keys():  # rows not from collect_rows
            self.policy.release_memory()
            self.score(rows)
        consistency = self.logprob_consistency(rows)
        generator = torch.Generator().manual_seed(self.cfg.seed * 7919 + self.iteration)
        totals: dict[str, float] = {}
        steps = skipped = halvings = undone = 0
        kl_max = 0.0  # the largest approx_kl measured on the policy this update kept
        stopped = False  # algorithm.target_kl / max_kl: the update stopped early
        stop_kl = min((k for k in (a.target_kl, a.max_kl) if k is not None), default=None)
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
                for micro, weight, live in self.micro_batches(rows, idx, active):
                    losses = self.loss(self.loss_inputs(rows, micro, live))
                    total = sum(v for k, v in losses.items() if k.startswith("loss_"))
                    (weight * total).backward()  # sum over micro-batches (and ranks): the mini-batch's gradient
                    for k, v in [*losses.items(), ("loss", total)]:
                        step[k] = step.get(k, 0.0) + weight * v.detach()
                # PPO's early stop (SB3's and CleanRL's target_kl): the policy has already moved this far
                # from the sampling one on this mini-batch's tokens (approx_kl: k3, >= 0); no step
                kl_before = float(reduce_mean(step["approx_kl"]))
                kl_max = max(kl_max, kl_before)
                if stop_kl is not None and kl_before > stop_kl:
                    stopped = True
                    break
                before = None if a.max_kl is None else [p.detach().clone() for p in self.trained_parameters()]
                grad_norm, was_skipped = self.optimizer_step()
                skipped += was_skipped
                if was_skipped:
                    continue
                if before is not None:  # the KL budget: measured after the step, halved or undone
                    kl_after, halved = self.limit_step(rows, idx, active, before)
                    halvings += halved
                    if kl_after is None:  # undone: the weights are those measured by kl_before
                        undone += 1
                        stopped = True
                        break
                    kl_max = max(kl_max, kl_after)
                steps += 1
                for k, v in step.items():
                    totals[k] = totals.get(k, 0.0) + reduce_mean(v)
                totals["grad_norm"] = totals.get("grad_norm", 0.0) + grad_norm
        self.sync_weights()
        means = {k: v / steps for k, v in totals.items()} if steps else {"loss": float("nan")}
        return {**means, **consistency, "lr": self.optimizer.param_groups[0]["lr"], "skipped_steps": skipped,
                "weight_sync_s": self.weight_sync_s, "approx_kl_max": kl_max, "kl_step_halvings": halvings,
                "kl_steps_undone": undone, "update_steps": steps, "update_stopped_early": float(stopped)}

    def trained_parameters(self) -> list[torch.Tensor]:
        """The parameters the optimizer steps (LoRA: the adapters only)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    @torch.no_grad()
    def minibatch_kl(self, rows: TensorDictBase, idx: list[int], active: bool) -> float:
        """``approx_kl`` (KL(sampling || current), k3, token mean) of the current policy on this rank's
        rows ``idx`` of a mini-batch, averaged over the ranks: one forward pass, no gradient."""
        kl = sum(weight * self.loss(self.loss_inputs(rows, micro, live))["approx_kl"]
                 for micro, weight, live in self.micro_batches(rows, idx, active))
        return float(reduce_mean(kl))

    @torch.no_grad()
    def limit_step(self, rows, idx, active, before: list[torch.Tensor]) -> tuple[float | None, int]:
        """``algorithm.max_kl``, a KL budget for the whole update (a trust region, as TRPO's line
        search): after an optimizer step the mini-batch's ``approx_kl`` to the sampling policy is
        measured again; while it is over ``max_kl`` the step is halved (``theta = (theta + theta_before) / 2``),
        at most ``max_kl_backtracks`` times; a step still over the budget is undone (the weights
        ``before`` it; AdamW's moments keep the gradient). Returns ``(approx_kl of the weights kept,
        halvings)``, the KL ``None`` when the step was undone. Every rank takes the same decisions
        (the KL is averaged over the ranks)."""
        a = self.cfg.algorithm
        params = self.trained_parameters()
        for halved in range(a.max_kl_backtracks + 1):
            kl = self.minibatch_kl(rows, idx, active)
            if kl <= a.max_kl:
                return kl, halved
            if halved < a.max_kl_backtracks:
                for p, b in zip(params, before):
                    p.add_(b - p, alpha=0.5)
        for p, b in zip(params, before):
            p.copy_(b)
        logger.warning("iteration %d: an optimizer step moved the policy by approx_kl %.3g even at 1/%d of its "
                       "size (> algorithm.max_kl=%g): undone, the update stops here", self.iteration, kl,
                       2 ** a.max_kl_backtracks, a.max_kl)
        return None, a.max_kl_backtracks

    def logprob_consistency(self, rows: TensorDictBase) -> dict[str, float]:
        """The engine's sampling log-probs against the trainer's recomputation of the same tokens
        (the rows' ``old_log_prob``, :meth:`score`): they should agree; a gap means the engine samples
        from another distribution than the one trained (stale weights, dtype, sampling settings)."""
        sampled = rows.get(("log_probs", "response"), as_padded_tensor=True)
        width = sampled.shape[-1]
        mask = response_mask(rows, width)
        recomputed = fit_width(rows.get(self.loss.tensor_keys.old_log_prob), width)
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

    def sync_weights(self) -> None:
        """Hands the trained weights to the rollout engines as :attr:`weight_sync` says (chosen once,
        when the rollout is built: :mod:`.weight_sync`); the seconds it takes go to
        :attr:`weight_sync_s` (``weight_sync_s`` in the metrics). Under torchrun every rank calls it."""
        t0 = time.perf_counter()
        self.policy.resume()  # the engine's memory, freed during the update (rollout.sleep_mode)
        self._sync_weights()
        self.weight_sync_s = time.perf_counter() - t0

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Success on the held-out panel (fixed odd seeds, the same panel every time); under
        torchrun every rank plays its share of the panel with its engine (all ranks call it)."""
        self.model.eval()
        env = build_env(rollout_config(self.cfg, "eval"), self.tokenizer, split="eval", policy=self.eval_policy)
        try:
            rows = build_collector(self.cfg, env, self.eval_policy, split="eval").collect()
        finally:
            env.close()  # worker processes, if any
        self.model.train()
        return {f"eval_{k}": v for k, v in episode_metrics(rows).items()}

    def warm_start(self) -> dict[str, float]:
        """Supervised steps on expert responses (``<think>..</think><action>expert</action>``)."""
        from torchrl_agent.trainers.warm_start import batch_indices, expert_rows, supervised_step

        w = self.cfg.warm_start
        rows = expert_rows(self.cfg, self.tokenizer, episodes=w.episodes)
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=w.lr)
        generator = torch.Generator().manual_seed(self.cfg.seed)
        loss = float("nan")
        for _ in range(w.steps):
            loss = supervised_step(self.actor, optimizer, rows[batch_indices(rows, w.batch_size, generator)])
        return {"warm_start_loss": loss, "warm_start_rows": rows.batch_size[0], "warm_start_steps": w.steps}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Save everything the next iteration depends on: weights, optimizer, iteration, the
        collector's position in its seed stream, RNG states and the metrics so far.

        Written atomically and with a checksum, as plain tensors and values that load without
        running code (:func:`~torchrl_agent.trainers.checkpointing.write_checkpoint`). Raises
        :class:`CheckpointError` (nothing written, the previous checkpoint intact) when the weights
        hold NaN/inf or when the write fails (a full disk)."""
        path = Path(path or self.run_dir / "checkpoints" / f"iteration_{self.iteration:05d}.pt")
        kept = f"the previous checkpoint ({self.last_checkpoint or 'none written yet'}) is intact"
        weights = save_weights(self.model, self.optimizer, path, kept=kept)  # under torchrun: each rank its shards
        if not is_main_process():
            return path
        state = {
            **weights,  # "model" and "optimizer" (one process), or "shards" (torchrun: checkpointing.write_shards)
            "iteration": self.iteration, "collector": self.collector.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": plain_numpy_state()},
            # the metrics history is kept once, in metrics.jsonl: its count and digest here (run_dir.checkpoint_history)
            "history_records": len(self.history), "history_sha256": records_digest(self.history),
            "evals": [list(e) for e in self.evals], "config": dataclasses.asdict(self.cfg),
            "algorithm": self.hooks.state_dict(),  # PPO's critic, the KL controller, ReMax's seed stream
        }
        fsync_path(self.run_dir / "metrics.jsonl")  # the lines the checkpoint's history digest relies on
        write_checkpoint(state, path, kept=kept)
        self.last_checkpoint = path
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Continue from checkpoint ``path``: read and verified once by ``_check_run_dir`` (or now,
        :func:`~torchrl_agent.trainers.checkpointing.read_checkpoint`); no code of the file runs."""
        state = {}
        if is_main_process():
            state = self._resume_state if path == self.resume_path and self._resume_state else read_checkpoint(path)
            self._resume_state = None
            check_model_state(model_shapes(state), {k: v.shape for k, v in self.model.state_dict().items()}, path,
                              state.get("config"))
        load_weights(self.model, self.optimizer, path, state)  # a checkpoint of any number of ranks
        self.sync_weights()  # the rollout engine gets the loaded weights
        self.iteration = broadcast_object(state.get("iteration"))
        # every rank's collector and algorithm hooks resume at rank 0's place
        self.collector.load_state_dict(broadcast_object(state.get("collector")))
        self.hooks.load_state_dict(broadcast_object(state.get("algorithm", {})))
        if not is_main_process():
            return
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(numpy_state(state["rng"]["numpy"]))
        self.history, self.evals = checkpoint_history(path, state), [tuple(e) for e in state["evals"]]
        self.last_checkpoint = Path(path)

    def close(self) -> None:
        """Stop a multi-process or Ray collector (its processes / actors: a run that stopped on an
        error inside a sweep must not leave them to the next job), release the run directory's lock
        (also done at exit) and the signal handlers. Idempotent."""
        collector = getattr(self, "collector", None)
        if collector is not None and self.cfg.collector.kind != "step":
            try:
                collector.shutdown(raise_on_error=False)
            except Exception as err:  # after a fault its processes may be gone already: release the rest
                logger.warning("collector shutdown: %s: %s", type(err).__name__, err)
        if getattr(self, "lock", None) is not None:
            self.lock.release()
        if getattr(self, "signals", None) is not None:
            self.signals.uninstall()

    def _stop_if_signalled(self) -> None:
        """After an iteration: if SIGINT / SIGTERM came (to rank 0), every rank saves a checkpoint of
        it (unless the periodic one just did) and raises :class:`~torchrl_agent.trainers.run_dir.RunInterrupted`."""
        signum = self.signals.requested if is_main_process() else None
        if is_distributed():
            signum = broadcast_object(signum)
        if signum is None:
            return
        self.signals.requested = signum
        done = self.run_dir / "checkpoints" / f"iteration_{self.iteration:05d}.pt"
        if self.last_checkpoint != done:
            self.save_checkpoint(done)
        raise self.signals.stop_message(self.run_dir, done, self.iteration)

    # ------------------------------------------------------------------ loop
    def collect_rows(self) -> tuple[TensorDictBase | None, dict]:
        """This iteration's training rows, with their advantages, on every rank; and their metrics.

        Every rank collects its share of the groups with its own engine and receives the others'
        rows (:class:`~torchrl_agent.collectors.DistributedStepCollector`; in a single process the
        :class:`~torchrl_agent.collectors.StepCollector` collects them all), through
        :meth:`AlgorithmHooks.collect <torchrl_agent.trainers.algorithms.AlgorithmHooks.collect>`;
        then every rank leaves out the faulted episodes and computes the advantages on the same
        rows. ``None`` rows: every episode of the batch faulted, no update this iteration."""
        rows, sampling = self.hooks.collect(self.collector)
        rows, faults = self._drop_faulted(rows)
        metrics = {**faults, **sampling}
        if rows is None:
            return None, metrics
        self.policy.release_memory()  # collection is over: free the engine's memory (rollout.sleep_mode)
        self.score(rows)  # old (and reference) log-probs, written into the rows once
        rows, prepared = self.hooks.prepare(rows, self.advantage, self.iteration, self.loss.tensor_keys)  # advantages
        # (+ KL in the reward, PPO's critic update)
        metrics.update(episode_metrics(rows), **prepared)
        return rows, metrics

    def train(self) -> dict:
        """Runs the iterations (every rank under torchrun; rank 0 alone logs and plots);
        returns the run summary on rank 0 (``{}`` on the other ranks)."""
        cfg = self.cfg
        main = is_main_process()
        writer = metrics_file = None
        # SIGINT / SIGTERM stop the run at the end of an iteration (run_dir.StopSignals; rank 0 decides)
        self.signals.install()
        if main:
            # TensorBoard and W&B are views of metrics.jsonl: their write errors are logged once, never fatal
            writer = open_tensorboard(self.run_dir / "tensorboard")
            self.wandb = init_wandb(cfg, self.run_dir)
            self.wandb = None if self.wandb is None else GuardedSink("W&B", self.wandb)
        t_start = time.perf_counter()
        summary: dict = {"run_dir": str(self.run_dir), "env": cfg.env.name, "algorithm": cfg.algorithm.name}
        start = 0
        if self.resume_path is not None:
            self.load_checkpoint(self.resume_path)
            start = self.iteration + 1
            if main:
                logger.info("resumed from %s at iteration %d", self.resume_path, start)
        if main:
            metrics_file = self._open_metrics(keep_through=start - 1)
        if self.resume_path is None and cfg.warm_start.steps > 0:
            success = self.evaluate()["eval_success"]  # every rank plays its share of the panel
            if main:  # the untrained policy's held-out success, plotted at iteration -1
                self.evals.append((-1, success))
            summary.update(self.warm_start())
            self.sync_weights()
            if self.reference is not None:  # the KL term anchors the warm-started policy, not the untrained one
                load_full_state_dict(self.reference, full_state_dict(self.model))
            if main:
                logger.info("warm start: %s", {k: summary[k] for k in ("warm_start_loss", "warm_start_steps")})
        evals = self.evals
        try:
            for it in range(start, cfg.iterations):
                self.iteration = it
                t0 = time.perf_counter()
                record: dict = {"iteration": it}
                if it == 0 or (cfg.eval_every and it % cfg.eval_every == 0):
                    record.update(self.evaluate())
                    evals.append((it, record["eval_success"]))
                rows, collected = self.collect_rows()
                record.update(collected)
                if rows is not None:
                    record.update(self.update(rows))
                if main:
                    stats = self.collector.stats
                    record.update(env_steps=stats["env_steps"],  # rows collected (with fault_rows_dropped: none lost)
                                  env_steps_per_s=stats["env_steps_per_s"], tokens_per_s=stats["tokens_per_s"],
                                  generated_tokens=stats["generated_tokens"], iteration_s=time.perf_counter() - t0,
                                  prompt_budget_truncations=stats.get("prompt_budget_truncations", 0))
                    self._log(record, writer, metrics_file)
                if cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0:
                    self._periodic_checkpoint()
                self._stop_if_signalled()  # SIGINT / SIGTERM: a checkpoint, then RunInterrupted
        except RunInterrupted:
            if main:
                metrics_file.close()
            self.close()
            raise
        except Exception as err:
            if main:
                logger.error("the run stopped at iteration %d (%s: %s); metrics through iteration %s are in %s; "
                             "last good checkpoint: %s", self.iteration, type(err).__name__, err,
                             max(metrics_iterations(self.run_dir), default="none"), self.run_dir / "metrics.jsonl",
                             self.last_checkpoint or "none (set checkpoint_every)")
                with contextlib.suppress(OSError):  # a full disk: the buffered line cannot be flushed either
                    metrics_file.close()
            self.close()
            raise
        try:
            self.save_checkpoint(self.run_dir / "checkpoints" / "last.pt")
        except CheckpointError as err:  # training is done: the final evaluation and the summary still come
            logger.error("%s", err)
            summary["checkpoint_error"] = str(err)
        if cfg.collector.kind != "step":
            self.collector.shutdown()  # its processes / actors (close() would too: free them before the evaluation)
        final = {"iteration": cfg.iterations}
        final.update(self.evaluate())
        if not main:
            self.close()
            return {}
        evals.append((cfg.iterations, final["eval_success"]))
        self._log(final, writer, metrics_file)
        if writer is not None:
            writer.close()
        metrics_file.close()
        summary.update(
            iterations=cfg.iterations,
            eval_success_first=evals[0][1],
            eval_success_last=evals[-1][1],
            eval_success_after_warm_start=next((s for it, s in evals if it == 0), None) if cfg.warm_start.steps else None,
            eval_curve=evals,
            train_success_last=next((h["success"] for h in reversed(self.history) if "success" in h), None),
            wall_s=round(time.perf_counter() - t_start, 1),
        )
        try:
            plot_learning_curve(self.history, evals, self.run_dir / "learning_curve.png",
                                f"{cfg.env.name} / {cfg.algorithm.name}")
        except OSError as err:  # a full disk: the plot is a view of metrics.jsonl
            logger.error("learning_curve.png not written (%s)", err)
        self.close()
        return summary

    # ------------------------------------------------------------------ run directory, faults, logs
    def _check_run_dir(self) -> Path | None:
        """The checkpoint to resume from (``resume=``: a file, a run directory, or ``auto``), read
        and verified, its model checked against this one; refuses a ``run_dir`` that already holds a
        run when ``resume=`` is not set (:func:`~torchrl_agent.trainers.run_dir.check_run_dir`)."""
        self._resume_state = None
        path = None
        if is_main_process():
            path, self._resume_state = check_run_dir(self.run_dir, self.cfg.resume, self.cfg.checkpoint_every)
            if self._resume_state is not None:  # the same model, then the same experiment (one line naming the keys)
                check_model_state(model_shapes(self._resume_state), {k: v.shape for k, v in self.model.state_dict().items()},
                                  path, self._resume_state.get("config"))
                check_resume_config(self._resume_state.get("config"), dataclasses.asdict(self.cfg), path)
            remove_unfinished(self.run_dir / "checkpoints")  # writes a killed run did not finish
        path = broadcast_object(None if path is None else str(path))
        return None if path is None else Path(path)

    def _open_metrics(self, keep_through: int):
        """``metrics.jsonl`` for appending, holding exactly the records of the checkpoint resumed from
        (iterations ``<= keep_through``; none for a new run), so a resumed run repeats and skips none."""
        return open_metrics(self.run_dir, [h for h in self.history if h["iteration"] <= keep_through])

    def _periodic_checkpoint(self) -> None:
        """A periodic checkpoint that cannot be written is reported and the run goes on (the
        next one is tried again; the final ``last.pt`` raises)."""
        try:
            self.save_checkpoint()
        except CheckpointError as err:
            logger.error("%s; training continues", err)
            return
        if self.cfg.checkpoint_keep and is_main_process():  # an evaluation at iteration i scores checkpoint i - 1
            prune_checkpoints(self.run_dir / "checkpoints", self.cfg.checkpoint_keep, {i - 1: s for i, s in self.evals})

    def _drop_faulted(self, rows: TensorDictBase) -> tuple[TensorDictBase | None, dict]:
        """Leave the episodes cut short by a fault (``worker_fault`` / ``env_fault``) out of the
        advantage groups and the loss: their rows are removed, a group that lost episodes is
        normalised over the rest, or dropped when fewer than 2 remain. Returns the rows (``None``
        when none are left) and the counts for the metrics."""
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
        out = {"env_faults": int(bad_traj.numel()), "fault_rows_dropped": int((~keep).sum()),
               "fault_groups_dropped": int(dropped_groups.numel())}
        if bad_traj.numel():
            log = getattr(getattr(self.env, "base_env", self.env), "fault_log", [])
            reasons = [r.splitlines()[0] for r in log[self._faults_seen:]]
            self._faults_seen = len(log)
            logger.warning("iteration %d: %d episode(s) ended by a fault, left out of training (%d rows, %d "
                           "groups dropped); reasons: %s", self.iteration, out["env_faults"],
                           out["fault_rows_dropped"], out["fault_groups_dropped"], reasons[-3:])
        if not keep.any():
            return None, out
        return (rows if bool(keep.all()) else rows[keep.nonzero().reshape(-1)]), out

    def _log(self, record: dict, writer, metrics_file) -> None:
        """One iteration's metrics: kept in ``history``, written (:mod:`.loggers`), shown on the console."""
        record, bad = finite_record(record)
        if bad:  # strict JSON: NaN/inf are written as null, counted and warned about
            self.nonfinite_metrics += len(bad)
            record["nonfinite_metrics"] = len(bad)
            logger.warning("iteration %d: non-finite metrics written as null: %s", record["iteration"], bad)
        fall = sharp_fall(next((h for h in reversed(self.history) if "success" in h), None), record)
        if fall:
            logger.warning("%s", fall)
        self.history.append(record)
        write_record(record, metrics_file, writer, getattr(self, "wandb", None))
        print(console_line(record), flush=True)

"""The training loop, made of parts: collect -> score -> advantages -> update -> sync -> log -> checkpoint.

One iteration (:meth:`Trainer.iterate`, the same loop on every rank under torchrun)::

    evaluate on the held-out panel every `eval_every` iterations    # Trainer.evaluate
    rows = collect_rows()       # one row per env step, complete groups (AlgorithmHooks.collect);
                                # faulted episodes dropped (batching.drop_faulted); Scorer.score writes
                                # "old_log_prob" and "ref_log_prob" into them (no grad, once); then the
                                # advantages: per row (GRPO, GiGPO, ...) or per token (PPO's GAE, REINFORCE++)
    update(rows)                # Updater.update: epochs x mini-batches x token-budget micro-batches,
                                # one AdamW step per mini-batch; then sync_weights: the engines get the weights
    log the record              # MetricsLog.log: metrics.jsonl, TensorBoard, W&B, the console (rank 0)
    checkpoint                  # Checkpointer.periodic: every `checkpoint_every` iterations

Under torchrun every rank collects and evaluates its share with its own engine, recomputes its
share of the log-probs and trains its share of each mini-batch (FSDP2); rank 0 alone writes the
logs (docs/distributed.md). Each part lives in a file named for it (docs/architecture.md);
:meth:`Trainer.train` returns the run summary printed as the last line by the CLI.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import torch
from tensordict import TensorDictBase

from torchrl_agent.collectors import episode_metrics
from torchrl_agent.trainers.algorithms import AlgorithmHooks, AlgorithmParts
from torchrl_agent.trainers.batching import drop_faulted
from torchrl_agent.trainers.builders import (
    build_advantage,
    build_collector,
    build_env,
    build_loss,
    build_policy,
    rollout_config,
)
from torchrl_agent.trainers.checkpointer import Checkpointer
from torchrl_agent.trainers.checkpointing import CheckpointError
from torchrl_agent.trainers.config import TrainConfig
from torchrl_agent.trainers.distributed import (
    broadcast_object,
    full_state_dict,
    init_distributed,
    is_distributed,
    is_main_process,
    load_full_state_dict,
)
from torchrl_agent.trainers.loggers import MetricsLog, peak_rss_gb
from torchrl_agent.trainers.model_setup import setup_models
from torchrl_agent.trainers.run_dir import RunDirLock, StopSignals, new_run_dir
from torchrl_agent.trainers.scoring import Scorer
from torchrl_agent.trainers.update import TrainingDivergedError, Updater
from torchrl_agent.trainers.validate import validate_config
from torchrl_agent.trainers.weight_sync import choose_weight_sync

__all__ = ["CheckpointError", "Trainer", "TrainingDivergedError", "build_env"]

logger = logging.getLogger("torchrl_agent")


class Trainer:
    """Runs the loop of the module docstring for a :class:`TrainConfig`.

    Its parts: :attr:`scorer` (:class:`~torchrl_agent.trainers.scoring.Scorer`), :attr:`updater`
    (:class:`~torchrl_agent.trainers.update.Updater`, with the optimizer), :attr:`hooks` (the
    algorithm's), :attr:`metrics` (:class:`~torchrl_agent.trainers.loggers.MetricsLog`) and
    :attr:`checkpoints` (:class:`~torchrl_agent.trainers.checkpointer.Checkpointer`).
    """

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
        # every rank holds a rollout engine and collects its share of the groups (under torchrun the
        # engines are built together: vLLM's set-up is collective; see docs/distributed.md)
        self.policy = build_policy(cfg, self.rollout_model, self.tokenizer)
        self.eval_policy = copy.copy(self.policy)  # the same engine, sampled at the evaluation temperature
        self.eval_policy.temperature = cfg.rollout.eval_temperature
        # (collector.kind=multiprocess/ray: its processes build their own envs and engines; this one evaluates)
        sharded = cfg.collector.kind != "step"
        self.env = None if sharded else build_env(rollout_config(cfg), self.tokenizer, policy=self.policy)
        self.collector = build_collector(cfg, self.env, self.policy, tokenizer=self.tokenizer)
        self.weight_sync_s = 0.0  # the last weight sync's seconds
        # how the trained weights reach the engines after every update (trainers/weight_sync.py)
        self.weight_sync, self._sync_weights = choose_weight_sync(
            self.model, self.rollout_model, self.policy, self.collector, compute_dtype=models.compute_dtype,
            sharded_collector=sharded, distributed=is_distributed())
        self.advantage = build_advantage(cfg)
        self.loss = build_loss(cfg)  # before the hooks: PPO's critic trains with this loss's value term
        self.scorer = Scorer(cfg, models, self.loss.tensor_keys, self.device, self.collector)
        # the algorithm's parts (baseline episodes, critic) and options (dynamic sampling, KL in the
        # reward) around collection and advantages: every rank, on the same gathered rows
        self.hooks = AlgorithmHooks(cfg, AlgorithmParts(self.tokenizer, self.device, self.loss, self.policy,
                                                        self.collector))
        self.updater = Updater(cfg, self.model, self.loss, self.scorer)
        # the run directory (run_dir.py): a new folder of its own, or run_dir=, held by a lock
        run_dir = cfg.run_dir or (str(new_run_dir()) if is_main_process() else None)
        self.run_dir = Path(broadcast_object(run_dir))  # rank 0's folder
        self.lock = RunDirLock(self.run_dir).acquire() if is_main_process() else None
        self.signals = StopSignals()  # SIGINT / SIGTERM: stop at the end of an iteration (train)
        self.metrics = MetricsLog(cfg, self.run_dir)
        try:  # the checkpoint to resume from, checked; a used run_dir without resume= refused
            self.checkpoints = Checkpointer(cfg, self.run_dir, self.model, self.updater.optimizer, self.collector,
                                            self.hooks, self.metrics, self.reference)
        except BaseException:
            self.close()
            raise
        self.iteration, self._faults_seen = 0, 0  # _faults_seen: entries of the env's fault_log already reported

    @property
    def history(self) -> list[dict]:
        """The records logged so far, one per iteration (:attr:`MetricsLog.history`)."""
        return self.metrics.history

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict:
        """Runs the iterations (every rank under torchrun; rank 0 alone logs and plots);
        returns the run summary on rank 0 (``{}`` on the other ranks)."""
        self.signals.install()  # SIGINT / SIGTERM stop the run at the end of an iteration (rank 0 decides)
        if is_main_process():
            self.metrics.open_views()  # TensorBoard and W&B
        t_start = time.perf_counter()
        summary: dict = {"run_dir": str(self.run_dir), "env": self.cfg.env.name, "algorithm": self.cfg.algorithm.name}
        start = self._start(summary)  # resume, or the warm start
        try:
            for it in range(start, self.cfg.iterations):
                self.iteration = it
                record = self.iterate()
                if is_main_process():
                    self.metrics.log(record)
                self.checkpoints.periodic(it)
                self.checkpoints.stop_if_signalled(self.signals, it)  # a checkpoint, then RunInterrupted
        except Exception as err:  # a signal (RunInterrupted) or an error: one line on what the run kept
            if is_main_process():
                self.metrics.stopped(err, self.iteration, self.checkpoints.last_checkpoint)
            self.close()
            raise
        return self._finish(summary, t_start)

    def iterate(self) -> dict:
        """Iteration :attr:`iteration` of the module docstring; returns its record of metrics."""
        cfg, it, t0 = self.cfg, self.iteration, time.perf_counter()
        record: dict = {"iteration": it}
        if it == 0 or (cfg.eval_every and it % cfg.eval_every == 0):
            record.update(self.evaluate())
            self.metrics.evals.append((it, record["eval_success"]))
        rows, collected = self.collect_rows()
        record.update(collected)
        if rows is not None:
            record.update(self.update(rows))
        if is_main_process():
            stats = self.collector.stats
            record.update(env_steps=stats["env_steps"],  # rows collected (with fault_rows_dropped: none lost)
                          env_steps_per_s=stats["env_steps_per_s"], tokens_per_s=stats["tokens_per_s"],
                          generated_tokens=stats["generated_tokens"], iteration_s=time.perf_counter() - t0,
                          prompt_budget_truncations=stats.get("prompt_budget_truncations", 0),
                          peak_rss_gb=peak_rss_gb())  # this process's (rank 0's) largest resident memory so far
        return record

    def collect_rows(self) -> tuple[TensorDictBase | None, dict]:
        """This iteration's training rows, scored and with their advantages, on every rank; and their
        metrics. Every rank collects its share of the groups and receives the others' rows
        (:meth:`AlgorithmHooks.collect <torchrl_agent.trainers.algorithms.AlgorithmHooks.collect>`), then
        works on the same rows. ``None`` rows: every episode of the batch faulted, no update this iteration."""
        rows, sampling = self.hooks.collect(self.collector)
        rows, faults = drop_faulted(rows)
        if faults["env_faults"]:
            log = getattr(getattr(self.env, "base_env", self.env), "fault_log", [])
            reasons, self._faults_seen = [r.splitlines()[0] for r in log[self._faults_seen:]], len(log)
            logger.warning("iteration %d: %d episode(s) ended by a fault, left out of training (%d rows, %d groups "
                           "dropped); reasons: %s", self.iteration, faults["env_faults"], faults["fault_rows_dropped"],
                           faults["fault_groups_dropped"], reasons[-3:])
        metrics = {**faults, **sampling}
        if rows is None:
            return None, metrics
        self.policy.release_memory()  # collection is over: free the engine's memory (rollout.sleep_mode)
        self.scorer.score(rows)  # old (and reference) log-probs, written into the rows once
        # the advantages (+ KL in the reward, PPO's critic update)
        rows, prepared = self.hooks.prepare(rows, self.advantage, self.iteration, self.loss.tensor_keys)
        metrics.update(episode_metrics(rows, self.policy.max_new_tokens), **prepared)
        return rows, metrics

    def update(self, rows: TensorDictBase) -> dict[str, float]:
        """:meth:`Updater.update <torchrl_agent.trainers.update.Updater.update>` on the rows (scored
        first if they were not: rows not from :meth:`collect_rows`), then :meth:`sync_weights`;
        returns the update's metrics."""
        if self.loss.tensor_keys.old_log_prob not in rows.keys():
            self.policy.release_memory()
            self.scorer.score(rows)
        metrics = self.updater.update(rows, self.iteration)
        self.sync_weights()
        return {**metrics, "weight_sync_s": self.weight_sync_s}

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
        return {f"eval_{k}": v for k, v in episode_metrics(rows, self.eval_policy.max_new_tokens).items()}

    def warm_start(self) -> dict[str, float]:
        """Supervised steps on expert responses (:func:`~torchrl_agent.trainers.warm_start.warm_start`)."""
        from torchrl_agent.trainers.warm_start import warm_start

        return warm_start(self.cfg, self.tokenizer, self.scorer.actor)

    # ------------------------------------------------------------------ start, stop, checkpoints
    def _start(self, summary: dict) -> int:
        """The first iteration: after the checkpoint resumed from, or 0 (after the warm start, its
        metrics into ``summary``); ``metrics.jsonl`` opened on rank 0 with the records kept."""
        main, start, resume = is_main_process(), 0, self.checkpoints.resume_path
        if resume is not None:
            self.load_checkpoint(resume)
            start = self.iteration + 1
            if main:
                logger.info("resumed from %s at iteration %d", resume, start)
        if main:
            self.metrics.open(keep_through=start - 1)
        if resume is None and self.cfg.warm_start.steps > 0:
            success = self.evaluate()["eval_success"]  # every rank plays its share of the panel
            if main:  # the untrained policy's held-out success, plotted at iteration -1
                self.metrics.evals.append((-1, success))
            summary.update(self.warm_start())
            self.sync_weights()
            if self.reference is not None:  # the KL term anchors the warm-started policy, not the untrained one
                load_full_state_dict(self.reference, full_state_dict(self.model))
                self.checkpoints.reference_anchored = True  # so each checkpoint keeps it for a resume
            if main:
                logger.info("warm start: %s", {k: summary[k] for k in ("warm_start_loss", "warm_start_steps")})
        return start

    def _finish(self, summary: dict, t_start: float) -> dict:
        """After the last iteration: ``last.pt``, the final evaluation, and on rank 0 its record, the
        summary and the plot."""
        cfg = self.cfg
        try:
            self.save_checkpoint(self.run_dir / "checkpoints" / "last.pt")
        except CheckpointError as err:  # training is done: the final evaluation and the summary still come
            logger.error("%s", err)
            summary["checkpoint_error"] = str(err)
        if cfg.collector.kind != "step":
            self.collector.shutdown()  # its processes / actors (close() would too: free them before the evaluation)
        final = {"iteration": cfg.iterations, **self.evaluate()}
        if is_main_process():
            self.metrics.log_final(final)
            summary.update(iterations=cfg.iterations, **self.metrics.summary(),
                           wall_s=round(time.perf_counter() - t_start, 1))
            self.metrics.plot()
        self.close()
        return summary if is_main_process() else {}

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """:meth:`Checkpointer.save <torchrl_agent.trainers.checkpointer.Checkpointer.save>` after :attr:`iteration`."""
        return self.checkpoints.save(self.iteration, path)

    def load_checkpoint(self, path: str | Path) -> None:
        """Continue from checkpoint ``path`` (:meth:`~torchrl_agent.trainers.checkpointer.Checkpointer.load`)."""
        self.iteration = self.checkpoints.load(path, self.sync_weights)

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

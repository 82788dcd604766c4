"""A run's checkpoints (:class:`Checkpointer`): what one holds, when one is written, and where a
run resumes from. The file format (atomic writes, checksums, shards, ``verify``) is
:mod:`.checkpointing`'s; the run folder's rules (refusing a used folder, the metrics kept in step)
are :mod:`.run_dir`'s.

A checkpoint holds everything the next iteration depends on: the weights and the optimizer state,
the KL reference's weights when they are not the loaded model's (after the warm start: the
warm-started policy), the iteration, the collector's position in its seed stream, the algorithm's state (PPO's critic,
the KL controller, ReMax's seed stream), the RNG states, the held-out successes, and the count and
digest of the metrics records (kept once, in ``metrics.jsonl``).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

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
    start_shards,
    write_checkpoint,
)
from torchrl_agent.trainers.distributed import broadcast_object, is_distributed, is_main_process
from torchrl_agent.trainers.loggers import MetricsLog
from torchrl_agent.trainers.run_dir import StopSignals, check_run_dir, checkpoint_history, records_digest

__all__ = ["Checkpointer"]

logger = logging.getLogger("torchrl_agent")


class Checkpointer:
    """Saves and loads a run's checkpoints in ``RUN_DIR/checkpoints`` (every rank calls it under
    torchrun: each writes its weight shards, rank 0 the file).

    Built when the run starts: it finds the checkpoint to resume from (``resume=``: a file, a run
    directory, or ``auto``), read and verified, its model and experiment checked against this one,
    and refuses a ``run_dir`` that already holds a run when ``resume=`` is not set
    (:func:`~torchrl_agent.trainers.run_dir.check_run_dir`).

    Args:
        cfg: the run's :class:`~torchrl_agent.trainers.config.TrainConfig`.
        run_dir: the run directory.
        model, optimizer: the trained policy and its optimizer.
        collector: the training collector (its ``state_dict``: the position in its seed stream).
        hooks: the algorithm's :class:`~torchrl_agent.trainers.algorithms.AlgorithmHooks` (their ``state_dict``).
        metrics: the run's :class:`~torchrl_agent.trainers.loggers.MetricsLog` (history and evaluations).
        reference: the KL reference model, if the run has one.

    Attributes:
        resume_path: the checkpoint the run continues from (``None``: a new run).
        last_checkpoint: the newest checkpoint written (or resumed from).
        reference_anchored: the reference is not the model ``model.name`` loads (the warm start set it
            to the warm-started policy): its weights go into every checkpoint, and a resume restores them.
    """

    def __init__(self, cfg, run_dir: Path, model, optimizer, collector, hooks, metrics: MetricsLog,
                 reference=None) -> None:
        self.cfg, self.run_dir, self.model, self.optimizer = cfg, run_dir, model, optimizer
        self.collector, self.hooks, self.metrics, self.reference = collector, hooks, metrics, reference
        self.reference_anchored = False
        self.pending = None  # an asynchronous checkpoint being written: (ShardWrite, rank 0's state, path)
        self.last_checkpoint: Path | None = None
        self._resume_state = None
        path = None
        if is_main_process():
            path, self._resume_state = check_run_dir(run_dir, cfg.resume, cfg.checkpoint_every)
            if self._resume_state is not None:  # the same model, then the same experiment (one line naming the keys)
                check_model_state(model_shapes(self._resume_state), self._shapes(), path, self._resume_state.get("config"))
                check_resume_config(self._resume_state.get("config"), dataclasses.asdict(cfg), path)
            remove_unfinished(run_dir / "checkpoints")  # writes a killed run did not finish
        path = broadcast_object(None if path is None else str(path))
        self.resume_path = None if path is None else Path(path)

    def _shapes(self) -> dict:
        return {k: v.shape for k, v in self.model.state_dict().items()}

    def path(self, iteration: int) -> Path:
        """``RUN_DIR/checkpoints/iteration_NNNNN.pt``: the periodic checkpoint after ``iteration``."""
        return self.run_dir / "checkpoints" / f"iteration_{iteration:05d}.pt"

    def save(self, iteration: int, path: str | Path | None = None, asynchronous: bool = False) -> Path:
        """Saves the checkpoint after ``iteration`` at ``path`` (default: :meth:`path`), after the one
        still being written, if any (:meth:`wait`).

        Written atomically and with a checksum, as plain tensors and values that load without
        running code (:func:`~torchrl_agent.trainers.checkpointing.write_checkpoint`). Raises
        :class:`~torchrl_agent.trainers.checkpointing.CheckpointError` (nothing written, the previous
        checkpoint intact) when the weights hold NaN/inf or when the write fails (a full disk).
        ``asynchronous`` (under torchrun): the shards are written in the background
        (:func:`~torchrl_agent.trainers.checkpointing.start_shards`) and ``NAME.pt`` after them, by
        :meth:`wait`."""
        self.wait()
        path = Path(path or self.path(iteration))
        kept = f"the previous checkpoint ({self.last_checkpoint or 'none written yet'}) is intact"
        reference = self.reference if self.reference_anchored else None
        if asynchronous and is_distributed():
            write = start_shards(self.model, self.optimizer, path, kept=kept, reference=reference, asynchronous=True)
            weights = {}
        else:
            weights = save_weights(self.model, self.optimizer, path, kept=kept, reference=reference)  # torchrun: shards
            write = None
        if not is_main_process():
            self.pending = None if write is None else (write, None, path)
            return path
        history = self.metrics.history
        state = {
            **weights,  # "model" and "optimizer" (one process), or "shards" (torchrun: checkpointing.write_shards)
            "iteration": iteration, "collector": self.collector.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": plain_numpy_state()},
            # the metrics history is kept once, in metrics.jsonl: its count and digest here (run_dir.checkpoint_history)
            "history_records": len(history), "history_sha256": records_digest(history),
            "evals": [list(e) for e in self.metrics.evals], "config": dataclasses.asdict(self.cfg),
            "algorithm": self.hooks.state_dict(),  # PPO's critic, the KL controller, ReMax's seed stream
        }
        fsync_path(self.run_dir / "metrics.jsonl")  # the lines the checkpoint's history digest relies on
        if write is not None:
            self.pending = (write, state, path)
            return path
        write_checkpoint(state, path, kept=kept)
        self.last_checkpoint = path
        return path

    def wait(self) -> None:
        """Finishes the asynchronous checkpoint in flight, if any (every rank, together): its shards'
        digests and folder (:meth:`ShardWrite.result <torchrl_agent.trainers.checkpointing.ShardWrite.result>`),
        then rank 0's ``NAME.pt``. One that could not be written is reported and the run goes on."""
        if self.pending is None:
            return
        write, state, path = self.pending
        self.pending = None
        try:
            shards = write.result()
            if is_main_process():
                write_checkpoint({**state, "shards": shards}, path, kept=write.kept)
        except CheckpointError as err:
            logger.error("%s; training continues", err)
            return
        self.last_checkpoint = path

    def periodic(self, iteration: int) -> None:
        """The checkpoint after ``iteration`` every ``checkpoint_every`` iterations, the oldest pruned
        to ``checkpoint_keep``. One that cannot be written is reported and the run goes on (the next
        one is tried again; the final ``last.pt`` raises)."""
        if not (self.cfg.checkpoint_every and (iteration + 1) % self.cfg.checkpoint_every == 0):
            return
        try:
            self.save(iteration, asynchronous=self.cfg.checkpoint_async)
        except CheckpointError as err:
            logger.error("%s; training continues", err)
            return
        if self.cfg.checkpoint_keep and is_main_process():  # an evaluation at iteration i scores checkpoint i - 1
            prune_checkpoints(self.run_dir / "checkpoints", self.cfg.checkpoint_keep,
                              {i - 1: s for i, s in self.metrics.evals})

    def stop_if_signalled(self, signals: StopSignals, iteration: int) -> None:
        """After ``iteration``: if SIGINT / SIGTERM came (to rank 0: ``signals``), every rank saves a
        checkpoint of it (unless the periodic one just did) and raises
        :class:`~torchrl_agent.trainers.run_dir.RunInterrupted`."""
        signum = signals.requested if is_main_process() else None
        if is_distributed():
            signum = broadcast_object(signum)
        if signum is None:
            return
        signals.requested = signum
        self.wait()
        done = self.path(iteration)
        if self.last_checkpoint != done:
            self.save(iteration, done)
        raise signals.stop_message(self.run_dir, done, iteration)

    def load(self, path: str | Path, sync_weights: Callable[[], None]) -> int:
        """Continues from checkpoint ``path`` (read and verified once when the run started, or now:
        :func:`~torchrl_agent.trainers.checkpointing.read_checkpoint`; no code of the file runs):
        the weights (a checkpoint of any number of ranks), handed to the engines by ``sync_weights``,
        then every rank's collector and algorithm hooks at rank 0's place, and on rank 0 the RNG
        states and the metrics. Returns the checkpoint's iteration."""
        state = {}
        if is_main_process():
            state = self._resume_state if path == self.resume_path and self._resume_state else read_checkpoint(path)
            self._resume_state = None
            check_model_state(model_shapes(state), self._shapes(), path, state.get("config"))
        self.reference_anchored = load_weights(self.model, self.optimizer, path, state, self.reference)
        sync_weights()
        iteration = broadcast_object(state.get("iteration"))
        self.collector.load_state_dict(broadcast_object(state.get("collector")))
        self.hooks.load_state_dict(broadcast_object(state.get("algorithm", {})))
        if not is_main_process():
            return iteration
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(numpy_state(state["rng"]["numpy"]))
        self.metrics.history, self.metrics.evals = checkpoint_history(path, state), [tuple(e) for e in state["evals"]]
        self.last_checkpoint = Path(path)
        return iteration

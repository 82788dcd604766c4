"""Where a run's metrics go: ``metrics.jsonl`` (strict JSON, one line per iteration), TensorBoard,
Weights & Biases, the console line, and the learning-curve plot (``learning_curve.png``);
:class:`MetricsLog` holds a run's records and writes them there."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from pathlib import Path

from torchrl_agent.trainers.run_dir import (
    GuardedSink,
    RunInterrupted,
    metrics_iterations,
    open_metrics,
    open_tensorboard,
)

__all__ = ["CONSOLE_KEYS", "FALL_KEYS", "MetricsLog", "beyond_chance", "console_line", "finite_record", "init_wandb",
           "peak_rss_gb", "plot_learning_curve", "sharp_fall", "write_record"]

logger = logging.getLogger("torchrl_agent")

#: the metrics shown on the console line of an iteration
CONSOLE_KEYS = ("iteration", "success", "episode_reward", "action_valid", "loss", "tokens_per_s", "eval_success",
                "iteration_s")

#: training metrics watched for a fall by more than half in one iteration (the answer format lost,
#: a solved policy thrown off): :func:`sharp_fall`
FALL_KEYS = ("action_valid", "success")


def beyond_chance(before: float, after: float, n_before: int | None, n_after: int | None, z: float = 2.0) -> bool:
    """Whether a share's fall from ``before`` (of ``n_before`` independent draws) to ``after`` (of
    ``n_after``) is larger than two batches of one policy make by chance: the two-proportion z
    statistic ``(before - after) / sqrt(p (1 - p) (1 / n_before + 1 / n_after))``, ``p`` the pooled
    share, above ``z``. Without both counts every fall counts."""
    if not n_before or not n_after:
        return True
    pooled = (before * n_before + after * n_after) / (n_before + n_after)
    spread = math.sqrt(pooled * (1 - pooled) * (1 / n_before + 1 / n_after))
    return spread > 0 and (before - after) / spread > z


def sharp_fall(previous: dict | None, record: dict, floor: float = 0.1) -> str | None:
    """One line naming the :data:`FALL_KEYS` that fell by more than half from ``previous`` (the last
    iteration's record) to ``record``, counting only falls from at least ``floor`` and beyond chance
    (:func:`beyond_chance` over the records' ``groups``: a group's games share one game and mostly win
    or lose together, so the groups, not the episodes or steps, are a batch's independent draws;
    without ``groups`` every fall counts); ``None`` if none. The update between the two is
    ``previous``'s, so the line quotes its ``approx_kl_max``."""
    if not previous:
        return None
    falls = [f"{k} {previous[k]:.2f} -> {record[k]:.2f}" for k in FALL_KEYS
             if isinstance(previous.get(k), float) and isinstance(record.get(k), float)
             and previous[k] >= floor and record[k] < previous[k] / 2
             and beyond_chance(previous[k], record[k], previous.get("groups"), record.get("groups"))]
    if not falls:
        return None
    kl = previous.get("approx_kl_max")
    moved = f" (that update's largest approx_kl: {kl:.3g})" if isinstance(kl, float) else ""
    return (f"iteration {record['iteration']}: {', '.join(falls)} after one update{moved}: the policy may have "
            f"left its answer format; algorithm.max_kl bounds how far one update moves it")


def peak_rss_gb() -> float:
    """The largest resident memory of this process so far, in GiB (``getrusage``'s ``ru_maxrss``:
    KiB on Linux, bytes on macOS). Written with every iteration's metrics (``peak_rss_gb``), so a run
    the kernel kills for memory leaves its growth behind in ``metrics.jsonl``."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**30 if sys.platform == "darwin" else 2**20), 3)


def finite_record(record: dict) -> tuple[dict, list[str]]:
    """``record`` with every non-finite float replaced by ``None`` (strict JSON), and those keys."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    return {k: (None if k in bad else v) for k, v in record.items()}, bad


def write_record(record: dict, metrics_file, writer=None, wandb_run=None) -> None:
    """One JSONL line (``record`` must be finite: :func:`finite_record`), flushed; its finite
    numbers as TensorBoard scalars and W&B values at step ``iteration`` (W&B: ``iteration + 1``)."""
    metrics_file.write(json.dumps(record, allow_nan=False) + "\n")
    metrics_file.flush()
    scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    if writer is not None:
        for k, v in scalars.items():
            writer.add_scalar(k, v, record["iteration"])
    if wandb_run is not None:
        wandb_run.log(scalars, step=record["iteration"] + 1)


def console_line(record: dict) -> str:
    """``metrics {...}``: the :data:`CONSOLE_KEYS` of ``record``, floats rounded to 4 digits."""
    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items() if k in CONSOLE_KEYS}
    return "metrics " + json.dumps(shown)


def init_wandb(cfg, run_dir: Path):
    """A Weights & Biases run when ``wandb.project`` is set and ``wandb`` is installed, else ``None``."""
    if not cfg.wandb.project:
        return None
    try:
        import wandb
    except ImportError:
        logger.warning("wandb.project is set but wandb is not installed: logging to JSONL and TensorBoard only")
        return None
    return wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, mode=cfg.wandb.mode,
                      dir=str(run_dir), config=dataclasses.asdict(cfg))


def plot_learning_curve(history: list[dict], evals: list[tuple[int, float]], path: Path, title: str) -> None:
    """Training success (``history``'s ``success``) and held-out success (``evals``: ``(iteration,
    success)``) against the iteration, written to ``path``; nothing when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is a nicety: never fail a run for it
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    train = [(h["iteration"], h["success"]) for h in history if "success" in h]
    if train:
        ax.plot(*zip(*train), label="train success")
    ax.plot(*zip(*evals), marker="o", label="held-out success")
    ax.set_xlabel("iteration")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class MetricsLog:
    """A run's metrics: every iteration's record and every held-out success, written on rank 0 to
    ``RUN_DIR/metrics.jsonl`` (the run's record), TensorBoard and W&B (views of it) and the console.

    Args:
        cfg: the run's :class:`~torchrl_agent.trainers.config.TrainConfig` (W&B's settings).
        run_dir: the run directory.

    Attributes:
        history: the records logged (:meth:`log`), one per iteration, as written.
        evals: ``(iteration, held-out success)`` of every evaluation (``-1``: the untrained policy,
            before a warm start; ``cfg.iterations``: the final one).
        nonfinite_metrics: metric values written as null so far.
        file, writer, wandb: ``metrics.jsonl`` opened for appending, TensorBoard's writer and the
            W&B run (``None`` until opened, and on ranks other than 0).
    """

    def __init__(self, cfg, run_dir: Path) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.history: list[dict] = []
        self.evals: list[tuple[int, float]] = []
        self.nonfinite_metrics = 0
        self.file = self.writer = self.wandb = None

    def open_views(self) -> None:
        """TensorBoard and W&B: views of ``metrics.jsonl``, their write errors logged once, never fatal."""
        self.writer = open_tensorboard(self.run_dir / "tensorboard")
        wandb = init_wandb(self.cfg, self.run_dir)
        self.wandb = None if wandb is None else GuardedSink("W&B", wandb)

    def open(self, keep_through: int) -> None:
        """``metrics.jsonl`` for appending, holding exactly the records of the checkpoint resumed from
        (iterations ``<= keep_through``; none for a new run), so a resumed run repeats and skips none."""
        self.file = open_metrics(self.run_dir, [h for h in self.history if h["iteration"] <= keep_through])

    def log(self, record: dict) -> None:
        """One iteration's metrics: kept in :attr:`history`, written (:func:`write_record`), shown on the console."""
        record, bad = finite_record(record)
        if bad:  # strict JSON: NaN/inf are written as null, counted and warned about
            self.nonfinite_metrics += len(bad)
            record["nonfinite_metrics"] = len(bad)
            logger.warning("iteration %d: non-finite metrics written as null: %s", record["iteration"], bad)
        fall = sharp_fall(next((h for h in reversed(self.history) if "success" in h), None), record)
        if fall:
            logger.warning("%s", fall)
        self.history.append(record)
        write_record(record, self.file, self.writer, self.wandb)
        print(console_line(record), flush=True)

    def log_final(self, record: dict) -> None:
        """The final evaluation's record (its ``iteration``: the number of iterations), logged; then
        TensorBoard's writer and ``metrics.jsonl`` closed."""
        self.evals.append((record["iteration"], record["eval_success"]))
        self.log(record)
        if self.writer is not None:
            self.writer.close()
        self.file.close()

    def stopped(self, err: Exception, iteration: int, last_checkpoint: Path | None) -> None:
        """A run stopped by ``err`` after ``iteration``: ``metrics.jsonl`` closed; unless ``err`` is a
        signal's :class:`~torchrl_agent.trainers.run_dir.RunInterrupted` (whose message says it), one
        line names the iterations the file holds and the last good checkpoint."""
        if isinstance(err, RunInterrupted):
            self.file.close()
            return
        logger.error("the run stopped at iteration %d (%s: %s); metrics through iteration %s are in %s; "
                     "last good checkpoint: %s", iteration, type(err).__name__, err,
                     max(metrics_iterations(self.run_dir), default="none"), self.run_dir / "metrics.jsonl",
                     last_checkpoint or "none (set checkpoint_every)")
        with contextlib.suppress(OSError):  # a full disk: the buffered line cannot be flushed either
            self.file.close()

    def summary(self) -> dict:
        """The held-out successes (first, last, after the warm start, the curve) and the last training success."""
        evals = self.evals
        return dict(
            eval_success_first=evals[0][1],
            eval_success_last=evals[-1][1],
            eval_success_after_warm_start=next((s for it, s in evals if it == 0), None) if self.cfg.warm_start.steps else None,
            eval_curve=evals,
            train_success_last=next((h["success"] for h in reversed(self.history) if "success" in h), None),
        )

    def plot(self) -> None:
        """``learning_curve.png`` of the history and the evaluations (not written on a full disk: a view)."""
        try:
            plot_learning_curve(self.history, self.evals, self.run_dir / "learning_curve.png",
                                f"{self.cfg.env.name} / {self.cfg.algorithm.name}")
        except OSError as err:  # a full disk: the plot is a view of metrics.jsonl
            logger.error("learning_curve.png not written (%s)", err)

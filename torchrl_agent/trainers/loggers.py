"""Where a run's metrics go: ``metrics.jsonl`` (strict JSON, one line per iteration), TensorBoard,
Weights & Biases, the console line, and the learning-curve plot (``learning_curve.png``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

__all__ = ["CONSOLE_KEYS", "FALL_KEYS", "console_line", "finite_record", "init_wandb", "plot_learning_curve",
           "sharp_fall", "write_record"]

logger = logging.getLogger("torchrl_agent")

#: the metrics shown on the console line of an iteration
CONSOLE_KEYS = ("iteration", "success", "episode_reward", "action_valid", "loss", "tokens_per_s", "eval_success",
                "iteration_s")

#: training metrics watched for a fall by more than half in one iteration (the answer format lost,
#: a solved policy thrown off): :func:`sharp_fall`
FALL_KEYS = ("action_valid", "success")


def sharp_fall(previous: dict | None, record: dict, floor: float = 0.1) -> str | None:
    """One line naming the :data:`FALL_KEYS` that fell by more than half from ``previous`` (the last
    iteration's record) to ``record``, counting only falls from at least ``floor``; ``None`` if none.
    The update between the two is ``previous``'s, so the line quotes its ``approx_kl_max``."""
    if not previous:
        return None
    falls = [f"{k} {previous[k]:.2f} -> {record[k]:.2f}" for k in FALL_KEYS
             if isinstance(previous.get(k), float) and isinstance(record.get(k), float)
             and previous[k] >= floor and record[k] < previous[k] / 2]
    if not falls:
        return None
    kl = previous.get("approx_kl_max")
    moved = f" (that update's largest approx_kl: {kl:.3g})" if isinstance(kl, float) else ""
    return (f"iteration {record['iteration']}: {', '.join(falls)} after one update{moved}: the policy may have "
            f"left its answer format; algorithm.max_kl bounds how far one update moves it")


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

"""Where a run's metrics go: ``metrics.jsonl`` (strict JSON, one line per iteration), TensorBoard,
Weights & Biases, the console line, and the learning-curve plot (``learning_curve.png``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

__all__ = ["CONSOLE_KEYS", "console_line", "finite_record", "init_wandb", "plot_learning_curve", "write_record"]

logger = logging.getLogger("torchrl_agent")

#: the metrics shown on the console line of an iteration
CONSOLE_KEYS = ("iteration", "success", "episode_reward", "action_valid", "loss", "tokens_per_s", "eval_success",
                "iteration_s")


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

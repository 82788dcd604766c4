"""The training loop, its typed config and the ``torchrl-agent`` console script.

The names below are imported on first use (PEP 562): ``torchrl-agent config`` or
``python -m torchrl_agent.trainers.checkpointing verify`` load this package without the trainer
(and without TorchRL's collectors, which import vLLM when it is installed: seconds per process).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchrl_agent.trainers.config import TrainConfig
    from torchrl_agent.trainers.trainer import Trainer, TrainingDivergedError, build_env

_LAZY = {"TrainConfig": "torchrl_agent.trainers.config", "Trainer": "torchrl_agent.trainers.trainer",
         "TrainingDivergedError": "torchrl_agent.trainers.trainer", "build_env": "torchrl_agent.trainers.trainer"}

__all__ = ["TrainConfig", "Trainer", "TrainingDivergedError", "build_env"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

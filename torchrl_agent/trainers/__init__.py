"""The training loop, its typed config and the ``torchrl-agent`` console script."""

from torchrl_agent.trainers.config import TrainConfig
from torchrl_agent.trainers.trainer import Trainer, TrainingDivergedError, build_env

__all__ = ["TrainConfig", "Trainer", "TrainingDivergedError", "build_env"]

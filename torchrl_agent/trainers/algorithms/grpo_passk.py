"""GRPO pass@k: only each group's best trajectory gets a (positive) advantage."""

from torchrl_agent.objectives import GRPOPassKAdvantage
from torchrl_agent.trainers.algorithms.registry import Algorithm, register_algorithm
from torchrl_agent.trainers.config import ConfigError


def check(cfg) -> None:
    if cfg.env.group_size < 2:
        raise ConfigError(f"env.group_size={cfg.env.group_size}: must be >= 2 for algorithm.name=grpo_passk")


GRPO_PASSK = register_algorithm(Algorithm("grpo_passk", advantage=lambda cfg: GRPOPassKAdvantage(
    invalid_penalty=cfg.algorithm.invalid_penalty, norm=cfg.algorithm.norm), check=check,
    summary="advantage to each group's best trajectory", group_relative=True))

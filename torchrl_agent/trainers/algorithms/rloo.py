"""RLOO: the episode reward minus the mean of the group's other trajectories."""

from torchrl_agent.objectives import RLOOAdvantage
from torchrl_agent.trainers.algorithms.registry import Algorithm, register_algorithm

RLOO = register_algorithm(Algorithm("rloo", advantage=lambda cfg: RLOOAdvantage(
    invalid_penalty=cfg.algorithm.invalid_penalty), summary="leave-one-out group baseline", group_relative=True))

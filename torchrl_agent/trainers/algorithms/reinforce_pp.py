"""REINFORCE++ in its two forms:

- ``reinforce_pp``: per token, the discounted return inside the response whitened over the batch's
  tokens (:class:`~torchrl_agent.objectives.ReinforcePlusPlusAdvantage`);
- ``reinforce_pp_baseline``: per row, the episode reward minus its group mean, whitened over the
  batch (:class:`~torchrl_agent.objectives.ReinforcePlusPlusBaselineAdvantage`).
"""

from torchrl_agent.objectives import ReinforcePlusPlusAdvantage, ReinforcePlusPlusBaselineAdvantage
from torchrl_agent.trainers.algorithms.registry import Algorithm, register_algorithm

REINFORCE_PP = register_algorithm(Algorithm("reinforce_pp", advantage=lambda cfg: ReinforcePlusPlusAdvantage(
    gamma=cfg.algorithm.gamma, invalid_penalty=cfg.algorithm.invalid_penalty),
    summary="token-level discounted return, whitened"))
REINFORCE_PP_BASELINE = register_algorithm(Algorithm(
    "reinforce_pp_baseline", advantage=lambda cfg: ReinforcePlusPlusBaselineAdvantage(
        invalid_penalty=cfg.algorithm.invalid_penalty), summary="group-mean baseline, whitened over the batch",
    group_relative=True))

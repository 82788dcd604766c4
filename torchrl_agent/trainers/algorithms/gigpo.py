"""GiGPO: GRPO's episode term plus ``omega`` x a step term, the discounted step return normalised
over the steps that share an anchor state (exact text, or ``similarity_threshold``-similar)."""

from torchrl_agent.objectives import GiGPOAdvantage
from torchrl_agent.trainers.algorithms.registry import Algorithm, register_algorithm


def gigpo_advantage(cfg) -> GiGPOAdvantage:
    a = cfg.algorithm
    return GiGPOAdvantage(gamma=a.gamma, omega=a.omega, invalid_penalty=a.invalid_penalty, norm=a.norm,
                          similarity_threshold=a.similarity_threshold)


GIGPO = register_algorithm(Algorithm("gigpo", advantage=gigpo_advantage, group_relative=True,
                                     summary="episode term + omega x anchor-state step term"))

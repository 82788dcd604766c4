"""HGPO (Hierarchy-of-Groups): the discounted step return normalised in history-context groups (the
anchors of the last 1 .. K+1 steps), the groups' advantages weighted by length (k+1)^alpha."""

from torchrl_agent.objectives import HGPOAdvantage
from torchrl_agent.trainers.algorithms.registry import Algorithm, register_algorithm


def history_length(cfg) -> int:
    """``algorithm.history_length``, or the memory's ``k`` (0 without a memory): the reference's K is
    the env's ``history_length``, the number of past steps its prompt shows."""
    if cfg.algorithm.history_length is not None:
        return cfg.algorithm.history_length
    return 0 if cfg.memory.kind == "none" else cfg.memory.k


def hgpo_advantage(cfg) -> HGPOAdvantage:
    a = cfg.algorithm
    return HGPOAdvantage(history_length=history_length(cfg), gamma=a.gamma, alpha=a.length_alpha,
                         base_group=a.base_group, invalid_penalty=a.invalid_penalty, norm=a.norm)


HGPO = register_algorithm(Algorithm("hgpo", advantage=hgpo_advantage,
                                    summary="step return normalised in history-context groups of lengths 1..K+1"))

"""GraphGPO: a state graph per group from every row; the step return 10 * gamma^d(next state), d the hop
distance to success, normalised over the steps that share an anchor state, plus the episode term."""

from torchrl_agent.objectives import GraphGPOAdvantage
from torchrl_agent.trainers.algorithms.registry import Algorithm, register_algorithm
from torchrl_agent.trainers.config import ConfigError


def check(cfg) -> None:
    if cfg.algorithm.gamma <= 0:
        raise ConfigError(f"algorithm.gamma={cfg.algorithm.gamma}: must be > 0 for algorithm.name=graphgpo "
                          "(the step return is 10 * gamma^distance)")


def graphgpo_advantage(cfg) -> GraphGPOAdvantage:
    a = cfg.algorithm
    return GraphGPOAdvantage(gamma=a.gamma, step_weight=a.omega, episode_weight=a.episode_weight,
                             normalize_distance=a.normalize_distance, similarity_threshold=a.similarity_threshold,
                             invalid_penalty=a.invalid_penalty, norm=a.norm)


GRAPHGPO = register_algorithm(Algorithm("graphgpo", advantage=graphgpo_advantage, check=check,
                                        summary="episode term + omega x hop-distance-to-success step term"))

"""GRPO and the algorithms that are GRPO's estimator with other settings (their YAMLs):

- ``grpo``: the episode reward normalised in its group, ``(R - mean_group) / std_group``;
- ``dapo``: clip-higher (0.2 / 0.28) and dynamic sampling (``configs/algorithm/dapo.yaml``);
- ``gspo``: a sequence-level ratio and tight clipping (``configs/algorithm/gspo.yaml``).
"""

from torchrl_agent.objectives import GRPOAdvantage
from torchrl_agent.trainers.algorithms.registry import Algorithm, register_algorithm


def grpo_advantage(cfg) -> GRPOAdvantage:
    a = cfg.algorithm
    return GRPOAdvantage(invalid_penalty=a.invalid_penalty, norm=a.norm)


GRPO = register_algorithm(Algorithm("grpo", advantage=grpo_advantage, group_relative=True,
                                    summary="group-normalised episode reward"))
DAPO = register_algorithm(Algorithm("dapo", advantage=grpo_advantage, group_relative=True,
                                    summary="GRPO's advantage, clip-higher, dynamic sampling"))
GSPO = register_algorithm(Algorithm("gspo", advantage=grpo_advantage, group_relative=True,
                                    summary="GRPO's advantage, a sequence-level importance ratio"))

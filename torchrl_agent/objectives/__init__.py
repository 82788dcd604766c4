"""Advantage estimators and losses for LLM agents, mirroring ``torchrl.objectives``.

- :mod:`.functional`: vectorised math (GiGPO, GRPO, RLOO, REINFORCE++, similarity anchors);
- :mod:`.advantages`: TensorDict modules / replay-buffer transforms over it;
- :mod:`.clip_loss`: :class:`ClipPolicyLoss` (clip-higher, dual clip, KL k3, entropy, GSPO);
- :mod:`.ppo`: :class:`PPOLoss` and per-token GAE;
- :mod:`.dapo`: DAPO dynamic sampling.
"""

from torchrl_agent.objectives.advantages import (
    GiGPOAdvantage,
    GRPOAdvantage,
    ReinforcePlusPlusAdvantage,
    RLOOAdvantage,
)
from torchrl_agent.objectives.clip_loss import AGGREGATIONS, ClipPolicyLoss, aggregate
from torchrl_agent.objectives.dapo import DynamicSamplingAccumulator, DynamicSamplingFilter, informative_group_mask
from torchrl_agent.objectives.functional import (
    discounted_step_returns,
    episode_scores,
    gigpo_advantage,
    group_normalize,
    grpo_advantage,
    reinforce_pp_advantage,
    rloo_advantage,
    similarity_anchor_ids,
)
from torchrl_agent.objectives.ppo import PPOLoss, masked_whiten, token_gae

__all__ = [
    "AGGREGATIONS",
    "ClipPolicyLoss",
    "DynamicSamplingAccumulator",
    "DynamicSamplingFilter",
    "GiGPOAdvantage",
    "GRPOAdvantage",
    "PPOLoss",
    "RLOOAdvantage",
    "ReinforcePlusPlusAdvantage",
    "aggregate",
    "discounted_step_returns",
    "episode_scores",
    "gigpo_advantage",
    "grpo_advantage",
    "group_normalize",
    "informative_group_mask",
    "masked_whiten",
    "reinforce_pp_advantage",
    "rloo_advantage",
    "similarity_anchor_ids",
    "token_gae",
]

"""Advantage estimators and losses for LLM agents, mirroring ``torchrl.objectives``.

Every formula, option and its mapping to the reference's options: ``docs/algorithms.md``.

- :mod:`.functional`: vectorised row-level math (GiGPO, HGPO, GraphGPO, GRPO, GRPO pass@k, RLOO,
  REINFORCE++-baseline, ReMax, similarity anchors);
- :mod:`.advantages`: TensorDict modules / replay-buffer transforms over it (and the
  token-level REINFORCE++);
- :mod:`.clip_loss`: :class:`ClipPolicyLoss` (clip-higher, dual clip, KL k1/k2/k3/abs, entropy, GSPO);
- :mod:`.ppo`: :class:`PPOLoss`, per-token GAE, token REINFORCE++ and the clipped value loss;
- :mod:`.kl`: KL in the reward with a fixed or adaptive controller;
- :mod:`.dapo`: DAPO dynamic sampling.
"""

from torchrl_agent.objectives.advantages import (
    GiGPOAdvantage,
    GraphGPOAdvantage,
    GRPOAdvantage,
    GRPOPassKAdvantage,
    HGPOAdvantage,
    ReinforcePlusPlusAdvantage,
    ReinforcePlusPlusBaselineAdvantage,
    ReMaxAdvantage,
    RLOOAdvantage,
)
from torchrl_agent.objectives.clip_loss import AGGREGATIONS, KL_TYPES, ClipPolicyLoss, aggregate, kl_estimate
from torchrl_agent.objectives.dapo import DynamicSamplingAccumulator, DynamicSamplingFilter, informative_group_mask
from torchrl_agent.objectives.functional import (
    discounted_step_returns,
    episode_scores,
    gigpo_advantage,
    graph_state_ids,
    graphgpo_advantage,
    group_normalize,
    grpo_advantage,
    grpo_passk_advantage,
    hgpo_advantage,
    reinforce_pp_baseline_advantage,
    remax_advantage,
    rloo_advantage,
    similarity_anchor_ids,
)
from torchrl_agent.objectives.kl import AdaptiveKLController, FixedKLController, kl_in_reward
from torchrl_agent.objectives.ppo import PPOLoss, clipped_value_loss, masked_whiten, token_gae, token_reinforce_pp

__all__ = [
    "AGGREGATIONS",
    "KL_TYPES",
    "AdaptiveKLController",
    "ClipPolicyLoss",
    "DynamicSamplingAccumulator",
    "DynamicSamplingFilter",
    "FixedKLController",
    "GiGPOAdvantage",
    "GraphGPOAdvantage",
    "GRPOAdvantage",
    "GRPOPassKAdvantage",
    "HGPOAdvantage",
    "PPOLoss",
    "RLOOAdvantage",
    "ReMaxAdvantage",
    "ReinforcePlusPlusAdvantage",
    "ReinforcePlusPlusBaselineAdvantage",
    "aggregate",
    "clipped_value_loss",
    "discounted_step_returns",
    "episode_scores",
    "gigpo_advantage",
    "graph_state_ids",
    "graphgpo_advantage",
    "grpo_advantage",
    "grpo_passk_advantage",
    "group_normalize",
    "hgpo_advantage",
    "informative_group_mask",
    "kl_estimate",
    "kl_in_reward",
    "masked_whiten",
    "reinforce_pp_baseline_advantage",
    "remax_advantage",
    "rloo_advantage",
    "similarity_anchor_ids",
    "token_gae",
    "token_reinforce_pp",
]

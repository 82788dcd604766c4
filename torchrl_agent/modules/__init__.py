"""LLM policies (rollout engines) and the trainer-side log-prob module."""

from torchrl_agent.modules.policy import Generation, LLMPolicy
from torchrl_agent.modules.transformers_policy import ResponseLogProbs, TransformersPolicy, pad_rows

__all__ = ["Generation", "LLMPolicy", "ResponseLogProbs", "TransformersPolicy", "pad_rows"]

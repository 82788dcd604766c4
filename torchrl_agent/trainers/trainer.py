"""The training loop: collect -> advantages -> old/reference log-probs -> clipped loss -> AdamW.

One iteration::

    rows = collector.collect()                      # one row per env step, complete groups
    rows = advantage(rows)                          # GRPO / GiGPO / RLOO / REINFORCE++ per row
    old_log_prob, ref_log_prob = recompute(rows)    # trainer-side, no grad
    for epoch, minibatch of rows:
        loss = ClipPolicyLoss(log_prob(minibatch), ...)  -> backward -> clip -> AdamW step
    policy.update_weights(...)                      # engines with their own weights
    evaluate on the held-out panel every `eval_every` iterations

Metrics go to ``metrics.jsonl`` and TensorBoard in the run directory, one line per iteration to
the console; :meth:`Trainer.train` returns the run summary printed as the last line by the CLI.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs import Compose, TransformedEnv

from torchrl_agent.collectors import StepCollector, episode_metrics
from torchrl_agent.envs import make_env
from torchrl_agent.envs.transforms import (
    PROMPT_TEMPLATES,
    ActionProjection,
    FullHistory,
    NoHistory,
    PromptTransform,
    SummaryMemory,
    WindowMemory,
)
from torchrl_agent.models import load_model, model_path
from torchrl_agent.modules import ResponseLogProbs, TransformersPolicy
from torchrl_agent.objectives import (
    ClipPolicyLoss,
    GiGPOAdvantage,
    GRPOAdvantage,
    ReinforcePlusPlusAdvantage,
    RLOOAdvantage,
)
from torchrl_agent.trainers.config import TrainConfig
from torchrl_agent.trainers.distributed import (
    barrier,
    broadcast_object,
    clip_grad_norm,
    distributed_loss_scale,
    full_optimizer_state_dict,
    full_state_dict,
    init_distributed,
    is_distributed,
    is_main_process,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    reduce_mean,
    shard_indices,
    shard_model,
)

__all__ = ["Trainer", "build_env"]

logger = logging.getLogger("torchrl_agent")


def build_memory(cfg, policy=None):
    """The memory transform of a ``memory`` config; ``policy`` summarises for ``kind=summary``."""
    if cfg.kind == "summary":
        return SummaryMemory(cfg.k, summarizer=policy, max_summary_tokens=cfg.max_summary_tokens,
                             summarize_every=cfg.summarize_every)
    if cfg.kind == "window":
        return WindowMemory(cfg.k)
    if cfg.kind == "full":
        return FullHistory()
    if cfg.kind == "none":
        return NoHistory()
    raise ValueError(f"memory.kind: unknown memory {cfg.kind!r}; use window, full, none or summary")


def build_env(cfg: TrainConfig, tokenizer, *, split: str = "train", policy=None) -> TransformedEnv:
    """The environment with its memory, prompt and projection transforms, per the config."""
    e = cfg.env
    kwargs = dict(e.kwargs)
    if e.max_steps is not None:
        kwargs["max_steps"] = e.max_steps
    if split == "train":
        base = make_env(e.name, num_groups=e.num_groups, group_size=e.group_size, seed=cfg.seed, **kwargs)
    else:
        base = make_env(e.name, num_groups=e.eval_episodes, group_size=1, seed=cfg.seed, split="eval", **kwargs)
    template = e.template or (e.name if e.name in PROMPT_TEMPLATES else "default")
    transforms = Compose(build_memory(cfg.memory, policy),
                         PromptTransform(tokenizer, template, max_prompt_tokens=cfg.memory.max_prompt_tokens),
                         ActionProjection(e.action_format))
    return TransformedEnv(base, transforms)


def apply_lora(model, cfg):
    """Wrap ``model`` with LoRA adapters (``peft``) per the model config."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("model.lora_rank > 0 needs peft: pip install 'torchrl-agent[lora]'") from err
    targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else [t.strip() for t in cfg.lora_targets.split(",")]
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=targets,
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def build_policy(cfg, model, tokenizer):
    """The rollout engine of ``rollout.engine``: ``transformers`` (shares ``model``) or ``vllm``
    (its own copy of the weights, refreshed by ``update_weights`` after every update)."""
    r = cfg.rollout
    if r.engine == "transformers":
        return TransformersPolicy(model, tokenizer, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                  batch_size=r.batch_size)
    if r.engine == "vllm":
        from torchrl_agent.modules.vllm_policy import VLLMPolicy

        if cfg.model.lora_rank > 0:
            raise ValueError("rollout.engine=vllm with model.lora_rank > 0 is not supported yet")
        return VLLMPolicy(model_path(cfg.model), tokenizer, dtype=cfg.model.dtype, seed=cfg.seed,
                          max_new_tokens=r.max_new_tokens, temperature=r.temperature, max_num_seqs=r.batch_size)
    raise ValueError(f"rollout.engine: unknown engine {r.engine!r}; use transformers or vllm")


def build_advantage(cfg):
    a = cfg.algorithm
    if a.name == "grpo":
        return GRPOAdvantage(invalid_penalty=a.invalid_penalty, norm=a.norm)
    if a.name == "gigpo":
        return GiGPOAdvantage(gamma=a.gamma, omega=a.omega, invalid_penalty=a.invalid_penalty, norm=a.norm)
    if a.name == "rloo":
        return RLOOAdvantage(invalid_penalty=a.invalid_penalty)
    if a.name == "reinforce_pp":
        return ReinforcePlusPlusAdvantage(invalid_penalty=a.invalid_penalty)
    raise ValueError(f"algorithm.name: unknown algorithm {a.name!r}; use grpo, gigpo, rloo or reinforce_pp")


def _pad(values: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(values), width, device=values[0].device if values else None)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out


class Trainer:
    """Runs the loop of the module docstring for a :class:`TrainConfig`."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        # under torchrun: one process per device, rank 0 collects and logs, all ranks train (FSDP2)
        self.rank, self.world_size, self.device = init_distributed(cfg.device)
        torch.manual_seed(cfg.seed)
        if is_main_process():
            model_path(cfg.model)  # build (and cache) the tiny model once, before the other ranks read it
        barrier()
        self.model, self.tokenizer = load_model(cfg.model)
        self.model.to(self.device).train()
        a = cfg.algorithm
        self.reference = None
        if cfg.model.lora_rank > 0:
            # LoRA: only the adapters train; the reference policy is the base model with the
            # adapters disabled (no second copy of the weights)
            self.model = apply_lora(self.model, cfg.model)
        elif a.kl_coef > 0:  # the frozen initial policy (a full copy on every rank)
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        # the rollout engine's weights: the training model itself in a single process; under torchrun
        # rank 0's own full copy (a forward of the sharded model is collective), synced after updates
        self.rollout_model = self.model
        if is_distributed():
            self.rollout_model = copy.deepcopy(self.model).eval() if is_main_process() else None
        self.model = shard_model(self.model)  # no-op in a single process
        r = cfg.rollout
        self.policy = self.eval_policy = self.env = self.collector = None
        if is_main_process():
            self.policy = build_policy(cfg, self.rollout_model, self.tokenizer)
            self.eval_policy = copy.copy(self.policy)  # the same engine, sampled at the evaluation temperature
            self.eval_policy.temperature = r.eval_temperature
            self.env = build_env(cfg, self.tokenizer, policy=self.policy)
            self.collector = StepCollector(self.env, self.policy, seed=cfg.seed, lockstep=r.lockstep,
                                           progress=cfg.progress)
        self.advantage = build_advantage(cfg)
        self.actor = ResponseLogProbs(self.model, self.tokenizer.pad_token_id, temperature=r.temperature)
        self.loss = ClipPolicyLoss(eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip,
                                   aggregation=a.aggregation, kl_coef=a.kl_coef, entropy_coef=a.entropy_coef,
                                   ratio=a.ratio)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(cfg.run_dir or f"runs/{stamp}")
        self.run_dir = Path(broadcast_object(str(self.run_dir)))  # rank 0's timestamp
        if is_main_process():
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.iteration = 0
        self.history: list[dict] = []
        self.evals: list[tuple[int, float]] = []  # (iteration, held-out success)

    # ------------------------------------------------------------------ pieces
    @torch.no_grad()
    def recompute(self, model, rows: TensorDictBase, chunk: int = 64) -> list[torch.Tensor]:
        """Per-row response log-probs under ``model`` (a list of 1-D tensors)."""
        module = ResponseLogProbs(model, self.tokenizer.pad_token_id, temperature=self.actor.temperature,
                                  with_entropy=False)
        out = []
        for start in range(0, rows.batch_size[0], chunk):
            part = module(rows[start:start + chunk])
            lengths = part["mask"].sum(-1)
            out += [lp[: int(n)] for lp, n in zip(part["log_prob"], lengths)]
        return out

    def update(self, rows: TensorDictBase) -> dict[str, float]:
        """Epochs of clipped-loss mini-batch steps over the rows; returns averaged loss metrics."""
        a = self.cfg.algorithm
        n = rows.batch_size[0]
        old = self.recompute(self.model, rows)
        consistency = self.logprob_consistency(rows, old)
        ref = None
        if a.kl_coef > 0 and self.cfg.model.lora_rank > 0:
            with self.model.disable_adapter():
                ref = self.recompute(self.model, rows)
        elif self.reference is not None:
            ref = self.recompute(self.reference, rows)
        advantage = rows["advantage"].reshape(-1).float()
        generator = torch.Generator().manual_seed(self.cfg.seed * 7919 + self.iteration)
        totals: dict[str, float] = {}
        steps = 0
        self.model.train()
        for _ in range(a.epochs):
            order = torch.randperm(n, generator=generator)
            for start in range(0, n, a.minibatch_size):
                # this rank's rows of the mini-batch (all of them in a single process)
                idx, active = shard_indices(order[start:start + a.minibatch_size])
                mb = self.actor(rows[idx])
                width = mb["log_prob"].shape[-1]
                mask = mb["mask"] & active
                batch = TensorDict({
                    "log_prob": mb["log_prob"], "entropy": mb["entropy"], "mask": mask,
                    "old_log_prob": _pad([old[i] for i in idx], width),
                    "advantage": advantage[idx].to(mask.device),
                }, batch_size=[len(idx)])
                if ref is not None:
                    batch["ref_log_prob"] = _pad([ref[i] for i in idx], width)
                losses = self.loss(batch)
                total = sum(v for k, v in losses.items() if k.startswith("loss_"))
                # exact data parallelism: the averaged gradient is the whole mini-batch's (1 in one process)
                scale = distributed_loss_scale(mask, a.aggregation)
                self.optimizer.zero_grad(set_to_none=True)
                (scale * total).backward()
                grad_norm = clip_grad_norm(self.model.parameters(), a.grad_clip)
                self.optimizer.step()
                steps += 1
                for k, v in losses.items():
                    totals[k] = totals.get(k, 0.0) + reduce_mean(scale * v)
                totals["grad_norm"] = totals.get("grad_norm", 0.0) + float(grad_norm)
                totals["loss"] = totals.get("loss", 0.0) + reduce_mean(scale * total.detach())
        self.sync_weights()
        return {**{k: v / max(steps, 1) for k, v in totals.items()}, **consistency}

    def logprob_consistency(self, rows: TensorDictBase, recomputed: list[torch.Tensor]) -> dict[str, float]:
        """The engine's sampling log-probs against the trainer's recomputation of the same tokens
        (before any update): they should agree; a gap means the engine samples from another
        distribution than the one trained (stale weights, dtype, sampling settings)."""
        sampled = rows.get(("log_probs", "response"), as_padded_tensor=True)
        width = sampled.shape[-1]
        mask = _pad([torch.ones(len(r)) for r in recomputed], width).bool()
        diff = (sampled.to(mask.device) - _pad(recomputed, width).to(mask.device)).abs()[mask]
        out = {"logprob_diff_max": float(diff.max()) if diff.numel() else 0.0,
               "logprob_diff_mean": float(diff.mean()) if diff.numel() else 0.0}
        threshold = self.cfg.rollout.logprob_warn_threshold
        if out["logprob_diff_max"] > threshold:
            logger.warning("engine and trainer log-probs differ by up to %.3g (> rollout.logprob_warn_threshold=%g)",
                           out["logprob_diff_max"], threshold)
        return out

    def sync_weights(self) -> None:
        """Hands the trained weights to the rollout engine (under torchrun every rank must call it)."""
        if not is_distributed():
            self.policy.update_weights(self.model.state_dict())
            return
        state = full_state_dict(self.model)  # gathered on rank 0
        if is_main_process():
            self.rollout_model.load_state_dict(state)
            self.policy.update_weights(state)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Success on the held-out panel (fixed odd seeds, the same panel every time)."""
        self.model.eval()
        env = build_env(self.cfg, self.tokenizer, split="eval", policy=self.eval_policy)
        rows = StepCollector(env, self.eval_policy, seed=self.cfg.seed).collect()
        self.model.train()
        return {f"eval_{k}": v for k, v in episode_metrics(rows).items()}

    def warm_start(self) -> dict[str, float]:
        """Supervised steps on expert responses (``<think>..</think><action>expert</action>``)."""
        from torchrl_agent.trainers.warm_start import expert_rows, supervised_step

        w = self.cfg.warm_start
        rows = expert_rows(self.cfg, self.tokenizer, episodes=w.episodes)
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=w.lr)
        generator = torch.Generator().manual_seed(self.cfg.seed)
        loss = float("nan")
        for _ in range(w.steps):
            idx = torch.randint(rows.batch_size[0], (w.batch_size,), generator=generator)
            loss = supervised_step(self.actor, optimizer, rows[idx.tolist()])
        return {"warm_start_loss": loss, "warm_start_rows": rows.batch_size[0], "warm_start_steps": w.steps}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Save everything the next iteration depends on: weights, optimizer, iteration, the
        collector's position in its seed stream, RNG states and the metrics so far."""
        path = Path(path or self.run_dir / "checkpoints" / f"iteration_{self.iteration:05d}.pt")
        model_state = full_state_dict(self.model)  # every rank gathers; rank 0 holds and writes
        optimizer_state = full_optimizer_state_dict(self.model, self.optimizer)
        if not is_main_process():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "model": model_state, "optimizer": optimizer_state,
            "iteration": self.iteration, "collector": self.collector.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
            "history": self.history, "evals": self.evals, "config": dataclasses.asdict(self.cfg),
        }
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(path)  # never a half-written checkpoint
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=False) if is_main_process() else {}
        load_full_state_dict(self.model, state.get("model", {}))
        load_full_optimizer_state_dict(self.model, self.optimizer, state.get("optimizer", {}))
        self.sync_weights()  # the rollout engine gets the loaded weights
        self.iteration = broadcast_object(state.get("iteration"))
        if not is_main_process():
            return
        self.collector.load_state_dict(state["collector"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        self.history, self.evals = state["history"], [tuple(e) for e in state["evals"]]

    # ------------------------------------------------------------------ loop
    def train(self) -> dict:
        from torch.utils.tensorboard import SummaryWriter

        cfg = self.cfg
        if not is_main_process():
            return self._train_worker()
        writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.wandb = self._init_wandb()
        metrics_file = open(self.run_dir / "metrics.jsonl", "a")
        t_start = time.perf_counter()
        summary: dict = {"run_dir": str(self.run_dir), "env": cfg.env.name, "algorithm": cfg.algorithm.name}
        start = 0
        if cfg.resume:
            self.load_checkpoint(cfg.resume)
            start = self.iteration + 1
            logger.info("resumed from %s at iteration %d", cfg.resume, start)
        elif cfg.warm_start.steps > 0:
            # the untrained policy's held-out success, plotted at iteration -1
            self.evals.append((-1, self.evaluate()["eval_success"]))
            summary.update(self.warm_start())
            self.sync_weights()
            logger.info("warm start: %s", {k: summary[k] for k in ("warm_start_loss", "warm_start_steps")})
        evals = self.evals
        for it in range(start, cfg.iterations):
            self.iteration = it
            t0 = time.perf_counter()
            record: dict = {"iteration": it}
            if it == 0 or (cfg.eval_every and it % cfg.eval_every == 0):
                record.update(self.evaluate())
                evals.append((it, record["eval_success"]))
            rows = self.collector.collect()
            rows = broadcast_object(self.advantage(rows))  # to every rank (as is in a single process)
            record.update(episode_metrics(rows))
            record.update(self.update(rows))
            stats = self.collector.stats
            record.update(env_steps_per_s=stats["env_steps_per_s"], tokens_per_s=stats["tokens_per_s"],
                          generated_tokens=stats["generated_tokens"], iteration_s=time.perf_counter() - t0)
            self._log(record, writer, metrics_file)
            if cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0:
                self.save_checkpoint()
        self.save_checkpoint(self.run_dir / "checkpoints" / "last.pt")
        final = {"iteration": cfg.iterations}
        final.update(self.evaluate())
        evals.append((cfg.iterations, final["eval_success"]))
        self._log(final, writer, metrics_file)
        writer.close()
        metrics_file.close()
        summary.update(
            iterations=cfg.iterations,
            eval_success_first=evals[0][1],
            eval_success_last=evals[-1][1],
            eval_success_after_warm_start=next((s for it, s in evals if it == 0), None) if cfg.warm_start.steps else None,
            eval_curve=evals,
            train_success_last=next((h["success"] for h in reversed(self.history) if "success" in h), None),
            wall_s=round(time.perf_counter() - t_start, 1),
        )
        self._plot(evals)
        return summary

    def _train_worker(self) -> dict:
        """Ranks > 0 under torchrun: the collective calls of rank 0's :meth:`train`, nothing else."""
        cfg = self.cfg
        start = 0
        if cfg.resume:
            self.load_checkpoint(cfg.resume)
            start = self.iteration + 1
        elif cfg.warm_start.steps > 0:
            self.warm_start()
            self.sync_weights()
        for it in range(start, cfg.iterations):
            self.iteration = it
            self.update(broadcast_object(None))
            if cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0:
                self.save_checkpoint()
        self.save_checkpoint(self.run_dir / "checkpoints" / "last.pt")
        return {}

    def _log(self, record: dict, writer, metrics_file) -> None:
        self.history.append(record)
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        for k, v in scalars.items():
            writer.add_scalar(k, v, record["iteration"])
        if getattr(self, "wandb", None) is not None:
            self.wandb.log(scalars, step=record["iteration"] + 1)
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()
                 if k in ("iteration", "success", "episode_reward", "action_valid", "loss", "tokens_per_s",
                          "eval_success", "iteration_s")}
        print("metrics " + json.dumps(shown), flush=True)

    def _init_wandb(self):
        """A Weights & Biases run when ``wandb.project`` is set and ``wandb`` is installed."""
        if not self.cfg.wandb.project:
            return None
        try:
            import wandb
        except ImportError:
            logger.warning("wandb.project is set but wandb is not installed: logging to JSONL and TensorBoard only")
            return None
        return wandb.init(project=self.cfg.wandb.project, entity=self.cfg.wandb.entity, mode=self.cfg.wandb.mode,
                          dir=str(self.run_dir), config=dataclasses.asdict(self.cfg))

    def _plot(self, evals) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:  # plotting is a nicety: never fail a run for it
            return
        fig, ax = plt.subplots(figsize=(5, 3.2))
        train = [(h["iteration"], h["success"]) for h in self.history if "success" in h]
        if train:
            ax.plot(*zip(*train), label="train success")
        ax.plot(*zip(*evals), marker="o", label="held-out success")
        ax.set_xlabel("iteration")
        ax.set_ylabel("success rate")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{self.cfg.env.name} / {self.cfg.algorithm.name}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.run_dir / "learning_curve.png", dpi=120)
        plt.close(fig)

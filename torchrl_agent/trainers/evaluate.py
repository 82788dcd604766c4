"""``torchrl-agent eval``: any policy on an environment's fixed evaluation panel.

The panel is seed-determined (episode ``j`` starts from the odd seed ``2 * (seed + j) + 1``), so
the same ``env.eval_episodes`` and ``seed`` give the same episodes whatever the batch layout or
the number of worker processes. The policy is a training checkpoint (``eval.checkpoint``), a model
folder (``model.path``) or an OpenAI-compatible endpoint (``eval.endpoint``, the prompt-only
baseline), sampled at ``rollout.eval_temperature``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from torchrl_agent.collectors import StepCollector, episode_metrics
from torchrl_agent.models import load_model
from torchrl_agent.modules import HTTPPolicy, TransformersPolicy
from torchrl_agent.trainers.config import TrainConfig
from torchrl_agent.trainers.trainer import build_env

__all__ = ["evaluate_policy"]


def evaluate_policy(cfg: TrainConfig) -> dict:
    """Run the configured policy on the evaluation panel; return success overall and per task type."""
    r, e = cfg.rollout, cfg.eval
    model, tokenizer = load_model(cfg.model)
    if e.checkpoint:
        if not Path(e.checkpoint).is_file():
            raise FileNotFoundError(f"eval.checkpoint: no such file {e.checkpoint}")
        model.load_state_dict(torch.load(e.checkpoint, map_location="cpu", weights_only=False)["model"])
    model.eval()
    if e.endpoint:
        policy = HTTPPolicy(e.endpoint, tokenizer, model=e.endpoint_model or "default",
                            max_new_tokens=r.max_new_tokens, temperature=r.eval_temperature, seed=cfg.seed)
        source = e.endpoint
    else:
        policy = TransformersPolicy(model, tokenizer, max_new_tokens=r.max_new_tokens,
                                    temperature=r.eval_temperature, batch_size=r.batch_size)
        source = e.checkpoint or cfg.model.path or cfg.model.name
    env = build_env(cfg, tokenizer, split="eval", policy=policy)
    t0 = time.perf_counter()
    rows = StepCollector(env, policy, seed=cfg.seed, progress=cfg.progress).collect()
    metrics = episode_metrics(rows)
    return {"env": cfg.env.name, "policy": str(source), "episodes": metrics.pop("episodes"),
            "success": metrics.pop("success"), **metrics, "wall_s": round(time.perf_counter() - t0, 1)}

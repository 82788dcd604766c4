"""``torchrl-agent eval``: any policy on an environment's fixed evaluation panel.

The panel is seed-determined (episode ``j`` starts from the odd seed ``2 * (seed + j) + 1``), so
the same ``env.eval_episodes`` and ``seed`` give the same episodes whatever the batch layout or
the number of worker processes. The policy is a training checkpoint (``eval.checkpoint``) or a model
folder (``model.path``) run by the engine of ``rollout.engine`` (transformers, vLLM, any registered
one), or an OpenAI-compatible endpoint (``eval.endpoint``, the prompt-only baseline), sampled at
``rollout.eval_temperature``.

An endpoint's API key is read from the environment variable named by ``eval.api_key_env``
(``OPENAI_API_KEY`` by default) and sent as ``Authorization: Bearer``: it is in no config, result or
log. An endpoint URL that carries a key is refused by the config check.

An endpoint is asked with a per-request timeout (``eval.timeout``) and retries (``eval.retries``);
a request that still fails, or a reply that is not a completion, costs only its episode (ended
truncated, counted as a failure): the result reports ``failed_episodes`` and the first
``endpoint_errors``, each naming the URL and what was wrong. The panel runs in chunks of
``eval.chunk_episodes`` episodes; on Ctrl-C the finished chunks are reported
(``"interrupted": true``).

``eval.transcripts=PATH`` writes every step of the panel to a JSONL file (one object a step: ``episode``,
``step``, ``observation``, ``response``, ``action``, ``action_valid``, ``reward``, ``done``, ``success``),
to read what the policy answered; the result names the file and how many steps it holds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

from tensordict import lazy_stack

from torchrl_agent.collectors import StepCollector, episode_metrics
from torchrl_agent.envs.factory import build_env
from torchrl_agent.models import load_model
from torchrl_agent.modules import HTTPPolicy
from torchrl_agent.trainers.builders import build_policy
from torchrl_agent.trainers.checkpointing import check_model_state, model_shapes, read_checkpoint, read_weights
from torchrl_agent.trainers.config import TrainConfig
from torchrl_agent.trainers.engines import get_engine

__all__ = ["evaluate_policy"]

logger = logging.getLogger("torchrl_agent")


def evaluate_policy(cfg: TrainConfig) -> dict:
    """Run the configured policy on the evaluation panel; return success overall and per task type."""
    r, e = cfg.rollout, cfg.eval
    model, tokenizer = load_model(cfg.model)
    if e.checkpoint:  # read and verified, no code of the file runs; another model's weights: one line
        state = read_checkpoint(e.checkpoint)
        check_model_state(model_shapes(state), {k: v.shape for k, v in model.state_dict().items()}, e.checkpoint,
                          state.get("config"))
        model.load_state_dict(read_weights(e.checkpoint, state))  # a sharded checkpoint's shards assembled
    model.eval()
    if e.endpoint:
        policy = HTTPPolicy(e.endpoint, tokenizer, model=e.endpoint_model or "default",
                            max_new_tokens=r.max_new_tokens, temperature=r.eval_temperature, seed=cfg.seed,
                            timeout=e.timeout, retries=e.retries, on_error="truncate",
                            api_key=os.environ.get(e.api_key_env) or None)
        source, chunk = e.endpoint, e.chunk_episodes
    else:  # the engine of rollout.engine, as training builds it, sampling at the evaluation temperature
        policy = _engine_policy(cfg, model, tokenizer)
        source, chunk = e.checkpoint or cfg.model.path or cfg.model.name, cfg.env.eval_episodes
    t0 = time.perf_counter()
    parts, interrupted = [], False
    try:
        for first in range(0, cfg.env.eval_episodes, chunk):
            parts.append(_run_chunk(cfg, tokenizer, policy, first, min(chunk, cfg.env.eval_episodes - first)))
    except KeyboardInterrupt:
        interrupted = True
        logger.warning("interrupted: reporting the %d finished chunk(s) of the panel", len(parts))
    result = {"env": cfg.env.name, "policy": str(source), "engine": "http" if e.endpoint else r.engine, "episodes": 0,
              "success": 0.0}
    rows = [row for part in parts for row in part]
    if rows:
        metrics = episode_metrics(lazy_stack(rows), policy.max_new_tokens)
        result.update(episodes=metrics.pop("episodes"), success=metrics.pop("success"), **metrics)
    if e.transcripts:
        result.update(transcripts=e.transcripts, transcript_steps=write_transcripts(rows, e.transcripts))
    if e.endpoint:
        result.update(failed_episodes=len(policy.errors), endpoint_errors=policy.errors[:5])
    if interrupted:
        result["interrupted"] = True
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def write_transcripts(rows: list, path: str) -> int:
    """Write the panel's step rows (:class:`~torchrl_agent.collectors.StepCollector`'s, in order) to
    ``path`` as JSONL, one object a step (module docstring); returns how many were written."""
    def scalar(row, key):
        return row[key].reshape(-1)[0].item() if key in row.keys() else None

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({
                "episode": scalar(row, "traj_id"), "step": scalar(row, "step_count"),
                "observation": row.get_non_tensor("observation", None),
                "response": row.get_non_tensor(("text", "response"), None),
                "action": row.get_non_tensor("action", None), "action_valid": bool(scalar(row, "action_valid")),
                "reward": scalar(row, "reward"), "done": bool(scalar(row, "done")),
                "success": bool(scalar(row, "success")),
            }) + "\n")
    return len(rows)


def _engine_policy(cfg: TrainConfig, model, tokenizer):
    """The rollout engine of ``rollout.engine`` (:func:`~torchrl_agent.trainers.builders.build_policy`)
    at ``rollout.eval_temperature``; an engine with its own copy of the weights (vLLM) gets
    ``model``'s (a checkpoint's) through ``update_weights``."""
    r = cfg.rollout
    policy = build_policy(dataclasses.replace(cfg, rollout=dataclasses.replace(r, temperature=r.eval_temperature)),
                          model, tokenizer)
    if cfg.eval.checkpoint and not get_engine(r.engine).shares_weights:
        policy.update_weights(model.state_dict())
    return policy


def _run_chunk(cfg: TrainConfig, tokenizer, policy, first: int, size: int):
    """Episodes ``first .. first + size - 1`` of the panel (their seeds do not depend on the chunking)."""
    chunk_cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, eval_episodes=size))
    env = build_env(chunk_cfg, tokenizer, split="eval", policy=policy)
    try:
        rows = StepCollector(env, policy, seed=cfg.seed + first, progress=cfg.progress).collect()
    finally:
        env.close()
    out = list(rows.unbind(0))
    for row in out:  # trajectory and group ids unique over the whole panel
        row["traj_id"] = row["traj_id"] + first
        row["group_id"] = row["group_id"] + first
    return out

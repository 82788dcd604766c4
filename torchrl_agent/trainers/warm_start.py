"""A short supervised warm start on an environment's expert (behaviour cloning of the format).

The expert's action is wrapped in the response format the projection expects,
``<think>The best next action is A.</think><action>A</action>`` followed by the end-of-turn
token, and the policy is trained by maximum likelihood on those responses for the prompts the
expert's own episodes produce. Seeds come from a training stream offset from the RL one, never
from the evaluation panel.

``warm_start.expert_noise`` (epsilon) makes the demonstrator an epsilon-noisy expert: at each step,
with probability epsilon, it takes (and the data records) a uniformly random admissible action
instead of the expert's, and the episode goes on from there. Cloning it gives a policy that reads
the state (its modal action is the expert's) but errs at a known rate: a deliberately weak
starting point whose remaining gap only reinforcement learning can close (the learning
benchmark's warm start).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from torchrl.envs.utils import step_mdp

from torchrl_agent.envs.factory import build_env
from torchrl_agent.envs.transforms.projection import expert_response, resolve_format

__all__ = ["expert_response", "expert_rows", "supervised_step"]  # expert_response: the projection's

WARM_START_SEED_OFFSET = 1_000_003


@torch.no_grad()
def expert_rows(cfg, tokenizer, *, episodes: int) -> TensorDictBase:
    """Rows ``[N]`` with ragged ``("tokens", "prompt")`` and ``("tokens", "response")`` from
    expert episodes of the configured environment (steps without an expert action are skipped)."""
    env = build_env(dataclasses.replace(cfg, seed=cfg.seed + WARM_START_SEED_OFFSET), tokenizer)
    n = env.batch_size[0]
    noise = cfg.warm_start.expert_noise
    rng = np.random.default_rng(cfg.seed + WARM_START_SEED_OFFSET)
    rows = []
    eos = tokenizer.eos_token_id
    for _ in range(max(1, episodes // n)):
        td = env.reset()
        while not td["done"].all():
            experts = list(td["expert_action"])
            for i in range(n):
                if td["done"][i].item() or not experts[i]:
                    continue
                admissible = td["admissible_actions"][i].split("\n") if noise > 0 else []
                if noise > 0 and admissible != [""] and rng.random() < noise:
                    experts[i] = str(rng.choice(admissible))  # the noisy demonstrator's own choice
                prompt = td[i]["text", "prompt"]
                response = tokenizer(expert_response(experts[i], resolve_format(cfg.env.action_format, cfg.env.name),
                                                     cfg.warm_start.think),
                                     add_special_tokens=False)["input_ids"] + [eos]
                rows.append(TensorDict({"tokens": {
                    "prompt": torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"]),
                    "response": torch.tensor(response)}}))
            td["action"] = experts
            td = step_mdp(env.step(td))
    if not rows:
        raise ValueError(f"warm_start: environment {cfg.env.name!r} has no expert actions")
    return lazy_stack(rows)


def supervised_step(actor, optimizer, rows: TensorDictBase) -> float:
    """One maximum-likelihood step on the rows' response tokens; returns the mean token NLL."""
    out = actor(rows)
    loss = -(out["log_prob"] * out["mask"]).sum() / out["mask"].sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(actor.model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())

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
starting point whose remaining gap only reinforcement learning can close.

``warm_start.balanced`` (with epsilon 1.0: the learning benchmark's *format-only* warm start)
replaces the demonstrator's random draw by the distribution it is drawn from: every state's rows
hold *every* admissible move, and :func:`batch_indices` builds each mini-batch from whole states.
Each step's target over the moves is then exactly uniform in every state, so the warm-started
policy ends with no move bias. With sampled moves instead, the last few mini-batches' chance
imbalance sets a seed-dependent bias (docs/learning.md: p(+) 0.26-0.52 over seeds), which the
greedy policy turns into a constant move and RL then has to undo before it can learn anything.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from torchrl.envs.utils import step_mdp

from torchrl_agent.envs.factory import build_env
from torchrl_agent.envs.transforms.projection import expert_response, resolve_format

__all__ = ["batch_indices", "expert_response", "expert_rows", "supervised_step", "warm_start"]  # expert_response: the projection's

WARM_START_SEED_OFFSET = 1_000_003


@torch.no_grad()
def expert_rows(cfg, tokenizer, *, episodes: int, processor=None, **image_bounds) -> TensorDictBase:
    """Rows ``[N]`` with ragged ``("tokens", "prompt")`` and ``("tokens", "response")`` from
    expert episodes of the configured environment (steps without an expert action are skipped),
    and ``"state"`` (int64): the index of the demonstration step a row belongs to (rows of one
    state share it; more than one row per state with ``warm_start.balanced``).

    With a VLM's ``processor`` (an image env, ``env.kwargs.modality=image`` or ``both``) each prompt's
    image is expanded as the engine expands it (:func:`~torchrl_agent.modules.vision.prompt_with_image`,
    ``image_bounds``: the engine's ``min_pixels``, ``max_pixels``) and the row keeps its frame,
    ``pixels`` uint8 ``[H, W, 3]``: :class:`~torchrl_agent.modules.VisionResponseLogProbs` scores them."""
    from torchrl_agent.modules.vision import prompt_with_image

    env = build_env(dataclasses.replace(cfg, seed=cfg.seed + WARM_START_SEED_OFFSET), tokenizer)
    n = env.batch_size[0]
    noise = cfg.warm_start.expert_noise
    rng = np.random.default_rng(cfg.seed + WARM_START_SEED_OFFSET)
    balanced = getattr(cfg.warm_start, "balanced", False)
    rows = []
    state = 0
    eos = tokenizer.eos_token_id
    for _ in range(max(1, episodes // n)):
        td = env.reset()
        while not td["done"].all():
            experts = list(td["expert_action"])
            for i in range(n):
                if td["done"][i].item() or not experts[i]:
                    continue
                admissible = td["admissible_actions"][i].split("\n") if noise > 0 else []
                targets = [experts[i]]
                if noise > 0 and admissible != [""] and rng.random() < noise:
                    experts[i] = str(rng.choice(admissible))  # the noisy demonstrator's own choice
                    targets = admissible if balanced else [experts[i]]  # balanced: the whole uniform draw
                text, image = td[i]["text", "prompt"], {}
                if processor is not None:  # a VLM: the image's tokens in the prompt, its frame in the row
                    text = prompt_with_image(processor, text, td["pixels"][i], **image_bounds)[0]
                    image = {"pixels": td["pixels"][i]}
                prompt = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
                fmt = resolve_format(cfg.env.action_format, cfg.env.name)
                for target in targets:
                    response = tokenizer(expert_response(target, fmt, cfg.warm_start.think),
                                         add_special_tokens=False)["input_ids"] + [eos]
                    rows.append(TensorDict({"tokens": {"prompt": prompt, "response": torch.tensor(response)},
                                            "state": torch.tensor(state), **image}))
                state += 1
            td["action"] = experts
            td = step_mdp(env.step(td))
    if not rows:
        raise ValueError(f"warm_start: environment {cfg.env.name!r} has no expert actions")
    return lazy_stack(rows)


def batch_indices(rows: TensorDictBase, batch_size: int, generator: torch.Generator) -> list[int]:
    """One warm-start mini-batch: ``batch_size`` rows drawn uniformly, or, when a state has more
    than one row (``warm_start.balanced``), whole states drawn uniformly until the batch holds at
    least ``batch_size`` rows, so that every state in it carries all of its moves."""
    state = rows["state"]
    n_states = int(state.max()) + 1
    if n_states == rows.batch_size[0]:  # one row per state
        return torch.randint(rows.batch_size[0], (batch_size,), generator=generator).tolist()
    picked = torch.zeros(n_states, dtype=torch.bool)
    picked[torch.randperm(n_states, generator=generator)[: max(1, round(batch_size * n_states / len(state)))]] = True
    return torch.nonzero(picked[state]).reshape(-1).tolist()


def supervised_step(actor, optimizer, rows: TensorDictBase) -> float:
    """One maximum-likelihood step on the rows' response tokens; returns the mean token NLL."""
    out = actor(rows)
    loss = -(out["log_prob"] * out["mask"]).sum() / out["mask"].sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(actor.model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


def warm_start(cfg, tokenizer, actor) -> dict[str, float]:
    """``warm_start.steps`` supervised steps of ``actor`` (the policy's
    :class:`~torchrl_agent.modules.ResponseLogProbs`) on expert responses
    (``<think>..</think><action>expert</action>``), with an AdamW of its own; returns the last
    step's loss and the counts. A VLM's actor (:class:`~torchrl_agent.modules.VisionResponseLogProbs`)
    gets image prompts: :func:`expert_rows` with its processor and image bounds."""
    w = cfg.warm_start
    vision = ({"processor": actor.processor, "min_pixels": actor.min_pixels, "max_pixels": actor.max_pixels}
              if getattr(actor, "processor", None) is not None else {})
    rows = expert_rows(cfg, tokenizer, episodes=w.episodes, **vision)
    optimizer = torch.optim.AdamW(actor.model.parameters(), lr=w.lr)
    generator = torch.Generator().manual_seed(cfg.seed)
    loss = float("nan")
    for _ in range(w.steps):
        loss = supervised_step(actor, optimizer, rows[batch_indices(rows, w.batch_size, generator)])
    return {"warm_start_loss": loss, "warm_start_rows": rows.batch_size[0], "warm_start_steps": w.steps}

"""The step collector: drives an LLM policy step by step over a batch of text environments.

Each call to :meth:`StepCollector.collect` runs one episode in every environment of the batch
(``num_groups * group_size``; the games of a group share their initial state) and returns one
**row per step** (``N = sum of episode lengths``) as a ``LazyStackedTensorDict`` ``[N]`` with the
keys of the data contract (``DESIGN.md``): the step's input (``task``, ``observation``,
``admissible_actions``, ``anchor``, ``memory``, ``step_count``, ``("text", "prompt")``), the
policy's output (``("text", "response")``, ragged ``("tokens", "prompt")``,
``("tokens", "response")``, ``("log_probs", "response")``), the projection (``action``,
``action_valid``, ``response_cut``), the outcome (``reward``, ``done``, ``terminated``,
``truncated``, ``success``) and the ids (``group_id``, ``traj_id``).

Generation is batched over the environments that are still running only: an environment that
finished early takes no generation slot. ``lockstep=True`` reproduces the reference behaviour
(every environment generates at every step until the whole batch is done) for comparison.
"""

from __future__ import annotations

import logging
import time

import torch
from tensordict import NonTensorStack, TensorDictBase, lazy_stack
from torchrl.envs import EnvBase
from torchrl.envs.utils import step_mdp
from tqdm.auto import tqdm

from torchrl_agent.envs.transforms.projection import ActionProjection
from torchrl_agent.modules.policy import LLMPolicy

__all__ = ["StepCollector"]

logger = logging.getLogger(__name__)

#: Keys of the step's input copied into its row.
_INPUT_KEYS = ("task", "observation", "admissible_actions", "expert_action", "task_type", "anchor", "memory",
               "step_count", ("text", "prompt"))
_OUTCOME_KEYS = ("reward", "done", "terminated", "truncated", "success", "worker_fault")


class StepCollector:
    """Collects complete groups of episodes as step rows.

    Args:
        env: a (transformed) text environment with memory + prompt transforms; its batch is
            ``[num_groups * group_size]``.
        policy: an :class:`~torchrl_agent.modules.LLMPolicy`.
        projection: the action projection; defaults to the ``ActionProjection`` found in
            ``env``'s transforms, else a ``"tags"`` projection.
        seed: seeds the environment and the sampling; collection is deterministic for a seed.
        lockstep: generate for every environment at every step (the reference's behaviour).
        progress: show a progress bar over the batch's environment steps.
    """

    def __init__(self, env: EnvBase, policy: LLMPolicy, *, projection: ActionProjection | None = None,
                 seed: int = 0, lockstep: bool = False, progress: bool = False):
        self.env, self.policy = env, policy
        self.projection = projection or _find_projection(env) or ActionProjection("tags")
        self.lockstep, self.progress = lockstep, progress
        self.seed = seed
        self.batches = 0
        self.num_groups = getattr(env, "num_groups", None) or env.base_env.num_groups
        self.group_size = getattr(env, "group_size", None) or env.base_env.group_size
        env.set_seed(seed)
        self.stats: dict[str, float] = {}

    def state_dict(self) -> dict:
        return {"batches": self.batches, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Resume: re-seed and skip the environment seeds of the batches already collected."""
        self.seed = state["seed"]
        self.env.set_seed(self.seed)
        base = getattr(self.env, "base_env", self.env)
        for _ in range(state["batches"] * self.num_groups):
            base._next_group_seed()
        self.batches = state["batches"]

    @torch.no_grad()
    def collect(self) -> TensorDictBase:
        """Run one episode in every environment; return the step rows ``[N]``."""
        torch.manual_seed(self.seed * 1_000_003 + self.batches)
        n = self.num_groups * self.group_size
        group_id = self.batches * self.num_groups + torch.arange(n) // self.group_size
        traj_id = self.batches * n + torch.arange(n)
        td = self.env.reset()
        running = torch.ones(n, dtype=torch.bool)
        rows: list[TensorDictBase] = []
        t0, generated, gen_slots = time.perf_counter(), 0, 0
        bar = tqdm(total=None, desc="collect", unit="step", disable=not self.progress, leave=False)
        while running.any():
            active = torch.arange(n) if self.lockstep else running.nonzero().squeeze(-1)
            out = self.policy(td[active].select(("text", "prompt")))
            gen_slots += len(active)
            responses = [""] * n
            for j, i in enumerate(active.tolist()):
                responses[i] = out[j]["text", "response"]
            td.set(("text", "response"), NonTensorStack(*responses, batch_size=[n]))
            self.projection(td)
            too_long = torch.zeros(n, dtype=torch.bool)
            too_long[active] = out["prompt_too_long"].reshape(-1)
            td = self.env.step(td)
            for j, i in enumerate(active.tolist()):
                if not running[i]:
                    continue  # lockstep: an environment already done generated for nothing
                row = td[i].select(*_INPUT_KEYS, "action", "action_valid", "response_cut", ("text", "response"),
                                  strict=False)
                row.update(td[i]["next"].select(*_OUTCOME_KEYS, strict=False))
                if too_long[i]:  # the engine could not take the prompt: the episode ends here
                    logger.warning("prompt of environment %d exceeds the engine's limit: episode truncated", i)
                    row["truncated"] = torch.ones(1, dtype=torch.bool)
                    row["done"] = torch.ones(1, dtype=torch.bool)
                row.update(out[j].select("tokens", "log_probs", "prompt_too_long", "cached_tokens"))
                row["group_id"] = group_id[i]
                row["traj_id"] = traj_id[i]
                # the token ledger: what this step cost
                row["prompt_tokens"] = torch.tensor([len(row["tokens", "prompt"])])
                row["response_tokens"] = torch.tensor([len(row["tokens", "response"])])
                rows.append(row)
                generated += int(row["response_tokens"])
            was_running = running.clone()
            running = running & ~td["next", "done"].reshape(-1) & ~too_long
            bar.update(int(was_running.sum()))
            td = step_mdp(td, keep_other=True)
        bar.close()
        self.batches += 1
        elapsed = time.perf_counter() - t0
        self.stats = {"collect_time_s": elapsed, "env_steps": len(rows), "generated_tokens": generated,
                      "generation_slots": gen_slots, "env_steps_per_s": len(rows) / elapsed,
                      "tokens_per_s": generated / elapsed}
        return lazy_stack(rows)

    def __iter__(self):
        while True:
            yield self.collect()


def _find_projection(env: EnvBase) -> ActionProjection | None:
    transform = getattr(env, "transform", None)
    if transform is None:
        return None
    for t in getattr(transform, "transforms", [transform]):
        if isinstance(t, ActionProjection):
            return t
    return None


def token_ledger(rows: TensorDictBase) -> dict[str, float]:
    """Token costs: per step and per episode, prompt, response and prefix-cached prompt tokens
    (``cached_tokens`` is 0 for engines that do not report it)."""
    _, inverse = torch.unique(rows["traj_id"].reshape(-1), return_inverse=True)
    episodes = int(inverse.max()) + 1
    out = {}
    for key in ("prompt_tokens", "response_tokens", "cached_tokens"):
        per_step = rows[key].reshape(-1).double()
        per_episode = torch.zeros(episodes, dtype=torch.float64).index_add_(0, inverse, per_step)
        out[f"{key}_per_step"] = per_step.mean().item()
        out[f"{key}_per_episode"] = per_episode.mean().item()
        out[f"{key}_total"] = int(per_step.sum())
    return out


def episode_metrics(rows: TensorDictBase) -> dict[str, float]:
    """Per-episode success, reward and length over the rows of complete episodes, and the
    per-task-type success where the environment labels its tasks."""
    done = rows["done"].reshape(-1)
    success = rows["success"].reshape(-1)[done].float()
    traj = rows["traj_id"].reshape(-1)
    _, inverse = torch.unique(traj, return_inverse=True)
    episode_reward = torch.zeros(int(inverse.max()) + 1).index_add_(0, inverse, rows["reward"].reshape(-1).float())
    lengths = torch.bincount(inverse).float()
    return {
        "success": success.mean().item() if len(success) else 0.0,
        "episode_reward": episode_reward.mean().item(),
        "episode_length": lengths.mean().item(),
        "action_valid": rows["action_valid"].float().mean().item(),
        # responses cut to the projection's max_chars before parsing
        "responses_cut": int(rows["response_cut"].sum()) if "response_cut" in rows.keys() else 0,
        "episodes": int(done.sum()),
        **_per_task_success(rows, done),
        **token_ledger(rows),
    }


def _per_task_success(rows: TensorDictBase, done: torch.Tensor) -> dict[str, float]:
    if "task_type" not in rows.keys():
        return {}
    types = [t for t, d in zip(rows["task_type"], done.tolist()) if d]
    success = rows["success"].reshape(-1)[done].tolist()
    out = {}
    for name in sorted(set(types) - {""}):
        hits = [s for t, s in zip(types, success) if t == name]
        out[f"success/{name}"] = sum(hits) / len(hits)
    return out


"""The step collector: drives an LLM policy step by step over a batch of text environments.

Each call to :meth:`StepCollector.collect` runs one episode in every environment of the batch
(``num_groups * group_size``; the games of a group share their initial state) and returns one
**row per step** (``N = sum of episode lengths``) as a ``LazyStackedTensorDict`` ``[N]`` with the
keys of the data contract (the README's "The data contract"): the step's input (``task``, ``observation``,
``admissible_actions``, ``anchor``, ``memory``, ``step_count``, ``("text", "prompt")``, and
``pixels`` in an image env), the policy's output (``("text", "response")``, ragged ``("tokens", "prompt")``,
``("tokens", "response")``, ``("log_probs", "response")``; a VLM's ``image_tokens``), the projection (``action``,
``action_valid``, ``response_cut``), the outcome (``reward``, ``done``, ``terminated``,
``truncated``, ``success``, ``next_anchor``: the anchor of the observation the step returned) and the
ids (``group_id``, ``traj_id``). The env's
:class:`~torchrl_agent.envs.transforms.ActionProjection` parses each response during the step; the
row takes the parse from the step's output.

Generation is batched over the environments that are still running only: an environment that
finished early takes no generation slot. ``lockstep=True`` reproduces the reference behaviour
(every environment generates at every step until the whole batch is done) for comparison.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterator

import torch
from tensordict import NonTensorStack, TensorDictBase, lazy_stack
from torchrl.collectors import BaseCollector
from torchrl.envs import EnvBase
from torchrl.envs.utils import step_mdp
from tqdm.auto import tqdm

from torchrl_agent.collectors.weight_sync import default_scheme, register_policy_scheme
from torchrl_agent.envs.base import stable_hash
from torchrl_agent.envs.transforms.projection import ActionProjection
from torchrl_agent.modules.policy import LLMPolicy

__all__ = ["StepCollector"]

logger = logging.getLogger(__name__)

#: Keys of the step's input copied into its row.
_INPUT_KEYS = ("task", "observation", "admissible_actions", "expert_action", "task_type", "anchor", "memory",
               "step_count", ("text", "prompt"), "pixels")
_OUTCOME_KEYS = ("reward", "done", "terminated", "truncated", "success", "worker_fault", "env_fault", "task_score")
#: The projection's keys: in the step's output (the env's projection), or in its input (``projection``).
_PARSED_KEYS = ActionProjection.parsed_keys


class StepCollector(BaseCollector):
    """Collects complete groups of episodes as step rows; a TorchRL collector.

    Each batch (one :meth:`collect` call, one item of the iterator) is one episode in every
    environment. Used as a TorchRL collector::

        collector = StepCollector(env, policy, total_frames=10_000, replay_buffer=rb, postproc=GiGPOAdvantage())
        for _ in collector:                      # ends once total_frames env steps were collected
            ...                                  # sample rb, optimise
            collector.update_policy_weights_(model.state_dict())
        collector.shutdown()

    Args:
        env: a (transformed) text environment with memory + prompt transforms; its batch is
            ``[num_groups * group_size]``.
        policy: an :class:`~torchrl_agent.modules.LLMPolicy`.
        projection: the action projection the collector applies before each step, for an ``env``
            without an ``ActionProjection`` transform (default: a ``"tags"`` projection). An env with
            one parses the responses itself; passing another projection for it is an error.
        seed: seeds the environment and the sampling; collection is deterministic for a seed.
            Each step's request carries ``request_seed`` (a function of the seed, ``traj_id`` and
            ``step_count`` only), so engines taking per-request seeds (vLLM) sample the same
            rows whatever the batching (see :class:`~torchrl_agent.collectors.MultiProcessStepCollector`).
        lockstep: generate for every environment at every step (the reference's behaviour).
        progress: show a progress bar over the batch's environment steps.
        total_frames: the iterator ends once this many rows (env steps) were collected, at the end
            of the batch that reaches it (``-1``: endless).
        total_batches: the iterator ends after this many batches (``None``: no limit).
        replay_buffer: when given, the iterator extends it with each batch and yields ``None``.
        postproc: applied to each batch's rows before they are yielded or stored (e.g. an
            advantage transform such as :class:`~torchrl_agent.objectives.GiGPOAdvantage`).
        weight_sync_scheme: the TorchRL ``WeightSyncScheme`` behind :meth:`update_policy_weights_`
            (default: :func:`~torchrl_agent.collectors.weight_sync.default_scheme`).

    ``stats`` is the last batch's figures (a dict); calling it, ``stats()``, gives TorchRL's
    progress snapshot (``frames``, ``batches``, ``total_frames``, ...).
    """

    init_random_frames = 0  # read by TorchRL's Trainer: no random warm-up frames

    def __init__(self, env: EnvBase, policy: LLMPolicy, *, projection: ActionProjection | None = None,
                 seed: int = 0, lockstep: bool = False, progress: bool = False, total_frames: int = -1,
                 total_batches: int | None = None, replay_buffer=None, postproc=None,
                 weight_sync_scheme=None):
        super().__init__()
        if total_batches is not None and total_batches < 1:
            raise ValueError(f"total_batches must be >= 1 or None, got {total_batches}")
        self.env, self.policy = env, policy
        own = _find_projection(env)
        if own is not None and projection is not None and projection is not own:
            raise ValueError("StepCollector: env already has an ActionProjection transform; do not pass projection=")
        self.projection = None if own is not None else projection or ActionProjection("tags")
        self.lockstep, self.progress = lockstep, progress
        self.seed = seed
        self.batches = 0
        self.num_groups = getattr(env, "num_groups", None) or env.base_env.num_groups
        self.group_size = getattr(env, "group_size", None) or env.base_env.group_size
        self.layout = ShardLayout(self.num_groups, self.num_groups * self.group_size)
        self.total_frames, self.total_batches = total_frames, total_batches
        self.requested_frames_per_batch = self.frames_per_batch = None  # a batch is one episode per env
        self.replay_buffer, self.postproc = replay_buffer, postproc
        self._frames = 0
        self._prepared: tuple[TensorDictBase, torch.Tensor] | None = None  # see prepare_next_batch
        env.set_seed(seed)
        self.stats: _BatchStats = _BatchStats(self)
        register_policy_scheme(self, weight_sync_scheme or default_scheme(policy))

    # ------------------------------------------------------------------ TorchRL collector API
    def iterator(self) -> Iterator[TensorDictBase | None]:
        while not self._budget_spent():
            rows = self.collect()
            if self.postproc is not None:
                rows = self.postproc(rows)
            if self.post_collect_hook is not None:
                self.post_collect_hook(rows)
            if self.replay_buffer is not None:
                self.replay_buffer.extend(rows)
                yield None
            else:
                yield rows

    def _budget_spent(self) -> bool:
        return ((self.total_frames is not None and 0 <= self.total_frames <= self._frames)
                or (self.total_batches is not None and self.batches >= self.total_batches))

    @property
    def _iter(self) -> int:  # read by BaseCollector.stats()
        return self.batches - 1

    def __len__(self) -> int:
        if self.total_batches is None:
            raise RuntimeError("the number of batches is known only with total_batches (episodes vary in length)")
        return self.total_batches

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Restart collection from ``seed`` (environment seeds, sampling seeds, ids)."""
        self.seed, self.batches, self._frames = seed, 0, 0
        self._prepared = None
        self.env.set_seed(seed)
        if hasattr(self.policy, "set_seed"):
            self.policy.set_seed(seed)
        return seed

    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Close the environment (its worker processes, if any). The policy belongs to the caller."""
        if close_env and not getattr(self.env, "is_closed", True):
            try:
                self.env.close()
            except Exception:
                if raise_on_error:
                    raise

    def get_model(self, model_id: str):
        if model_id != "policy":
            raise KeyError(f"{type(self).__name__} has one model, 'policy', not {model_id!r}")
        return self.policy

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"batches": self.batches, "seed": self.seed, "frames": self._frames}

    def load_state_dict(self, state: dict) -> None:
        """Resume: re-seed and skip the environment seeds of the batches already collected."""
        self.seed = state["seed"]
        self._prepared = None
        self.env.set_seed(self.seed)
        base = getattr(self.env, "base_env", self.env)
        for _ in range(state["batches"] * self.layout.groups_total):
            base._next_group_seed()
        self.batches = state["batches"]
        self._frames = state.get("frames", 0)

    @torch.no_grad()
    def prepare_next_batch(self) -> None:
        """Reset the environments for the next batch now; the next :meth:`collect` starts from them.

        A reset does not involve the policy, so the next batch is still collected with the weights
        current when :meth:`collect` is called: a shard of a sharded collector prepares while it
        waits for its next command (an ALFWorld reset loads a game). The rows are those
        :meth:`collect` alone gives (the torch RNG state after the reset is kept for it).
        :meth:`set_seed` and :meth:`load_state_dict` discard a prepared batch."""
        if self._prepared is None:
            torch.manual_seed(self.seed * 1_000_003 + self.batches)
            td = self.layout.reset(self.env)
            self._prepared = (td, torch.get_rng_state())

    @torch.no_grad()
    def collect(self) -> TensorDictBase:
        """Run one episode in every environment; return the step rows ``[N]``."""
        self.prepare_next_batch()  # unless already done
        (td, rng), self._prepared = self._prepared, None
        torch.set_rng_state(rng)
        n = self.num_groups * self.group_size
        group_id, traj_id = self.layout.ids(self.batches, n, self.group_size)
        running = torch.ones(n, dtype=torch.bool)
        rows: list[TensorDictBase] = []
        t0, generated, gen_slots = time.perf_counter(), 0, 0
        bar = tqdm(total=None, desc="collect", unit="step", disable=not self.progress, leave=False)
        cut_total = 0
        while running.any():
            cut = self._over_budget(td, running)
            if cut.any():  # the current observation alone is over the prompt budget: no generation
                self._end_before_generation(cut, rows, traj_id)
                running, cut_total = running & ~cut, cut_total + int(cut.sum())
                if not running.any():
                    break
            active = torch.arange(n) if self.lockstep else running.nonzero().squeeze(-1)
            request = td[active].select(*self.policy.in_keys)  # the prompts (and a VLM's `pixels`)
            request["request_seed"] = request_seeds(self.seed, traj_id[active], td["step_count"][active])
            out = self.policy(request)
            gen_slots += len(active)
            responses = [""] * n
            for j, i in enumerate(active.tolist()):
                responses[i] = out[j]["text", "response"]
            td.set(("text", "response"), NonTensorStack(*responses, batch_size=[n]))
            if self.projection is not None:  # an env without a projection transform
                self.projection(td)
            too_long = torch.zeros(n, dtype=torch.bool)
            too_long[active] = out["prompt_too_long"].reshape(-1)
            td = self.env.step(td)
            next_anchor = td.get(("next", "anchor"), None)  # the state each step led to (GraphGPO's graph edges)
            for j, i in enumerate(active.tolist()):
                if not running[i]:
                    continue  # lockstep: an environment already done generated for nothing
                row = td[i].select(*_INPUT_KEYS, *_PARSED_KEYS, ("text", "response"), strict=False)
                row.update(td[i]["next"].select(*_OUTCOME_KEYS, *_PARSED_KEYS, strict=False))
                if next_anchor is not None:
                    row["next_anchor"] = next_anchor[i]
                if too_long[i]:  # the engine could not take the prompt: the episode ends here
                    logger.warning("the engine generated nothing for environment %d (prompt over the engine's "
                                   "limit, or a failed request): episode truncated", i)
                    row["truncated"] = torch.ones(1, dtype=torch.bool)
                    row["done"] = torch.ones(1, dtype=torch.bool)
                row.update(out[j].select("tokens", "log_probs", "prompt_too_long", "cached_tokens"))
                row.update(out[j].select("image_tokens", strict=False))  # a VLM engine's
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
        self._frames += len(rows)
        elapsed = time.perf_counter() - t0
        self.stats = _BatchStats(self, {"collect_time_s": elapsed, "env_steps": len(rows), "generated_tokens": generated,
                      "generation_slots": gen_slots, "env_steps_per_s": len(rows) / elapsed,
                      "tokens_per_s": generated / elapsed, "prompt_budget_truncations": cut_total})
        return lazy_stack(rows)

    @staticmethod
    def _over_budget(td: TensorDictBase, running: torch.Tensor) -> torch.Tensor:
        """The running environments whose prompt is over the prompt transform's budget with no
        memory left to drop (``prompt_over_budget``; all False without a budget)."""
        over = td.get("prompt_over_budget", None)
        return running & over.reshape(-1).bool() if over is not None else torch.zeros_like(running)

    @staticmethod
    def _end_before_generation(cut: torch.Tensor, rows: list[TensorDictBase], traj_id: torch.Tensor) -> None:
        """End the ``cut`` episodes without generating: the episode's last recorded step becomes
        its ``truncated`` end (an episode cut at its first step has no rows at all)."""
        for i in cut.nonzero().reshape(-1).tolist():
            logger.warning("environment %d: the current observation alone is over the prompt budget "
                           "(memory.max_prompt_tokens): episode truncated before generating", i)
            for row in reversed(rows):
                if int(row["traj_id"]) == int(traj_id[i]):
                    row["truncated"] = torch.ones(1, dtype=torch.bool)
                    row["done"] = torch.ones(1, dtype=torch.bool)
                    break


class _BatchStats(dict):
    """The last batch's figures; calling it returns TorchRL's progress snapshot
    (:meth:`BaseCollector.stats`) merged with them."""

    def __init__(self, collector, figures: dict | None = None):
        super().__init__(figures or {})
        self._collector = weakref.ref(collector)

    def __call__(self) -> dict:
        return {**BaseCollector.stats(self._collector()), **self}


def request_seeds(seed: int, traj_id: torch.Tensor, step_count: torch.Tensor) -> torch.Tensor:
    """The sampling seed of each step's request ``[b]``: a function of the collector's seed, the
    trajectory and the step only, so a row's sample does not depend on how requests are batched."""
    keys = [f"{seed}/{int(t)}/{int(s)}" for t, s in zip(traj_id.reshape(-1), step_count.reshape(-1))]
    return torch.tensor([stable_hash(k) % _SEED_MODULUS for k in keys], dtype=torch.int64)


_SEED_MODULUS = 2**31 - 1


class ShardLayout:
    """Where a collector's environments sit among all the environments collected for one batch.

    A single collector owns them all (``ShardLayout(G, n)``). A shard of a multi-process collector
    owns groups ``group_offset ..`` of ``groups_total``: its ids are the ones the single-process
    collector gives those environments, and its env skips the group seeds of the other shards, so
    it plays the same episodes.
    """

    def __init__(self, groups_total: int, envs_total: int, group_offset: int = 0, env_offset: int = 0):
        self.groups_total, self.envs_total = groups_total, envs_total
        self.group_offset, self.env_offset = group_offset, env_offset

    def ids(self, batch: int, n: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``group_id`` and ``traj_id`` ``[n]`` of this collector's environments in batch ``batch``."""
        local = torch.arange(n)
        return (batch * self.groups_total + self.group_offset + local // group_size,
                batch * self.envs_total + self.env_offset + local)

    def reset(self, env: EnvBase) -> TensorDictBase:
        """Reset ``env`` on this shard's groups of the next batch."""
        base = getattr(env, "base_env", env)
        mine = base.num_groups
        for _ in range(self.group_offset):
            base._next_group_seed()
        td = env.reset()
        for _ in range(self.groups_total - self.group_offset - mine):
            base._next_group_seed()
        return td


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


def episode_metrics(rows: TensorDictBase, max_new_tokens: int | None = None) -> dict[str, float]:
    """Per-episode success, reward and length over the rows of complete episodes, how many episodes
    and groups they are, and the per-task-type success where the environment labels its tasks.

    With the engine's ``max_new_tokens``, also ``response_at_cap``: the share of responses that used
    every token of it (``response_tokens == max_new_tokens``), i.e. were most likely cut by the
    generation limit (one whose eos fell exactly on the last token is counted too)."""
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
        **_at_cap(rows, max_new_tokens),
        "episodes": int(done.sum()),
        **_groups(rows, done),
        **_per_task_success(rows, done),
        **_task_score(rows, done),
        **token_ledger(rows),
    }


def _at_cap(rows: TensorDictBase, max_new_tokens: int | None) -> dict[str, float]:
    """``response_at_cap``: the share of rows whose response is ``max_new_tokens`` long (none without it)."""
    if max_new_tokens is None or "response_tokens" not in rows.keys():
        return {}
    return {"response_at_cap": (rows["response_tokens"].reshape(-1) >= max_new_tokens).float().mean().item()}


def _groups(rows: TensorDictBase, done: torch.Tensor) -> dict[str, int]:
    """How many groups the finished episodes belong to (``group_id``; rows without it: none)."""
    if "group_id" not in rows.keys():
        return {}
    return {"groups": int(torch.unique(rows["group_id"].reshape(-1)[done]).numel())}


def _task_score(rows: TensorDictBase, done: torch.Tensor) -> dict[str, float]:
    """The mean raw task score of the finished episodes, where the env reports one (WebShop's ``task_score``)."""
    if "task_score" not in rows.keys():
        return {}
    scores = rows["task_score"].reshape(-1)[done].float()
    return {"task_score": scores.mean().item() if len(scores) else 0.0}


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


"""Does reinforcement learning (not the warm start) raise held-out success? GRPO and GiGPO, 10 seeds.

Per task (``torchrl_agent/configs/experiment/learning_<task>.yaml``) and seed, one run is: the bundled
``tiny-large`` model, a deliberately short supervised warm start on the environment's expert
(``warm_start.steps``), then RL only (``iterations``), scored on a fixed held-out panel of
``env.eval_episodes`` games (the environment's evaluation seeds, disjoint from the training and
warm-start seeds) every ``eval_every`` iterations, twice: greedily (temperature 0) and sampled at
``rollout.eval_temperature``. Point 0 of a curve is the model right after the warm start; the gain
is final minus point 0, so it is RL's alone. Both methods run the same hyper-parameters (the
only override that differs is ``algorithm=``; docs/learning.md says on which runs they were
chosen); a seed's warm start is the same for both methods (same seed, same data, one thread: the
same weights).

Also measured per task: the success of a uniformly random *valid* policy (an admissible action
drawn uniformly every step) on the same panel, and the stall diagnostics of every iteration
(share of groups whose episodes all scored the same and so carry no episode advantage, mean
absolute advantage, per-token log-prob and entropy of the sampled responses, how far one update
moves the policy: KL(old || new) on the sampled tokens and the clip fraction, the gradient norm).

Runs are separate processes, ``--jobs`` at a time (2 on 2 cores), one torch thread each.
Writes ``--out`` (a folder: per-run JSON and the curves PNG) and prints one JSON object as the LAST
line, shaped ``{"tasks": {TASK: {"random_policy_success": x, "constant_move_success": {MOVE: x},
"blind_ceiling": {"success": x, "plan": P} or null, "threshold": x, "warm_start_only": W,
"methods": {"grpo": M, "gigpo": M}, "gigpo_vs_grpo": C, "vs_gigpo": {METHOD: C}, "environments": [E]}}}``:
``E`` the package versions and CPU kernels the runs were made in (:func:`environment`; one entry
when they all match, none for runs older than it: a seed reproduces a run only in the same one); ``M`` holds
per seed the final evaluations (``finals``, ``finals_sampled``) and ``reached_threshold`` (seeds whose FINAL greedy
evaluation is at or above the threshold); ``W`` the warm-started model's panel per seed (iteration 0,
the same weights for both methods); ``C`` GiGPO minus GRPO paired over seeds, with a 95% t and
bootstrap interval and a sign-flip permutation p-value (``within_noise`` when the interval holds 0),
on the finals and on ``curve_means`` / ``train_success_means`` (how soon and how steadily);
``vs_gigpo`` the same for every other method of ``--methods`` minus GiGPO (e.g. ``--methods gigpo
hgpo graphgpo grpo``). ``blind_ceiling`` is the best success any fixed sequence of moves ``P`` reaches
on the panel (every one tried; null where there are more than 4096): what a policy that cannot read
the state can win, the bar for a vision task's blanked control::

    python benchmarks/learning.py [--tasks numberline babyai] [--seeds 0 .. 9] [--jobs 2]
                                  [--iterations N] [--threshold 0.8] [--out runs/learning] [--quick]
                                  [--markdown docs/learning_results.md]

Task ``pretrained`` (issue 36) is the exception to the above: SmolLM2-135M-Instruct, no warm start
(point 0 is its zero-shot behaviour, so ``after_warm_start`` holds the zero-shot start), the
reference's prompt and parsing, GiGPO with the KL term to the start (run it with
``--tasks pretrained --methods gigpo``; its config says why each setting).

Task ``babyai_sparse`` (issue 34) is the long-credit task: the BabyAI task without its distance
shaping (the level's sparse reward only), gamma 0.95, so a move's credit comes back from the
episode's end (``--methods gigpo hgpo graphgpo grpo`` compares how each estimator brings it back).

Task ``vision`` (issue 33) runs the bundled tiny VLM (``tiny-vl``) on the long NumberLine seen only as
an image (a column of cells, the text one fixed sentence), drawn either way up at random each step
(``env.kwargs.mirror``), lr 2e-3 and 40 iterations; docs/vision.md has why. ``--set
env.kwargs.blank_images=true`` is its control (every frame black), which can win no more than the
random policy there. Task ``vision_upright`` is the same game always drawn one way up (where a blind
policy that commits to a side wins the games on that side).

``--quick`` is a smoke run (one task, one seed, 1 iteration, an 8-game panel). A finished run's
JSON in ``--out`` is reused, so an interrupted benchmark resumes (a run interrupted before its JSON
starts again from the beginning: :func:`start_over`); ``--report`` runs nothing and
summarises the finished runs of the asked tasks, methods and seeds (the missing ones named on
stderr; the paired comparison covers the seeds both methods finished). A run that fails is
reported on stderr when it fails and the others go on; the summary then covers the finished runs
and the exit status is non-zero, naming the failed ones.
``--diagnose TASK`` runs one GRPO seed of TASK and prints the per-iteration diagnostics only
(overrides after ``--set`` go to the config, e.g. ``--set model.name=tiny warm_start.steps=150``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import math
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from torchrl_agent.collectors import StepCollector, episode_metrics  # noqa: E402
from torchrl_agent.envs.workers import die_with_parent  # noqa: E402
from torchrl_agent.trainers.cli import compose_config  # noqa: E402
from torchrl_agent.trainers.run_dir import RunDirLock, run_files  # noqa: E402
from torchrl_agent.trainers.trainer import Trainer, build_env  # noqa: E402

METHODS = ("grpo", "gigpo")
#: What a method needs beyond its task's recipe; everything else is shared, so a comparison is one of
#: advantage estimators. GraphGPO's step return is ``10 * gamma^d`` (``d``: hops from the next state to
#: success in the group's state graph): at the recipes' ``gamma`` 0 (chosen for GiGPO's
#: immediate-reward step term) the config refuses it; it gets the reference's 0.95.
METHOD_SETTINGS = {"graphgpo": ["algorithm.gamma=0.95"]}
TASKS = ("numberline", "babyai", "babyai_sparse", "ezpoints", "sokoban", "pretrained", "vision", "vision_upright")
# the update's metrics kept in every iteration's diagnostics
DIAGNOSED = ("clip_fraction", "entropy", "grad_norm", "approx_kl", "approx_kl_max", "response_kl_max", "kl_step_halvings",
             "kl_steps_undone", "update_steps", "update_kl", "update_kl_halvings")


class LearningTrainer(Trainer):
    """:class:`Trainer` that scores the panel greedily *and* sampled, and records why an update
    does (or does not) move the policy. Training itself is the parent's, unchanged."""

    def __init__(self, cfg, *, diagnose: bool = True):
        super().__init__(cfg)
        self.diagnose = diagnose
        self.panel: list[dict] = []  # {"iteration", "greedy", "sampled"} per evaluation
        self.diagnostics: list[dict] = []
        self._evaluated_untrained = False

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if self.cfg.warm_start.steps > 0 and not self._evaluated_untrained and not self.metrics.evals:
            # Trainer.train's point -1 (the untrained model): skipped here, it costs a whole panel of
            # max-length garbage responses and the benchmark's baseline is the warm-started model
            self._evaluated_untrained = True
            return {"eval_success": float("nan")}
        t0 = time.perf_counter()
        sampled, _ = self._panel(self.eval_policy.temperature)
        greedy, rows = self._panel(0.0)
        point = {"iteration": len(self.history),  # RL iterations done (one history record each)
                 "greedy": greedy["eval_success"], "sampled": sampled["eval_success"],
                 "greedy_action_valid": greedy["eval_action_valid"], **plan_stats(rows),
                 "eval_s": time.perf_counter() - t0}
        self.panel.append(point)
        return {**greedy, "eval_sampled_success": sampled["eval_success"]}

    def _panel(self, temperature: float):
        """The held-out panel (as :meth:`Trainer.evaluate`) at ``temperature``: metrics and rows."""
        previous, self.eval_policy.temperature = self.eval_policy.temperature, temperature
        self.model.eval()
        try:
            env = build_env(self.cfg, self.tokenizer, split="eval", policy=self.eval_policy)
            rows = StepCollector(env, self.eval_policy, seed=self.cfg.seed).collect()
        finally:
            self.model.train()
            self.eval_policy.temperature = previous
        return {f"eval_{k}": v for k, v in episode_metrics(rows, self.eval_policy.max_new_tokens).items()}, rows

    def update(self, rows):
        stats = advantage_stats(rows)
        if not self.diagnose:  # the cheap statistics only (no extra forward passes)
            out = super().update(rows)
            stats.update({k: out[k] for k in DIAGNOSED if k in out})
            self.diagnostics.append({"iteration": self.iteration, **stats})
            return {**out, **stats}
        old = self.scorer.recompute(self.model, rows)  # per-row log-probs of the sampled response tokens
        token_lp = torch.cat(old)
        stats.update(sampled_logprob_mean=float(token_lp.mean()),
                     sampled_token_p_over_0_99=float((token_lp > math.log(0.99)).float().mean()),
                     response_tokens_mean=len(token_lp) / len(old))
        out = super().update(rows)
        new = self.scorer.recompute(self.model, rows)
        diff = torch.cat([o - n for o, n in zip(old, new)])
        stats.update(kl_old_new=float(diff.mean()), max_logprob_change=float(diff.abs().max()))
        stats.update({k: out[k] for k in DIAGNOSED if k in out})
        self.diagnostics.append({"iteration": self.iteration, **stats})
        return {**out, **stats}


def plan_stats(rows) -> dict[str, float]:
    """Does the policy read its observation? Over the panel's episodes: the number of distinct
    action sequences, and the share of episodes playing the most common one (1.0: the same moves
    whatever the game)."""
    plans: dict[int, list[str]] = {}
    for traj, action in zip(rows["traj_id"].reshape(-1).tolist(), rows["action"]):
        plans.setdefault(traj, []).append(str(action))
    counts: dict[str, int] = {}
    for plan in plans.values():
        key = " ".join(plan)
        counts[key] = counts.get(key, 0) + 1
    return {"distinct_plans": len(counts), "top_plan_share": max(counts.values()) / max(len(plans), 1),
            "top_plan": max(counts, key=counts.get)}


def advantage_stats(rows) -> dict[str, float]:
    """Share of groups whose episodes all returned the same (no episode-level signal), share of
    rows with a zero advantage, mean |advantage| over rows."""
    group = rows["group_id"].reshape(-1)
    traj = rows["traj_id"].reshape(-1)
    reward = rows["reward"].reshape(-1).float()
    returns: dict[int, float] = {}
    owner: dict[int, int] = {}
    for g, t, r in zip(group.tolist(), traj.tolist(), reward.tolist()):
        returns[t] = returns.get(t, 0.0) + r
        owner[t] = g
    by_group: dict[int, list[float]] = {}
    for t, ret in returns.items():
        by_group.setdefault(owner[t], []).append(round(ret, 4))
    flat = sum(len(set(v)) == 1 for v in by_group.values())
    success = rows["success"].reshape(-1)[rows["done"].reshape(-1)].float()
    succ_by_group: dict[int, list[float]] = {}
    for g, s in zip(group[rows["done"].reshape(-1)].tolist(), success.tolist()):
        succ_by_group.setdefault(g, []).append(s)
    same_outcome = sum(len(set(v)) == 1 for v in succ_by_group.values())
    adv = rows["advantage"].reshape(-1).float()
    return {"groups_equal_return": flat / max(len(by_group), 1),
            "groups_same_outcome": same_outcome / max(len(succ_by_group), 1),
            "rows_zero_advantage": float((adv.abs() < 1e-8).float().mean()),
            "advantage_abs_mean": float(adv.abs().mean())}


def moves_of(admissible: str) -> list[str]:
    """One game's admissible actions (the env's newline-joined ``admissible_actions``) as a list."""
    return [a for a in admissible.split("\n") if a]


def panel_env(task: str, episodes: int, overrides: Sequence[str] = ()):
    """The held-out panel of ``task`` as an env: its first ``episodes`` games, one per group (the
    eval split), of the game ``overrides`` (the benchmark's ``--set``) changed."""
    from torchrl_agent.envs import make_env

    cfg = compose_config([f"experiment=learning_{task}", *overrides])
    e = cfg.env
    kwargs = dict(e.kwargs)
    if e.max_steps is not None:
        kwargs["max_steps"] = e.max_steps
    return make_env(e.name, num_groups=episodes, group_size=1, seed=cfg.seed, split="eval", **kwargs)


def scripted_success(task: str, episodes: int, act, overrides: Sequence[str] = ()) -> float:
    """Held-out success of a policy that never reads the observation: ``act(admissible)`` (the
    step's admissible actions, a list) gives each step's action. ``overrides``: the benchmark's
    ``--set`` (a game changed there is the game these baselines play)."""
    env = panel_env(task, episodes, overrides)
    td = env.reset()
    won = torch.zeros(episodes, dtype=torch.bool)
    while not td["done"].all():
        td["action"] = [act(moves_of(adm)) for adm in td["admissible_actions"]]
        td = env.step(td)["next"]
        won |= td["success"].reshape(-1).bool()
    return float(won.float().mean())


def random_valid_success(task: str, episodes: int, seed: int = 0, overrides: Sequence[str] = ()) -> float:
    """Held-out success of a policy drawing an admissible action uniformly at random every step."""
    rng = random.Random(seed)
    return scripted_success(task, episodes, lambda admissible: rng.choice(admissible or [""]), overrides)


def constant_move_success(task: str, episodes: int, overrides: Sequence[str] = ()) -> dict[str, float]:
    """Held-out success of playing one move every step, per move (the moves admissible in the first
    panel game's first state): the best a policy blind to the state can do on a game whose moves
    need no state to be valid (NumberLine: the share of games whose target lies on that side)."""
    first = panel_env(task, 1, overrides).reset()
    moves = moves_of(first["admissible_actions"][0])
    return {move: scripted_success(task, episodes, lambda admissible, move=move: move, overrides) for move in moves}


def blind_ceiling(task: str, episodes: int, overrides: Sequence[str] = (), max_plans: int = 4096) -> dict | None:
    """The best held-out success of any open-loop plan (a fixed sequence of moves, one per step),
    every plan tried on the ``episodes``-game panel: the most a policy that cannot read the state can
    win. A memoryless policy whose prompt never changes (a vision task with its frame blanked)
    draws every step's move from one distribution: a mixture of such plans, so it wins no more.
    ``{"success": x, "plan": "- - ..."}``, or None where there are more than ``max_plans`` plans
    (moves ** max_steps) to try. On a game that draws from the seed whatever the answers
    (``vision``'s coins) every plan wins the random walk's share in expectation, and the best
    of them on the panel is above it by selection alone."""
    env = panel_env(task, episodes, overrides)
    moves = moves_of(env.reset()["admissible_actions"][0])
    horizon = env.max_steps
    if len(moves) ** horizon > max_plans:
        return None

    def outcomes(game, steps_left: int) -> np.ndarray:
        """Success (0/1) of every plan of ``steps_left`` moves from ``game``'s state, in
        ``itertools.product(moves, ...)`` order: a plan that ended early shares its prefix's outcome."""
        if steps_left == 0:
            return np.zeros(1)
        parts = []
        for move in moves:
            child = copy.deepcopy(game)
            _, _, done, success = child.step(move)
            parts.append(np.full(len(moves) ** (steps_left - 1), float(success)) if done
                         else outcomes(child, steps_left - 1))
        return np.concatenate(parts)

    game = env.games[0]
    wins = np.zeros(len(moves) ** horizon)
    for seed in env.group_seeds:  # the panel's games, one by one
        game.reset(seed)
        wins += outcomes(game, horizon)
    best = int(wins.argmax())
    plan = [moves[best // len(moves) ** k % len(moves)] for k in reversed(range(horizon))]
    return {"success": float(wins[best]) / len(env.group_seeds), "plan": " ".join(plan)}


def warm_start_moves(task: str, seed: int, args, max_prompts: int = 48) -> dict:
    """The warm-started policy's move distribution, before any RL: over up to ``max_prompts``
    distinct training prompts (states a random walk visits), the probability of each admissible
    move's full response, normalised over the admissible moves. ``move_prob_mean``: per move, the
    mean over prompts; ``state_dependence``: the mean total-variation distance between a prompt's
    distribution and that mean (0: the policy plays the same distribution whatever the state);
    ``valid_mass_mean``: the probability the responses of admissible moves hold together."""
    import tempfile

    from tensordict import TensorDict, lazy_stack
    from torchrl.envs.utils import step_mdp

    from torchrl_agent.envs.transforms.projection import resolve_format
    from torchrl_agent.trainers.warm_start import expert_response

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [o for o in overrides_for(task, "gigpo", seed, args) if not o.startswith(("run_dir=", "iterations="))]
        cfg = compose_config(overrides + [f"run_dir={tmp}", "iterations=0"])
        trainer = Trainer(cfg)
        trainer.warm_start()
        tok, rng = trainer.tokenizer, random.Random(seed)
        env = build_env(cfg, tok)
        prompts: dict[str, list[str]] = {}
        td = env.reset()
        while not td["done"].all() and len(prompts) < max_prompts:
            actions = []
            for i in range(env.batch_size[0]):
                moves = [m for m in td["admissible_actions"][i].split("\n") if m] or [""]
                if not td["done"][i].item() and moves != [""]:
                    prompts.setdefault(td[i]["text", "prompt"], moves)
                actions.append(rng.choice(moves))
            td["action"] = actions
            td = step_mdp(env.step(td))
        env.close()
        fmt, eos = resolve_format(cfg.env.action_format, cfg.env.name), tok.eos_token_id
        items, owners = [], []
        for k, (prompt, moves) in enumerate(list(prompts.items())[:max_prompts]):
            ids = torch.tensor(tok(prompt, add_special_tokens=False)["input_ids"])
            for move in moves:
                response = tok(expert_response(move, fmt, cfg.warm_start.think), add_special_tokens=False)["input_ids"]
                items.append(TensorDict({"tokens": {"prompt": ids, "response": torch.tensor(response + [eos])}}))
                owners.append((k, move))
        seq = [float(lp.sum()) for lp in trainer.scorer.recompute(trainer.model, lazy_stack(items))]
    per_prompt: dict[int, dict[str, float]] = {}
    for (k, move), lp in zip(owners, seq):
        per_prompt.setdefault(k, {})[move] = lp
    dists, valid = [], []
    for lps in per_prompt.values():
        top = max(lps.values())
        z = sum(math.exp(v - top) for v in lps.values())
        dists.append({m: math.exp(v - top) / z for m, v in lps.items()})
        valid.append(sum(math.exp(v) for v in lps.values()))
    moves = sorted({m for d in dists for m in d})
    mean = {m: statistics.fmean(d.get(m, 0.0) for d in dists) for m in moves}
    tv = [0.5 * sum(abs(d.get(m, 0.0) - mean[m]) for m in moves) for d in dists]
    return {"task": task, "seed": seed, "prompts": len(dists), "move_prob_mean": mean,
            "top_move_prob_mean": max(mean.values()), "state_dependence": statistics.fmean(tv),
            "valid_mass_mean": statistics.fmean(valid)}


def overrides_for(task: str, method: str, seed: int, args) -> list[str]:
    out = [f"experiment=learning_{task}", f"algorithm={method}", f"seed={seed}", "progress=false",
           f"run_dir={os.path.join(args.out, f'{task}_{method}_seed{seed}')}", *METHOD_SETTINGS.get(method, [])]
    if args.iterations is not None:
        out.append(f"iterations={args.iterations}")
    if args.quick:
        out += ["iterations=1", "eval_every=1", "env.eval_episodes=8", "env.num_groups=2", "env.group_size=4"]
        if compose_config([f"experiment=learning_{task}"]).warm_start.steps > 0:  # pretrained: none to shorten
            out.append("warm_start.steps=4")
    return out + list(args.set or [])


def start_over(run_dir: str) -> None:
    """Take ``run_dir``'s lock for this process (a live run there, say a second benchmark on the same
    ``--out``, is refused) and delete what an interrupted run of it left (``metrics.jsonl``,
    ``checkpoints/``): a run without its JSON starts again from the beginning (runs are deterministic
    per seed, so it gives what the interrupted one would have)."""
    RunDirLock(run_dir).acquire()  # the Trainer of this process then holds it already
    left = run_files(run_dir)
    if left:
        print(f"{run_dir}: an interrupted run, started again ({', '.join(p.name for p in left)} deleted)",
              file=sys.stderr, flush=True)
        for path in left:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def environment() -> dict:
    """What a run's numbers depend on besides the code and the seed: the versions of the packages on
    the numeric path and the CPU kernels torch picked. A seed gives the same run only where these
    match (the float results of the kernels, and so the sampled answers, differ across them)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0], "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    for package in ("torch", "transformers", "tokenizers", "tensordict", "torchrl", "numpy", "pillow"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    return out


def run_one(task: str, method: str, seed: int, args) -> dict:
    """One training run in this process; returns its curves, diagnostics and timings."""
    cfg = compose_config(overrides_for(task, method, seed, args))
    start_over(cfg.run_dir)
    t0 = time.perf_counter()
    trainer = LearningTrainer(cfg, diagnose=bool(args.diagnose))
    summary = trainer.train()
    wall = time.perf_counter() - t0
    iteration_s = [h["iteration_s"] for h in trainer.history if "iteration_s" in h]
    run = {"task": task, "method": method, "seed": seed, "environment": environment(), "panel": trainer.panel,
           "diagnostics": trainer.diagnostics, "wall_s": round(wall, 1),
           "rl_s_per_iteration": statistics.fmean(iteration_s) if iteration_s else None,
           "warm_start_loss": summary.get("warm_start_loss"),
           "train_success": [h.get("success") for h in trainer.history if "success" in h],
           # how far each update moved the policy, and whether the answers kept their format
           "approx_kl_max": [h.get("approx_kl_max") for h in trainer.history if "success" in h],
           "response_kl_max": [h.get("response_kl_max") for h in trainer.history if "success" in h],
           "train_action_valid": [h.get("action_valid") for h in trainer.history if "success" in h]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{task}_{method}_seed{seed}.json"), "w") as f:
        json.dump(run, f)
    first, last = trainer.panel[0], trainer.panel[-1]
    print(f"run {task} {method} seed={seed}: greedy {first['greedy']:.3f} -> {last['greedy']:.3f}, sampled "
          f"{first['sampled']:.3f} -> {last['sampled']:.3f}, {wall:.0f} s", file=sys.stderr, flush=True)
    return run


def _child(task: str, method: str, seed: int, args) -> dict:
    torch.set_num_threads(1)
    return run_one(task, method, seed, args)


def iterations_to(panel: list[dict], threshold: float, key: str = "greedy") -> int | None:
    """RL iterations until the panel first reaches ``threshold`` (0: the warm start alone did)."""
    return next((p["iteration"] for p in panel if p[key] >= threshold), None)


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.pstdev(values) if len(values) > 1 else 0.0)


def summarize(runs: list[dict], threshold: float) -> dict:
    """The ``M`` object of one task and method (over seeds). ``reached_threshold`` counts the seeds
    whose FINAL evaluation is at or above ``threshold`` (a policy that reached it and fell back does
    not count); ``ever_reached_threshold`` counts those that reached it at any evaluation."""
    runs = sorted(runs, key=lambda r: r["seed"])
    out: dict = {"seeds": [r["seed"] for r in runs]}
    for key, suffix in (("greedy", ""), ("sampled", "_sampled")):
        start = [r["panel"][0][key] for r in runs]
        final = [r["panel"][-1][key] for r in runs]
        gain = [f - s for f, s in zip(final, start)]
        out[f"after_warm_start{suffix}"] = start  # per seed, in the order of "seeds"
        out[f"finals{suffix}"] = final
        out[f"after_warm_start_mean{suffix}"], out[f"after_warm_start_std{suffix}"] = mean_std(start)
        out[f"final_mean{suffix}"], out[f"final_std{suffix}"] = mean_std(final)
        out[f"rl_gain_mean{suffix}"], out[f"rl_gain_std{suffix}"] = mean_std(gain)
        reached = [iterations_to(r["panel"], threshold, key) for r in runs]
        hit = [x for x in reached if x is not None]
        out[f"iterations_to_threshold{suffix}"] = reached
        # mean over the seeds that reached it, with how many did; null if none did
        out[f"iterations_to_threshold_mean{suffix}"] = statistics.fmean(hit) if hit else None
        out[f"ever_reached_threshold{suffix}"] = len(hit)
        out[f"reached_threshold{suffix}"] = sum(f >= threshold for f in final)
    # per seed, how soon and how steadily it got there (finals alone tie where every method solves
    # the task): the greedy panel's mean over the RL evaluations (point 0 left out), and the sampled
    # training success's mean over every iteration
    out["curve_means"] = [statistics.fmean(p["greedy"] for p in r["panel"][1:]) if len(r["panel"]) > 1 else None
                          for r in runs]
    out["train_success_means"] = [statistics.fmean(r["train_success"]) if r.get("train_success") else None
                                  for r in runs]
    out["runs"] = len(runs)
    for name, i in (("after_warm_start", 0), ("final", -1)):  # does the greedy policy read the game?
        out[f"top_plan_share_{name}_mean"] = statistics.fmean(r["panel"][i]["top_plan_share"] for r in runs)
        out[f"distinct_plans_{name}_mean"] = statistics.fmean(r["panel"][i]["distinct_plans"] for r in runs)
    per_it = [r["rl_s_per_iteration"] for r in runs if r["rl_s_per_iteration"]]
    s_per_it = statistics.fmean(per_it) if per_it else None
    out["rl_s_per_iteration"] = s_per_it
    out["wall_s_to_threshold_mean"] = (out["iterations_to_threshold_mean"] * s_per_it
                                       if out["iterations_to_threshold_mean"] is not None and s_per_it else None)
    out["wall_s_mean"] = statistics.fmean(r["wall_s"] for r in runs)
    its = sorted({p["iteration"] for r in runs for p in r["panel"]})
    out["curve"] = []
    for it in its:
        g = [p["greedy"] for r in runs for p in r["panel"] if p["iteration"] == it]
        s = [p["sampled"] for r in runs for p in r["panel"] if p["iteration"] == it]
        out["curve"].append({"iteration": it, "greedy_mean": mean_std(g)[0], "greedy_std": mean_std(g)[1],
                             "sampled_mean": mean_std(s)[0], "sampled_std": mean_std(s)[1], "n": len(g)})
    # the largest per-step approx_kl of any update of any seed, per seed; the lowest training
    # action_valid after the warm start (runs made before these were recorded: null)
    kl = [max((k for k in r.get("approx_kl_max", []) if k is not None), default=None) for r in runs]
    out["approx_kl_max_per_seed"] = kl
    out["approx_kl_max"] = max((k for k in kl if k is not None), default=None)
    out["min_train_action_valid_per_seed"] = [min((v for v in r.get("train_action_valid", []) if v is not None),
                                                  default=None) for r in runs]
    diag = [d for r in runs for d in r["diagnostics"]]
    if diag:
        out["diagnostics_mean"] = {k: statistics.fmean(d[k] for d in diag if k in d)
                                   for k in diag[0] if k != "iteration"}
    return out


# two-sided 97.5% quantiles of Student's t for n - 1 = 1..30 degrees of freedom (a 95% interval)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def paired_comparison(a: dict[int, float], b: dict[int, float], *, resamples: int = 10000,
                      seed: int = 0) -> dict:
    """``a - b`` paired over the seeds both hold (a seed's warm start is the same for both methods).

    Returns the per-seed differences, their mean, a 95% t interval and a 95% percentile bootstrap
    interval of the mean, the two-sided p-value of an exact (n <= 16) or sampled sign-flip
    permutation test, and ``within_noise``: True when the t interval holds 0."""
    seeds = sorted(set(a) & set(b))
    diff = [a[s] - b[s] for s in seeds]
    n = len(diff)
    out: dict = {"seeds": seeds, "differences": diff, "n": n}
    if n < 2:
        return {**out, "mean_difference": diff[0] if diff else None, "t_ci95": None, "bootstrap_ci95": None,
                "permutation_p": None, "within_noise": True}
    mean = statistics.fmean(diff)
    half = (_T975[n - 2] if n - 2 < len(_T975) else 1.96) * statistics.stdev(diff) / math.sqrt(n)
    rng = random.Random(seed)
    boot = sorted(statistics.fmean(rng.choices(diff, k=n)) for _ in range(resamples))
    observed = abs(mean)
    if n <= 16:  # every sign pattern
        flips = [[(1 if (m >> i) & 1 else -1) for i in range(n)] for m in range(2 ** n)]
    else:
        flips = [[rng.choice((1, -1)) for _ in range(n)] for _ in range(resamples)]
    extreme = sum(abs(statistics.fmean(f * d for f, d in zip(signs, diff))) >= observed - 1e-12 for signs in flips)
    return {**out, "mean_difference": mean, "t_ci95": [mean - half, mean + half],
            "bootstrap_ci95": [boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]],
            "permutation_p": extreme / len(flips), "within_noise": mean - half <= 0.0 <= mean + half}


#: What :func:`compare_methods` pairs, and how the markdown names it.
COMPARED = {"finals": "final greedy", "finals_sampled": "final T=0.4",
            "curve_means": "greedy panel's mean over the RL evaluations",
            "train_success_means": "training success's mean over the iterations"}


def compare_methods(methods: dict[str, dict], first: str = "gigpo", second: str = "grpo") -> dict | None:
    """``first`` minus ``second`` (default GiGPO minus GRPO) per seed, on the final evaluation (greedy
    and sampled) and on how soon and how steadily it got there (``curve_means``,
    ``train_success_means``: :func:`summarize`), paired over the seeds both finished
    (:func:`paired_comparison`; a seed without the value, an old run's JSON, is left out)."""
    if first not in methods or second not in methods:
        return None
    a, b = methods[first], methods[second]
    out: dict = {"difference": f"{first} - {second}"}
    for key in COMPARED:
        if key in a and key in b:
            out[key] = paired_comparison({s: x for s, x in zip(a["seeds"], a[key]) if x is not None},
                                         {s: x for s, x in zip(b["seeds"], b[key]) if x is not None})
    return out


def _fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def results_markdown(result: dict) -> str:
    """The results tables of docs/learning.md, from the benchmark's JSON (one table per task)."""
    lines: list[str] = []
    for task, info in result["tasks"].items():
        ws = info.get("warm_start_only") or {}
        constant = info.get("constant_move_success") or {}
        best = max(constant, key=constant.get, default=None)
        lines += [f"**{task}** (threshold {info['threshold']}; random valid policy "
                  f"{_fmt(info['random_policy_success'], 3)}; "
                  + (f"the best constant move ({best!r}, on the panel) {_fmt(constant[best], 3)}; " if best else "")
                  + (f"the best open-loop plan {_fmt(info['blind_ceiling']['success'], 3)}; "
                     if info.get("blind_ceiling") else "")
                  + f"warm start only, greedy / T=0.4: "
                  f"{_fmt(ws.get('greedy_mean'))} / {_fmt(ws.get('sampled_mean'))})", "",
                  "| method | seeds | after warm start (greedy) | final greedy, mean ± std | final T=0.4 | "
                  "RL gain (greedy) | final >= threshold | largest approx_kl of an update | per-seed final (greedy) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for method, m in info["methods"].items():
            lines.append(
                f"| {method} | {len(m['seeds'])} | {_fmt(m['after_warm_start_mean'])} | "
                f"{_fmt(m['final_mean'])} ± {_fmt(m['final_std'])} | {_fmt(m['final_mean_sampled'])} | "
                f"{m['rl_gain_mean']:+.2f} ± {_fmt(m['rl_gain_std'])} | {m['reached_threshold']} of {m['runs']} | "
                f"{_fmt(m.get('approx_kl_max'), 3)} | " + ", ".join(f"{f:.2f}" for f in m["finals"]) + " |")
        pairs = [("GiGPO - GRPO", info.get("gigpo_vs_grpo"))] + [
            (f"{m} - GiGPO", c) for m, c in (info.get("vs_gigpo") or {}).items() if m != "grpo"]
        for name, cmp_ in pairs:
            if not cmp_:
                continue
            for key, label in COMPARED.items():
                c = cmp_.get(key)
                if c is None or c["t_ci95"] is None:
                    continue
                verdict = "within noise" if c["within_noise"] else "outside noise"
                lines.append(f"\n{name}, {label}, paired over {c['n']} seeds: {c['mean_difference']:+.3f} "
                             f"(95% t interval [{c['t_ci95'][0]:+.3f}, {c['t_ci95'][1]:+.3f}], bootstrap "
                             f"[{c['bootstrap_ci95'][0]:+.3f}, {c['bootstrap_ci95'][1]:+.3f}], sign-flip "
                             f"permutation p = {c['permutation_p']:.3f}): {verdict}.")
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(result["tasks"])
    fig, axes = plt.subplots(1, 2 * len(tasks), figsize=(4.2 * 2 * len(tasks), 3.4), squeeze=False)
    for i, task in enumerate(tasks):
        info = result["tasks"][task]
        for j, (key, label) in enumerate((("greedy", "greedy"), ("sampled", "sampled"))):
            ax = axes[0][2 * i + j]
            for method, m in info["methods"].items():
                xs = [p["iteration"] for p in m["curve"]]
                mu = [p[f"{key}_mean"] for p in m["curve"]]
                sd = [p[f"{key}_std"] for p in m["curve"]]
                ax.plot(xs, mu, marker="o", label=f"{method} ({len(m['seeds'])} seeds)")
                ax.fill_between(xs, [a - b for a, b in zip(mu, sd)], [a + b for a, b in zip(mu, sd)], alpha=0.2)
            ax.axhline(info["random_policy_success"], color="grey", ls=":", label="random valid policy")
            if info.get("constant_move_success"):
                ax.axhline(max(info["constant_move_success"].values()), color="grey", ls="--",
                           label="best constant move")
            ax.set_title(f"{task}: held-out success, {label}")
            ax.set_xlabel("RL iteration (0 = after the warm start)")
            ax.set_ylim(-0.02, 1.02)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Sokoban is opt-in: at 70-200 s an iteration on 2 shared cores its 5 x 2 runs do not fit the budget
    parser.add_argument("--tasks", nargs="+", default=["numberline", "babyai"], choices=list(TASKS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(10)))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=None, help="default: the experiment config's")
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--out", default="runs/learning")
    parser.add_argument("--plot", default=None, help="default: OUT/learning_curves.png")
    parser.add_argument("--markdown", default=None, help="also write the results tables (Markdown) to this file")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--warm-start-moves", default=None, metavar="TASK",
                        help="per seed, the warm-started policy's move distribution (no RL), one JSON line each")
    parser.add_argument("--diagnose", default=None, metavar="TASK")
    parser.add_argument("--set", nargs="*", default=[], help="extra config overrides for every run")
    parser.add_argument("--report", action="store_true", help="run nothing: summarise the finished runs in --out")
    args = parser.parse_args()
    if args.warm_start_moves:
        torch.set_num_threads(1)
        for seed in args.seeds:
            print(json.dumps(warm_start_moves(args.warm_start_moves, seed, args)), flush=True)
        return
    if args.diagnose:
        torch.set_num_threads(1)
        run = run_one(args.diagnose, "grpo", args.seeds[0], args)
        for d in run["diagnostics"]:
            print("diag " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}))
        print(json.dumps({"task": args.diagnose, "panel": run["panel"], "train_success": run["train_success"],
                          "wall_s": run["wall_s"], "rl_s_per_iteration": run["rl_s_per_iteration"]}))
        return
    if args.quick:
        args.tasks, args.seeds = args.tasks[:1], args.seeds[:1]
    t0 = time.perf_counter()
    random_success = {t: random_valid_success(t, 8 if args.quick else 256, overrides=args.set or ()) for t in args.tasks}
    # on the evaluation panel itself (its games, not 256): the evaluations' blind ceiling
    constant_success = {t: constant_move_success(t, compose_config(overrides_for(t, args.methods[0], 0, args)).env.eval_episodes,
                                                  args.set or ())
                        for t in args.tasks}
    blind = {t: blind_ceiling(t, compose_config(overrides_for(t, args.methods[0], 0, args)).env.eval_episodes,
                              args.set or ())
             for t in args.tasks}
    jobs = [(t, m, s) for t in args.tasks for s in args.seeds for m in args.methods]
    runs: list[dict] = []
    if not args.quick:  # a finished run (its JSON in --out) is reused: an interrupted benchmark resumes
        for t, m, s in list(jobs):
            path = os.path.join(args.out, f"{t}_{m}_seed{s}.json")
            if os.path.exists(path):
                with open(path) as f:
                    runs.append(json.load(f))
                jobs.remove((t, m, s))
    if args.report:
        for t, m, s in jobs:
            print(f"not finished: {t} {m} seed {s} (no {t}_{m}_seed{s}.json in {args.out})", file=sys.stderr)
        jobs = []
    ctx = multiprocessing.get_context("spawn")
    failed: list[tuple] = []
    # the runs end with this process, however it ends (a killed benchmark leaves no run behind)
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx, max_tasks_per_child=1,
                                                initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        futures = {pool.submit(_child, t, m, s, args): (t, m, s) for t, m, s in jobs}
        for f in concurrent.futures.as_completed(futures):
            try:
                runs.append(f.result())
            except Exception:  # said now, not when the other runs are done; the others go on
                failed.append(futures[f])
                print(f"run {' '.join(map(str, futures[f]))} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    result: dict = {"tasks": {}}
    for task in args.tasks:
        by_method = {m: [r for r in runs if r["task"] == task and r["method"] == m] for m in args.methods}
        result["tasks"][task] = {
            "random_policy_success": random_success[task], "constant_move_success": constant_success[task],
            "blind_ceiling": blind[task],
            "threshold": args.threshold, "methods": {m: summarize(finished, args.threshold) for m, finished in by_method.items() if finished},
        }
        info = result["tasks"][task]
        if not info["methods"]:  # --report before any run of this task finished
            continue
        first = max(info["methods"].values(), key=lambda m: m["runs"])  # the method with the most seeds
        # the warm start alone (RL iteration 0): the same weights for every method of a seed
        # the environments the runs were made in (older JSONs have none): one, or the seeds may not match a rerun
        envs = [r["environment"] for r in runs if r["task"] == task and r.get("environment")]
        info["environments"] = [e for i, e in enumerate(envs) if e not in envs[:i]]
        info["warm_start_only"] = {"seeds": first["seeds"], "greedy": first["after_warm_start"],
                                   "sampled": first["after_warm_start_sampled"],
                                   "greedy_mean": first["after_warm_start_mean"],
                                   "sampled_mean": first["after_warm_start_mean_sampled"]}
        info["gigpo_vs_grpo"] = compare_methods(info["methods"])
        # every other method against GiGPO (issue 34: hgpo, graphgpo), paired the same way
        info["vs_gigpo"] = {m: compare_methods(info["methods"], m, "gigpo") for m in info["methods"]
                            if m != "gigpo" and "gigpo" in info["methods"]}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["jobs"] = args.jobs
    path = args.plot or os.path.join(args.out, "learning_curves.png")
    plot(result, path)
    result["plot"] = path
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(results_markdown(result))
    print(json.dumps(result))
    if failed:  # the finished runs are summarised above; the exit status says that some are missing
        sys.exit(f"{len(failed)} run(s) failed: " + ", ".join(f"{t} {m} seed {s}" for t, m, s in failed))


if __name__ == "__main__":
    main()

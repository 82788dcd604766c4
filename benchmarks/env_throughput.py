"""Environment throughput: game steps per second, in process and in worker processes.

For every registered environment (``alfworld`` and ``search`` are listed as unavailable when their
optional dependencies or data are missing), a batch of ``groups * group_size`` games is stepped for
``--seconds`` seconds four ways: the bare games (``TextGame.step`` called directly, no TorchRL:
the games' own cost), in the main process (``num_workers=0``), with 1 worker process,
and with ``N = os.cpu_count()`` workers. Actions: the expert's where the game has one, else a
random admissible action (else a random string); finished games are reset, as a collector does.
Only the time spent inside ``env.step`` / ``env.reset`` counts.

Prints one line per measurement, then one JSON object as the LAST line::

    python benchmarks/env_throughput.py [--seconds 1.2] [--groups 8] [--group-size 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torchrl_agent.envs import make_env  # noqa: E402

ENVS = ("numberline", "ezpoints", "points24", "blackjack", "sokoban", "babyai", "alfworld", "search", "webshop",
        "appworld")

#: AppWorld's games are worker processes already (one AppWorld world each, ~10 s to start): a batch of
#: 2 in process, no extra worker-pool modes; each step runs one real API call in its sandbox.
BATCH_OVERRIDES = {"appworld": (1, 2)}
IN_PROCESS_ONLY = {"appworld"}
ACTION_OVERRIDES = {"appworld": "print(apis.supervisor.show_profile())"}


def _actions(td, rng: np.random.Generator, name: str = "") -> list[str]:
    if name in ACTION_OVERRIDES:
        return [ACTION_OVERRIDES[name]] * td.batch_size[0]
    out = []
    for expert, admissible in zip(td["expert_action"], td["admissible_actions"]):
        options = [a for a in admissible.split("\n") if a]
        if expert:
            out.append(expert)
        elif options:
            out.append(options[int(rng.integers(len(options)))])
        else:
            out.append(f"random action {int(rng.integers(1000))}")
    return out


def measure(name: str, num_workers: int, seconds: float, groups: int, group_size: int) -> dict:
    start = time.perf_counter()
    env = make_env(name, num_groups=groups, group_size=group_size, seed=0, num_workers=num_workers)
    startup = time.perf_counter() - start
    rng = np.random.default_rng(0)
    try:
        env_time, steps, resets = 0.0, 0, 0
        t0 = time.perf_counter()
        td = env.reset()
        first_reset = time.perf_counter() - t0  # reported apart: AppWorld opens its worlds here (seconds)
        while env_time < seconds:
            running = int((~td["done"]).sum()) if "done" in td.keys() else td.batch_size[0]
            td.set("action", _actions(td, rng, name))
            t0 = time.perf_counter()
            td = env.step(td)["next"]
            done = td["done"].clone()
            if done.any():
                td = env.reset(td.clone().set("_reset", done))
                resets += int(done.sum())
            env_time += time.perf_counter() - t0
            steps += running
        return {"steps_per_s": round(steps / env_time, 1), "steps": steps, "episodes": resets,
                "startup_s": round(startup, 2), "first_reset_s": round(first_reset, 2)}
    finally:
        env.close()


def measure_games_only(name: str, seconds: float, groups: int, group_size: int) -> dict:
    """The games' own speed: ``TextGame.step`` called directly, no TensorDict, one process."""
    env = make_env(name, num_groups=groups, group_size=group_size, seed=0)
    rng = np.random.default_rng(0)
    games, steps, episodes, elapsed = env.games, 0, 0, 0.0
    states = [game.reset(2 * k) for k, game in enumerate(games)]  # not timed, as in measure()
    counts = [0] * len(games)
    while elapsed < seconds:
        for k, game in enumerate(games):
            state = states[k]
            options = [a for a in state.admissible_actions if a]
            action = ACTION_OVERRIDES.get(name) or state.expert_action or (
                options[int(rng.integers(len(options)))] if options else "noop")
            t0 = time.perf_counter()
            state, _, terminated, _ = game.step(action)
            counts[k] += 1
            if terminated or counts[k] >= env.max_steps:
                state, counts[k] = game.reset(2 * int(rng.integers(2**40))), 0
                episodes += 1
            elapsed += time.perf_counter() - t0
            states[k] = state
            steps += 1
    env.close()
    return {"steps_per_s": round(steps / elapsed, 1), "steps": steps, "episodes": episodes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.2, help="measured env time per configuration")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--envs", nargs="*", default=list(ENVS))
    args = parser.parse_args()
    cpus = os.cpu_count() or 1
    modes = {"in_process": 0, "workers_1": 1, f"workers_{cpus}": cpus}
    results, unavailable = {}, {}
    begin = time.perf_counter()
    for name in args.envs:
        try:
            make_env(name, num_groups=1, group_size=1, seed=0).close()
        except Exception as err:  # ImportError, missing data, ...: listed, not measured
            unavailable[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            print(f"{name:>10}: unavailable ({unavailable[name]})", flush=True)
            continue
        groups, group_size = BATCH_OVERRIDES.get(name, (args.groups, args.group_size))
        results[name] = {"games_only": measure_games_only(name, args.seconds, groups, group_size)}
        print(f"{name:>10} {'games_only':>12}: {results[name]['games_only']}", flush=True)
        for mode, workers in modes.items():
            if workers and name in IN_PROCESS_ONLY:
                continue
            results[name][mode] = measure(name, workers, args.seconds, groups, group_size)
            print(f"{name:>10} {mode:>12}: {results[name][mode]}", flush=True)
    summary = {
        "benchmark": "env_throughput",
        "metric": "game steps per second (env.step + env.reset time only)",
        "batch_size": args.groups * args.group_size,
        "batch_overrides": {name: g * n for name, (g, n) in BATCH_OVERRIDES.items()},
        "cpu_count": cpus,
        "seconds_per_config": args.seconds,
        "policy": "expert action where one exists, else a random admissible action",
        "steps_per_s": {name: {mode: r["steps_per_s"] for mode, r in res.items()} for name, res in results.items()},
        "details": results,
        "unavailable": unavailable,
        "wall_s": round(time.perf_counter() - begin, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

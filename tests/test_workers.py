"""ParallelTextEnv: same output as the single-process env, and recovery from real worker faults."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from torchrl.envs.utils import check_env_specs

from torchrl_agent.envs import GameState, TextEnv, TextGame, make_env
from torchrl_agent.envs.workers import ParallelTextEnv

COMPARED = ("task", "observation", "admissible_actions", "expert_action", "task_type")
TENSORS = ("anchor", "step_count", "success", "done", "terminated", "truncated")


def _strings(td, key):
    return list(td[key])


def _assert_same(a, b, indices=None):
    indices = list(range(a.batch_size[0])) if indices is None else list(indices)
    for key in COMPARED:
        assert [_strings(a, key)[i] for i in indices] == [_strings(b, key)[i] for i in indices], key
    for key in TENSORS + (("reward",) if "reward" in a.keys() else ()):
        assert torch.equal(a[key][indices], b[key][indices]), key


class FaultyGame(TextGame):
    """A counter game that hangs on ``"hang"`` and raises on ``"raise"`` (to inject real faults)."""

    def reset(self, seed: int) -> GameState:
        self.seed, self.count = seed, 0
        return GameState(f"seed {seed} count 0", task="count")

    def step(self, action: str):
        if action == "hang":
            time.sleep(3600)
        if action == "raise":
            raise RuntimeError("a bug in the game")
        self.count += 1
        return GameState(f"seed {self.seed} count {self.count}", task="count"), 1.0, self.count >= 3, self.count >= 3


def faulty_env(**kwargs) -> TextEnv:
    return TextEnv(FaultyGame, **kwargs)


@pytest.mark.parametrize("name,split", [("sokoban", "train"), ("ezpoints", "eval"), ("blackjack", "train")])
def test_matches_single_process(name, split):
    kwargs = dict(num_groups=3, group_size=2, seed=7, split=split)
    single = make_env(name, **kwargs)
    parallel = make_env(name, num_workers=2, **kwargs)
    try:
        assert isinstance(parallel, ParallelTextEnv) and parallel.num_workers == 2
        a, b = single.reset(), parallel.reset()
        _assert_same(a, b)
        assert not b["worker_fault"].any()
        rng = np.random.default_rng(0)
        for _ in range(12):
            options = _strings(a, "admissible_actions")[0].split("\n") + ["garbage", ""]
            actions = [options[int(k)] for k in rng.integers(len(options), size=6)]
            a = single.step(a.set("action", actions))["next"]
            b = parallel.step(b.set("action", actions))["next"]
            _assert_same(a, b)
            if a["done"].any():  # partial reset of the finished games, as a collector does
                mask = a["done"].clone()
                a = single.reset(a.clone().set("_reset", mask))
                b = parallel.reset(b.clone().set("_reset", mask))
                _assert_same(a, b)
        assert single.group_seeds == parallel.group_seeds
    finally:
        parallel.close()


def test_check_env_specs_and_bad_input():
    env = make_env("points24", num_groups=2, group_size=2, seed=0, num_workers=2)
    try:
        check_env_specs(env)
        assert "worker_fault" in env.observation_spec.keys()
        td = env.reset()
        td["action"] = ["x" * 20_000, "\ud800\x00", "", "( ( ("]
        td = env.step(td)["next"]
        assert not td["worker_fault"].any() and env.num_restarts == 0
    finally:
        env.close()
    with pytest.raises(ValueError, match="num_workers"):
        ParallelTextEnv("numberline", num_workers=0)
    with pytest.raises(KeyError, match="no_such_env"):
        ParallelTextEnv("no_such_env", num_workers=1)
    with pytest.raises(RuntimeError, match="failed to start"):
        ParallelTextEnv("sokoban", num_workers=1, num_boxes=0)


def test_killed_worker_is_restarted():
    kwargs = dict(num_groups=2, group_size=2, seed=3)
    env = make_env("sokoban", num_workers=2, **kwargs)
    single = make_env("sokoban", **kwargs)
    try:
        a, b = single.reset(), env.reset()
        a = single.step(a.set("action", ["up"] * 4))["next"]
        b = env.step(b.set("action", ["up"] * 4))["next"]
        victim = env.worker_pids[1]  # holds games 2 and 3
        os.kill(victim, signal.SIGKILL)
        a = single.step(a.set("action", ["left"] * 4))["next"]
        b = env.step(b.set("action", ["left"] * 4))["next"]
        assert b["worker_fault"].squeeze(-1).tolist() == [False, False, True, True]
        assert b["truncated"].squeeze(-1).tolist() == [False, False, True, True]
        assert b["done"][2:].all() and (b["reward"][2:] == 0).all()
        _assert_same(a, b, [0, 1])  # the other worker's games kept their data
        # (the fault shows as a failed send or as a death, depending on when the kill lands)
        assert env.num_restarts == 1 and env.worker_pids[1] != victim and env.fault_log[-1].startswith("worker 1")
        # the lost games restart from their group's seed, as in the single-process env
        mask = torch.tensor([[False], [False], [True], [True]])
        a = single.reset(a.clone().set("_reset", mask))
        b = env.reset(b.clone().set("_reset", mask))
        assert _strings(b, "observation")[2:] == _strings(a, "observation")[2:]
        assert not b["worker_fault"].any() and not b["done"][2:].any()
        # a worker killed while idle is noticed at the next call
        os.kill(env.worker_pids[0], signal.SIGKILL)
        b = env.step(b.set("action", ["down"] * 4))["next"]
        assert b["worker_fault"].squeeze(-1).tolist() == [True, True, False, False]
        assert env.num_restarts == 2
        td = env.reset()
        assert not td["done"].any() and not td["worker_fault"].any()
    finally:
        env.close()


def test_hanging_worker_times_out_and_raising_game_is_isolated():
    env = ParallelTextEnv(faulty_env, num_workers=2, num_groups=2, group_size=2, seed=1, timeout=2.0, max_steps=10)
    try:
        td = env.reset()
        seeds = env.group_seeds
        td = env.step(td.set("action", ["go"] * 4))["next"]
        assert _strings(td, "observation") == [f"seed {seeds[i // 2]} count 1" for i in range(4)]
        hung = env.worker_pids[0]  # holds games 0 and 1
        td = env.step(td.set("action", ["hang", "go", "go", "go"]))["next"]
        assert td["worker_fault"].squeeze(-1).tolist() == [True, True, False, False]
        assert td["truncated"].squeeze(-1).tolist() == [True, True, False, False]
        assert _strings(td, "observation")[:2] == [f"seed {seeds[0]} count 1"] * 2  # last state kept
        assert _strings(td, "observation")[2:] == [f"seed {seeds[1]} count 2"] * 2
        assert td["reward"].squeeze(-1).tolist() == [0.0, 0.0, 1.0, 1.0]
        assert env.num_restarts == 1 and "no answer" in env.fault_log[-1]
        time.sleep(0.1)
        with pytest.raises(ProcessLookupError):
            os.kill(hung, 0)  # the hung process is gone
        # a game that raises ends alone; its worker keeps running
        td = env.step(td.set("action", ["go", "go", "raise", "go"]))["next"]
        assert td["worker_fault"].squeeze(-1).tolist() == [False, False, True, False]
        assert td["done"].squeeze(-1).tolist() == [True, True, True, True]  # game 3 reached count 3
        assert td["success"].squeeze(-1).tolist() == [False, False, False, True]
        assert env.num_restarts == 1 and "a bug in the game" in env.fault_log[-1]
        td = env.reset()
        assert _strings(td, "observation")[0].endswith("count 0") and not td["worker_fault"].any()
    finally:
        env.close()
    assert all(not w.process for w in env._workers)


def test_spawn_start_method_matches():
    kwargs = dict(num_groups=2, group_size=2, seed=1)
    env = ParallelTextEnv("numberline", num_workers=1, mp_start_method="spawn", **kwargs)
    try:
        _assert_same(make_env("numberline", **kwargs).reset(), env.reset())
    finally:
        env.close()

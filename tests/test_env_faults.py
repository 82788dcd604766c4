"""Env and worker faults cost only their episodes: a game that raises or returns a non-finite
reward, a worker process killed mid-collection, a retrieval server that is down, hangs or answers
garbage. The faulted episodes are left out of training (``batching.drop_faulted``) and counted.
Every fault is caused for real."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from torchrl_agent.envs import register_env
from torchrl_agent.envs.base import TextEnv
from torchrl_agent.envs.games.numberline import NumberLineGame
from torchrl_agent.trainers.cli import compose_config, main

SMALL = ["experiment=smoke", "iterations=2", "eval_every=0", "env.num_groups=2", "env.group_size=2", "env.eval_episodes=2",
         "env.max_steps=3", "rollout.max_new_tokens=6", "progress=false", "algorithm.kl_coef=0", "warm_start.steps=0"]


class FaultyNumberLine(NumberLineGame):
    """NumberLine whose first game object raises at its second step (a crashed simulator)."""

    counter = itertools.count()

    def __init__(self):
        super().__init__()
        self.index = next(self.counter)

    def step(self, action):
        if self.index == 0 and getattr(self, "_steps", 0) == 1:
            raise RuntimeError("simulator crashed")
        self._steps = getattr(self, "_steps", 0) + 1
        return super().step(action)

    def reset(self, seed):
        self._steps = 0
        return super().reset(seed)


def _faulty_env(**kwargs):
    FaultyNumberLine.counter = itertools.count()
    return TextEnv(FaultyNumberLine, **{"max_steps": 3, **kwargs})


register_env("faulty_numberline", _faulty_env)


def test_a_game_that_raises_ends_only_its_episode():
    env = _faulty_env(num_groups=1, group_size=3)
    env.reset()
    for _ in range(2):
        out = env.step(TensorDict({"action": ["+"] * 3}, batch_size=[3]))["next"]
    assert out["env_fault"].squeeze(-1).tolist() == [True, False, False]
    assert out["truncated"].squeeze(-1).tolist()[0] and out["done"].squeeze(-1).tolist()[0]
    assert "simulator crashed" in env.fault_log[-1]


def _rows(group, traj, fault_key="env_fault", faulted=()):
    n = len(group)
    fault = torch.tensor([t in faulted for t in traj]).reshape(n, 1)
    return TensorDict({"group_id": torch.tensor(group), "traj_id": torch.tensor(traj), fault_key: fault,
                       "reward": torch.arange(n, dtype=torch.float32).reshape(n, 1)}, batch_size=[n])


def test_faulted_episodes_are_left_out_and_small_groups_dropped():
    from torchrl_agent.trainers.batching import drop_faulted

    # group 0: trajectories 0,1,2 (1 faulted: normalised over 0 and 2); group 1: 3,4 (4 faulted: dropped)
    rows = _rows([0, 0, 0, 0, 1, 1, 1], [0, 0, 1, 2, 3, 4, 4], faulted=(1, 4))
    kept, counts = drop_faulted(rows)
    assert kept["traj_id"].tolist() == [0, 0, 2]
    assert counts == {"env_faults": 2, "fault_rows_dropped": 4, "fault_groups_dropped": 1}
    kept, counts = drop_faulted(_rows([0, 0], [0, 1], "worker_fault", faulted=(0, 1)))
    assert kept is None and counts["env_faults"] == 2
    assert counts["fault_groups_dropped"] == 1  # a group whose every episode faulted is dropped too
    # group 0 loses all of its episodes, group 1 one of three (normalised over the other two)
    kept, counts = drop_faulted(_rows([0, 0, 1, 1, 1], [0, 1, 2, 3, 4], faulted=(0, 1, 3)))
    assert kept["traj_id"].tolist() == [2, 4] and counts["fault_groups_dropped"] == 1


def test_training_with_a_crashing_game_completes_and_counts_the_fault(tmp_path):
    from torchrl_agent.trainers import Trainer

    trainer = Trainer(compose_config([*SMALL, "env.name=faulty_numberline", "env.group_size=3", "iterations=1",
                                      f"run_dir={tmp_path}"]))
    summary = trainer.train()
    assert summary["iterations"] == 1
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["env_faults"] == 1 and records[0]["fault_rows_dropped"] >= 2  # the faulted episode's rows
    assert records[0]["fault_groups_dropped"] == 0 and "loss" in records[0]


def test_a_worker_killed_mid_collection_costs_only_its_episodes(tmp_path):
    """env.num_workers: a worker process is killed (SIGKILL) while the batch is collected."""

    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.batching import drop_faulted

    trainer = Trainer(compose_config([*SMALL, "env.num_workers=2", "env.max_steps=6", "iterations=1",
                                      f"run_dir={tmp_path}"]))
    base = trainer.env.base_env
    original = base._step
    calls = itertools.count()

    def step_then_kill(td):
        if next(calls) == 1:  # the second step of the batch
            os.kill(base.worker_pids[1], signal.SIGKILL)
            time.sleep(0.2)
        return original(td)

    base._step = step_then_kill
    rows = trainer.collector.collect()
    assert base.num_restarts == 1 and rows["worker_fault"].any()
    kept, counts = drop_faulted(rows)
    assert counts["env_faults"] >= 1 and not kept["worker_fault"].any()
    assert kept.batch_size[0] + counts["fault_rows_dropped"] == rows.batch_size[0]
    trainer.env.close()


# ----------------------------------------------------------------------------------- retrieval server faults
def _serve(handler_cls):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/retrieve"


def _stop(server):
    server.shutdown()
    server.server_close()


class _Retrieval(BaseHTTPRequestHandler):
    """A retrieval server whose behaviour is the class attribute ``mode``."""

    mode = "ok"

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = type(self).mode
        if mode == "hang":
            time.sleep(3)
            return
        if mode == "garbage":
            body = b"\xff\xfe<html>not json"
        elif mode == "wrong_shape":
            body = json.dumps({"result": "nothing"}).encode()
        else:
            doc = {"document": {"contents": "Mongolia\nUlaanbaatar is the capital."}, "score": 1.0}
            body = json.dumps({"result": [[doc] for _ in request["queries"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _search_env(url, **kwargs):
    from torchrl_agent.envs.search import SearchEnv, SearchQuestion

    q = SearchQuestion("q1", "What is the capital of Mongolia?", ("Ulaanbaatar",))
    return SearchEnv(questions=[q], retriever=url, retriever_timeout=0.5, retriever_retries=1,
                     **{"num_groups": 1, "group_size": 2, **kwargs})


def test_a_dead_retriever_fails_the_health_check_naming_the_url():
    from torchrl_agent.envs.search import RetrievalError

    server, url = _serve(_Retrieval)
    _stop(server)  # the port is now closed
    with pytest.raises(RetrievalError, match=f"health check failed: retrieval server {url}"):
        _search_env(url)


@pytest.mark.parametrize("mode, reason", [
    ("dead", "Connection refused"),
    ("hang", "no answer within 0.5 s"),
    ("garbage", "answered with a body that is not JSON"),
    ("wrong_shape", "answered without a 'result' list"),
])
def test_a_failing_retriever_ends_the_searching_games_not_the_run(mode, reason):
    handler = type("H", (_Retrieval,), {"mode": "ok"})
    server, url = _serve(handler)
    env = _search_env(url, group_size=3)  # healthy at start
    env.reset()
    if mode == "dead":
        _stop(server)
    else:
        handler.mode = mode
    t0 = time.perf_counter()
    actions = ["<search>capital</search>", "<search>capital</search>", "<answer>Ulaanbaatar</answer>"]
    out = env.step(TensorDict({"action": actions}, batch_size=[3]))["next"]
    assert time.perf_counter() - t0 < 5  # timeout 0.5 s x 2 attempts + backoff
    assert out["env_fault"].squeeze(-1).tolist() == [True, True, False]
    assert out["truncated"].squeeze(-1).tolist()[:2] == [True, True]
    assert out["success"].squeeze(-1).tolist()[2]  # the answering game is unaffected
    assert url in env.fault_log[-1] and any(r in env.fault_log[-1] for r in reason.split("|"))
    if mode != "dead":
        _stop(server)


def test_a_failing_retriever_in_a_worker_truncates_with_worker_fault():
    from torchrl_agent.envs.workers import ParallelTextEnv

    server, url = _serve(type("H", (_Retrieval,), {"mode": "ok"}))
    env = ParallelTextEnv(lambda **kw: _search_env(url, **kw),
                          num_workers=1, num_groups=1, group_size=2, timeout=20)
    try:
        env.reset()
        _stop(server)
        out = env.step(TensorDict({"action": ["<search>capital</search>", "<answer>x</answer>"]},
                                  batch_size=[2]))["next"]
        assert out["worker_fault"].squeeze(-1).tolist() == [True, False]
        assert url in env.fault_log[-1] and env.num_restarts == 0
    finally:
        env.close()


# ----------------------------------------------------------------------------------- non-finite rewards
class PoisonedNumberLine(NumberLineGame):
    """NumberLine whose rewards turn NaN once ``poisoned`` is set (a reward model gone wrong)."""

    poisoned = False

    def step(self, action):
        state, reward, terminated, success = super().step(action)
        return state, float("nan") if PoisonedNumberLine.poisoned else reward, terminated, success


register_env("poisoned_numberline", lambda **kw: TextEnv(PoisonedNumberLine, **{"max_steps": 3, **kw}))


def test_a_non_finite_reward_is_an_env_fault_of_its_episode_in_process_and_in_workers():
    """A game whose reward is NaN or infinite: its episode ends truncated as an env fault (a worker
    fault in worker processes), the game's class named, the reward booked as 0; the others go on."""
    from torchrl_agent.envs.workers import ParallelTextEnv

    PoisonedNumberLine.poisoned = True
    try:
        env = TextEnv(PoisonedNumberLine, num_groups=1, group_size=2, max_steps=3)
        env.reset()
        out = env.step(TensorDict({"action": ["+", "+"]}, batch_size=[2]))["next"]
        assert out["env_fault"].all() and out["truncated"].all() and torch.isfinite(out["reward"]).all()
        assert "PoisonedNumberLine.step returned a non-finite reward nan" in env.fault_log[-1]
        workers = ParallelTextEnv(lambda **kw: TextEnv(PoisonedNumberLine, **{"max_steps": 3, **kw}),
                                  num_workers=1, num_groups=1, group_size=2, timeout=20)
        try:
            workers.reset()
            out = workers.step(TensorDict({"action": ["+", "+"]}, batch_size=[2]))["next"]
            assert out["worker_fault"].all() and torch.isfinite(out["reward"]).all()
            assert "non-finite reward nan" in workers.fault_log[-1] and workers.num_restarts == 0
        finally:
            workers.close()
    finally:
        PoisonedNumberLine.poisoned = False


def test_training_on_nan_rewards_drops_the_faulted_groups_instead_of_diverging(tmp_path):
    """Every reward NaN: every episode is an env fault, every group dropped and counted, no update
    (the run used to skip its steps and stop after three, blaming algorithm.lr)."""
    PoisonedNumberLine.poisoned = True
    try:
        assert main(["train", *SMALL, "env.name=poisoned_numberline", "iterations=3", "algorithm.max_skipped_steps=1",
                     f"run_dir={tmp_path}"]) == 0
    finally:
        PoisonedNumberLine.poisoned = False
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][:-1]
    assert [(r["env_faults"], r["fault_groups_dropped"], "loss" in r) for r in records] == [(4, 2, False)] * 3


def test_a_nan_reward_injected_by_a_flag_file_faults_one_episode_and_the_others_go_on(tmp_path, monkeypatch):
    """benchmarks/chaos.py's ``nan_reward`` fault: the custom env returns one NaN reward, at the
    first step after the supervisor's flag file appears; that episode is an env fault naming the
    game, the others and the next steps go on."""
    import importlib.util
    import sys

    from tensordict import TensorDict

    from torchrl_agent.envs import make_env

    spec = importlib.util.spec_from_file_location("chaos", Path(__file__).resolve().parents[1] / "benchmarks" / "chaos.py")
    chaos = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "chaos", chaos)
    spec.loader.exec_module(chaos)
    flag = tmp_path / "nan.flag"
    monkeypatch.setenv(chaos.NAN_FLAG, str(flag))
    chaos.register_nan_env()
    env = make_env("chaos_nan_numberline", num_groups=1, group_size=2, max_steps=3)
    env.reset()
    step = TensorDict({"action": ["+", "+"]}, batch_size=[2])
    assert not env.step(step)["next", "env_fault"].any()
    env.reset()
    flag.write_text("")
    out = env.step(step)["next"]
    assert out["env_fault"].tolist() == [[True], [False]] and not flag.exists()
    assert "FlaggedNumberLine.step returned a non-finite reward nan" in env.fault_log[-1]

"""Runs that survive their faults: bad config values, long prompts, env and worker faults,
retrieval servers that are down, hang or answer garbage, checkpoints that cannot be written,
resume after a crash, strict-JSON metrics."""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from tensordict import TensorDict

from torchrl_agent.envs import register_env
from torchrl_agent.envs.base import GameState, TextEnv, TextGame
from torchrl_agent.envs.games.numberline import NumberLineGame
from torchrl_agent.trainers.cli import compose_config, main

SMALL = ["experiment=smoke", "iterations=2", "eval_every=0", "env.num_groups=2", "env.group_size=2", "env.eval_episodes=2",
         "env.max_steps=3", "rollout.max_new_tokens=6", "progress=false", "algorithm.kl_coef=0", "warm_start.steps=0"]


# ----------------------------------------------------------------------------------- config values
@pytest.mark.parametrize("override, needle", [
    ("iterations=-1", "iterations=-1: must be >= 0"),
    ("algorithm.epochs=0", "algorithm.epochs=0: must be >= 1"),
    ("algorithm.minibatch_size=0", "algorithm.minibatch_size"),
    ("warm_start.batch_size=0", "warm_start.batch_size"),
    ("env.eval_episodes=0", "env.eval_episodes"),
    ("env.num_groups=0", "env.num_groups"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens"),
    ("algorithm.lr=inf", "algorithm.lr=inf: must be finite and > 0"),
    ("algorithm.lr=0", "algorithm.lr"),
    ("algorithm.kl_coef=nan", "algorithm.kl_coef"),
    ("algorithm.target_kl=-0.01", "algorithm.target_kl=-0.01: must be finite and > 0"),  # would stop every update
    ("algorithm.adam_eps=0", "algorithm.adam_eps"),
    ("env.template=hello", "{observation}"),
    ("resume=/nonexistent/last.pt", "resume=/nonexistent/last.pt: no such file"),
    ("model.path=/nonexistent", "model.path=/nonexistent: no such folder"),
    ("iterations=abc", "could not be converted to Integer"),
])
def test_bad_values_fail_at_start_naming_the_key(override, needle, capsys):
    assert main(["train", "experiment=smoke", override]) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err and needle in err, err


@pytest.mark.parametrize("memory", [["memory=window"], ["memory=actions"], ["memory=summary"]])
def test_a_memory_without_a_history_slot_in_the_template_fails_at_start(memory, capsys):
    assert main(["train", "experiment=learning_babyai", "env.template=babyai_short", *memory]) == 2
    err = capsys.readouterr().err
    assert "memory.kind=" in err and "env.template='babyai_short' has no {history} slot" in err, err


def test_a_template_with_the_placeholder_is_accepted():
    cfg = compose_config(["experiment=smoke", "env.template='State: {observation}. Act.'", "memory=none"])
    assert cfg.env.template == "State: {observation}. Act."
    cfg = compose_config(["experiment=smoke", "env.template='{history} State: {observation}. Act.'"])  # window memory
    assert cfg.memory.kind == "window"


# ----------------------------------------------------------------------------------- long prompts
class GrowingGame(TextGame):
    """Each step's observation is 40 words longer than the last (a growing page)."""

    def reset(self, seed):
        self.t = 0
        return GameState(observation="start", task="read")

    def step(self, action):
        self.t += 1
        return GameState(observation=" ".join(["word"] * 40 * self.t), task="read"), 0.0, False, False


def test_an_observation_over_the_budget_ends_the_episode_before_generation(tokenizer, tiny_model, caplog):
    from torchrl.envs import Compose, TransformedEnv

    from torchrl_agent.collectors import StepCollector
    from torchrl_agent.envs.transforms import ActionProjection, FullHistory, PromptTransform
    from torchrl_agent.modules import TransformersPolicy

    budget = 150
    env = TransformedEnv(TextEnv(GrowingGame, num_groups=1, group_size=2, max_steps=10),
                         Compose(FullHistory(), PromptTransform(tokenizer, "default", max_prompt_tokens=budget),
                                 ActionProjection()))
    collector = StepCollector(env, TransformersPolicy(tiny_model, tokenizer, max_new_tokens=4), seed=0)
    with caplog.at_level(logging.WARNING):
        rows = collector.collect()
    prompt_tokens = rows["prompt_tokens"].reshape(-1)
    assert int(prompt_tokens.max()) <= budget  # nothing over the budget was generated for
    steps = rows["step_count"].reshape(-1).tolist()
    assert max(steps) < 9  # the episodes ended early, well before max_steps
    for traj in rows["traj_id"].unique():
        mine = rows["traj_id"].reshape(-1) == traj
        assert rows["truncated"].reshape(-1)[mine].tolist()[-1]  # each episode's last row: truncated
    assert collector.stats["prompt_budget_truncations"] == 2
    assert "over the prompt budget" in caplog.text


def test_sokoban_full_memory_200_steps_stays_within_the_default_budget(tokenizer):
    """The run of the fault report (`env=sokoban memory=full env.max_steps=200`): with the default
    budget every step's prompt stays within it (the oldest records dropped), for all 200 steps."""
    from tensordict import NonTensorStack
    from torchrl.envs.utils import step_mdp

    from torchrl_agent.trainers.builders import build_env, prompt_budget

    cfg = compose_config(["experiment=smoke", "env=sokoban", "memory=full", "env.max_steps=200", "env.num_groups=1",
                          "env.group_size=1"])
    budget = prompt_budget(cfg, tokenizer)
    assert budget == 2048
    env = build_env(cfg, tokenizer)
    td = env.reset()
    lengths = []
    for t in range(200):
        lengths.append(len(tokenizer(td["text", "prompt"][0], add_special_tokens=False)["input_ids"]))
        # a move into a wall, or an invalid action: the room never changes, the transcript grows
        td.set(("text", "response"), NonTensorStack(f"<think>step {t}</think><action>wait</action>"))
        td = env.step(td)
        if td["next", "done"].all():
            break
        td = step_mdp(td, keep_other=True)
    assert len(lengths) == 200
    assert max(lengths) <= budget and max(lengths) > budget - 200  # the budget, not the game, bounds it
    assert not td["next", "prompt_over_budget"].any()
    assert json.loads(td["next", "memory"][0])["dropped"] > 0


# ----------------------------------------------------------------------------------- env and worker faults
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
    import signal

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


def test_env_num_workers_is_a_config_key():
    cfg = compose_config(["experiment=smoke", "env.num_workers=2"])
    assert cfg.env.num_workers == 2
    assert main(["train", "experiment=smoke", "env.num_workers=-1"]) == 2


# ----------------------------------------------------------------------------------- checkpoints, resume, logs
def test_checkpoint_write_failures_are_named_and_keep_the_previous_one(tmp_path):
    """A write over the file-size limit (``ulimit -f``: EFBIG, what a quota does) fails cleanly:
    named, the previous checkpoint intact, no ``.tmp`` left; NaN weights are never written.
    (A real full disk: tests/test_run_dir.py.)"""
    import resource

    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.trainer import CheckpointError

    trainer = Trainer(compose_config([*SMALL, f"run_dir={tmp_path}"]))
    good = trainer.save_checkpoint()
    before = good.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) // 2, hard))
    try:
        with pytest.raises(CheckpointError, match=r"failed .*disk full\?.*previous checkpoint .*iteration_00000.pt"):
            trainer.save_checkpoint()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert good.read_bytes() == before and not list(tmp_path.glob("checkpoints/*.tmp"))

    with torch.no_grad():
        next(trainer.model.parameters())[0] = float("nan")
    with pytest.raises(CheckpointError, match="NaN/inf .*diverged"):
        trainer.save_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert not (tmp_path / "checkpoints" / "last.pt").exists()


def test_a_used_run_dir_is_refused_and_resume_auto_continues_it(tmp_path, capsys):
    from torchrl_agent.trainers import Trainer

    args = [*SMALL, "iterations=3", "checkpoint_every=1", f"run_dir={tmp_path}"]
    first = Trainer(compose_config(args))
    first.train()
    straight = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert main(["train", *args]) == 2
    assert "already holds a run" in capsys.readouterr().err
    # a crash after iteration 1 was logged but before its checkpoint, and a line cut by the kill
    (tmp_path / "checkpoints" / "last.pt").unlink()
    (tmp_path / "checkpoints" / "iteration_00002.pt").unlink()
    (tmp_path / "checkpoints" / "iteration_00001.pt").unlink()
    (tmp_path / "checkpoints" / "iteration_00000.pt.tmp").write_bytes(b"half")  # never chosen
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:2]) + '\n{"iteration": 2, "los')
    resumed = Trainer(compose_config([*args, "resume=auto"]))
    assert resumed.checkpoints.resume_path == tmp_path / "checkpoints" / "iteration_00000.pt"
    resumed.train()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]  # no duplicates, nothing lost
    assert records[1]["loss"] == straight[1]["loss"] and records[2]["loss"] == straight[2]["loss"]
    # resume=RUN_DIR picks the newest checkpoint of that run
    from torchrl_agent.trainers.checkpointing import resolve_resume

    assert resolve_resume(str(tmp_path), None)[0].name == "last.pt"


def test_resume_auto_in_an_empty_run_dir_starts_fresh(tmp_path):
    from torchrl_agent.trainers import Trainer

    trainer = Trainer(compose_config([*SMALL, "iterations=1", f"run_dir={tmp_path}", "resume=auto"]))
    assert trainer.checkpoints.resume_path is None
    trainer.train()
    assert (tmp_path / "checkpoints" / "last.pt").exists()


def test_non_finite_metrics_are_written_as_null_and_counted(tmp_path, caplog):
    from torch.utils.tensorboard import SummaryWriter

    from torchrl_agent.trainers.loggers import MetricsLog

    log = MetricsLog(None, tmp_path)
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as log.file, caplog.at_level(logging.WARNING):
        log.writer = SummaryWriter(str(tmp_path / "tb"))
        log.log({"iteration": 0, "loss": float("nan"), "grad_norm": float("inf"), "success": 0.5})
        log.writer.close()

    def strict(constant):
        raise ValueError(f"non-strict JSON constant {constant}")

    record = json.loads(path.read_text(), parse_constant=strict)
    assert record == {"iteration": 0, "loss": None, "grad_norm": None, "success": 0.5, "nonfinite_metrics": 2}
    assert log.nonfinite_metrics == 2 and "grad_norm" in caplog.text


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


def test_a_diverging_run_stops_with_a_message_and_leaves_the_last_good_checkpoint(tmp_path, capsys):
    """The advantages turn NaN after the first checkpoint: the gradients are NaN, the steps are
    skipped, the run stops naming the likely causes, and the checkpoint on disk is the last finite one."""
    from torchrl_agent.trainers.checkpointer import Checkpointer
    from torchrl_agent.trainers.scoring import Scorer

    original, inputs = Checkpointer.save, Scorer.loss_inputs
    poisoned = []

    def save_then_poison(self, iteration, path=None):
        out = original(self, iteration, path)
        poisoned.append(True)
        return out

    def poisoned_inputs(self, *args, **kwargs):
        batch = inputs(self, *args, **kwargs)
        if poisoned:
            batch["advantage"] = batch["advantage"] * float("nan")
        return batch

    Checkpointer.save, Scorer.loss_inputs = save_then_poison, poisoned_inputs
    try:
        code = main(["train", *SMALL, "iterations=3", "checkpoint_every=1", "algorithm.max_skipped_steps=1",
                     f"run_dir={tmp_path}"])
    finally:
        Checkpointer.save, Scorer.loss_inputs = original, inputs
    assert code == 1
    assert "training diverged" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "checkpoints").glob("*.pt")] == ["iteration_00000.pt"]
    state = torch.load(tmp_path / "checkpoints" / "iteration_00000.pt", weights_only=True)["model"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [0]

"""A run's checkpoints (``trainers/checkpointer.py``): a write that fails is named and keeps the
previous one, a diverging run leaves the last finite one, SIGHUP / SIGTERM stop with one, old ones
are pruned to ``checkpoint_keep``; a resume continues a used run directory, refuses another
experiment in one line and rebuilds the metrics history from ``metrics.jsonl``."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from torchrl_agent.trainers.cli import compose_config, main

SMALL = ["experiment=smoke", "iterations=2", "eval_every=0", "env.num_groups=2", "env.group_size=2",
         "env.eval_episodes=2", "env.max_steps=3", "rollout.max_new_tokens=6", "progress=false", "warm_start.steps=0"]

#: the runs of the fault tests: no KL term (no reference model)
SMALL_NO_KL = [*SMALL, "algorithm.kl_coef=0"]


def _one_line(err: str) -> str:
    """The program's message: exactly one ``torchrl-agent:`` line and no traceback."""
    lines = [x for x in err.splitlines() if x.startswith("torchrl-agent")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, copy_function=shutil.copy)
    return to


# ----------------------------------------------------------------------------------- writes that fail, divergence
def test_checkpoint_write_failures_are_named_and_keep_the_previous_one(tmp_path):
    """A write over the file-size limit (``ulimit -f``: EFBIG, what a quota does) fails cleanly:
    named, the previous checkpoint intact, no ``.tmp`` left; NaN weights are never written.
    (A real full disk: tests/test_run_dir.py.)"""
    import resource

    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.trainer import CheckpointError

    trainer = Trainer(compose_config([*SMALL_NO_KL, f"run_dir={tmp_path}"]))
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


def test_a_diverging_run_stops_with_a_message_and_leaves_the_last_good_checkpoint(tmp_path, capsys):
    """The advantages turn NaN after the first checkpoint: the gradients are NaN, the steps are
    skipped, the run stops naming the likely causes, and the checkpoint on disk is the last finite one."""
    from torchrl_agent.trainers.checkpointer import Checkpointer
    from torchrl_agent.trainers.scoring import Scorer

    original, inputs = Checkpointer.save, Scorer.loss_inputs
    poisoned = []

    def save_then_poison(self, iteration, path=None, **kwargs):
        out = original(self, iteration, path, **kwargs)
        poisoned.append(True)
        return out

    def poisoned_inputs(self, *args, **kwargs):
        batch = inputs(self, *args, **kwargs)
        if poisoned:
            batch["advantage"] = batch["advantage"] * float("nan")
        return batch

    Checkpointer.save, Scorer.loss_inputs = save_then_poison, poisoned_inputs
    try:
        code = main(["train", *SMALL_NO_KL, "iterations=3", "checkpoint_every=1", "algorithm.max_skipped_steps=1",
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


# ----------------------------------------------------------------------------------- resume
def test_a_used_run_dir_is_refused_and_resume_auto_continues_it(tmp_path, capsys):
    from torchrl_agent.trainers import Trainer

    args = [*SMALL_NO_KL, "iterations=3", "checkpoint_every=1", f"run_dir={tmp_path}"]
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

    trainer = Trainer(compose_config([*SMALL_NO_KL, "iterations=1", f"run_dir={tmp_path}", "resume=auto"]))
    assert trainer.checkpoints.resume_path is None
    trainer.train()
    assert (tmp_path / "checkpoints" / "last.pt").exists()


def test_resume_with_another_experiment_is_refused_in_one_line_naming_the_keys(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path / "run")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code = main(["train", *SMALL, "iterations=5", "checkpoint_every=1", "env.group_size=3", "algorithm.name=rloo",
                 "memory.kind=none", f"run_dir={run}", "resume=auto"])
    line = _one_line(capsys.readouterr().err)
    assert code == 2
    for key in ("env.group_size (2 -> 3)", "algorithm.name ('grpo' -> 'rloo')", "memory.kind", "resume_allow_changes="):
        assert key in line, line
    assert "algorithm.lr" not in line and "iterations" not in line  # those may change
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing overwritten


def test_resume_lists_what_may_change_and_experts_may_allow_more(finished_run, tmp_path, caplog):
    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.checkpointing import CheckpointLoadError

    run = _copy(finished_run, tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="torchrl_agent"):
        trainer = Trainer(compose_config([*SMALL, "iterations=6", "checkpoint_every=1", "algorithm.lr=2e-6",
                                          f"run_dir={run}", "resume=auto"]))
    trainer.close()
    changed = [r.getMessage() for r in caplog.records if "changed since checkpoint" in r.getMessage()]
    assert len(changed) == 1 and "iterations 3 -> 6" in changed[0] and "algorithm.lr" in changed[0], changed
    with pytest.raises(CheckpointLoadError, match=r"env\.max_steps \(3 -> 4\)"):
        Trainer(compose_config([*SMALL, "checkpoint_every=1", "env.max_steps=4", f"run_dir={run}", "resume=auto"]))
    for allow in ("[env.max_steps]", "[env]", "[all]"):
        Trainer(compose_config([*SMALL, "checkpoint_every=1", "env.max_steps=4", f"run_dir={run}", "resume=auto",
                                f"resume_allow_changes={allow}"])).close()


def test_resume_rebuilds_the_history_from_metrics_jsonl_and_reads_old_checkpoints(finished_run, tmp_path, caplog):
    from torchrl_agent.trainers.checkpointing import read_checkpoint
    from torchrl_agent.trainers.run_dir import checkpoint_history

    run = _copy(finished_run, tmp_path / "run")
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    path = run / "checkpoints" / "iteration_00001.pt"
    state = read_checkpoint(path)
    assert checkpoint_history(path, state) == records[:2]
    assert checkpoint_history(path, {"iteration": 1, "history": [{"iteration": 0}]}) == [{"iteration": 0}]  # older
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records[1:]) + "\n")  # a line lost
    assert checkpoint_history(path, state) == records[1:2]
    assert any("not the 2 checkpoint" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------------- signals
def test_sighup_asks_the_run_to_stop_at_the_end_of_the_iteration_like_sigterm(tmp_path):
    """SIGHUP (a closed terminal) is caught like SIGTERM: the run is asked to stop at its next safe
    point, and the stop says which signal and exits 129 (the end-to-end stop with a checkpoint is
    test_run_dir's SIGINT / SIGTERM test: the same code path)."""
    from torchrl_agent.trainers.run_dir import StopSignals

    def before(signum, frame):  # SIGHUP's default action would end the test process
        pass

    previous = signal.signal(signal.SIGHUP, before)
    try:
        with StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGHUP)
            assert signals.requested == signal.SIGHUP
            stop = signals.stop_message(tmp_path, tmp_path / "checkpoints" / "iteration_00003.pt", 3)
        assert signal.getsignal(signal.SIGHUP) is before  # the previous handler is back
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert stop.exit_code == 129 and "stopped by SIGHUP after iteration 3" in str(stop)


# ----------------------------------------------------------------------------------- retention, the history kept once
def test_prune_keeps_the_newest_and_the_best_held_out_checkpoint(tmp_path):
    from torchrl_agent.trainers.checkpointing import prune_checkpoints

    for it in range(6):
        (tmp_path / f"iteration_{it:05d}.pt").write_bytes(b"x")
    (tmp_path / "last.pt").write_bytes(b"x")
    removed = prune_checkpoints(tmp_path, 2, {0: 0.2, 1: 0.9, 2: 0.5, 3: 0.9 - 1e-9})
    assert sorted(p.name for p in removed) == ["iteration_00000.pt", "iteration_00002.pt", "iteration_00003.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iteration_00001.pt", "iteration_00004.pt",
                                                          "iteration_00005.pt", "last.pt"]
    assert prune_checkpoints(tmp_path, 0, {}) == []  # 0: keep all


def test_checkpoint_keep_in_a_run_and_the_history_kept_once_in_metrics_jsonl(tmp_path):
    """checkpoint_keep=1 with an evaluation every iteration: the newest periodic checkpoint, the
    best held-out one (the evaluation at iteration i scores checkpoint i - 1) and last.pt remain;
    no checkpoint holds the metrics history, each holds its count and digest."""
    from torchrl_agent.trainers.checkpointing import read_checkpoint
    from torchrl_agent.trainers.run_dir import records_digest

    run = tmp_path / "run"
    assert main(["train", *SMALL, "iterations=4", "eval_every=1", "checkpoint_every=1", "checkpoint_keep=1",
                 f"run_dir={run}"]) == 0
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    scores = {r["iteration"] - 1: r["eval_success"] for r in records if "eval_success" in r and r["iteration"] < 4}
    best = max((s, it) for it, s in scores.items())[1]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == sorted({f"iteration_{best:05d}.pt", "iteration_00003.pt", "last.pt"}), names
    for name in names:
        state = read_checkpoint(run / "checkpoints" / name)
        assert "history" not in state
        upto = [r for r in records if r["iteration"] <= state["iteration"]]
        assert state["history_records"] == len(upto) and state["history_sha256"] == records_digest(upto)

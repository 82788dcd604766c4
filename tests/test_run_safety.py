"""Runs safe to leave alone at scale: a resume refuses another experiment, SIGHUP stops like SIGTERM,
checkpoint retention with the metrics history kept once, an endpoint's API key kept out of every
file and output, listeners on loopback, a non-finite reward is an env fault, and one line for every
filesystem setting that cannot be used. Every fault is caused for real."""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path

import pytest

from torchrl_agent.trainers.cli import compose_config, main

SMALL = ["experiment=smoke", "iterations=2", "eval_every=0", "env.num_groups=2", "env.group_size=2",
         "env.eval_episodes=2", "env.max_steps=3", "rollout.max_new_tokens=6", "progress=false", "warm_start.steps=0"]


def _one_line(err: str) -> str:
    """The program's message: exactly one ``torchrl-agent:`` line and no traceback."""
    lines = [x for x in err.splitlines() if x.startswith("torchrl-agent")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 3-iteration smoke run with a checkpoint after every iteration (read-only: copy it)."""
    from torchrl_agent.trainers import Trainer

    run = tmp_path_factory.mktemp("finished") / "run"
    Trainer(compose_config([*SMALL, "iterations=3", "checkpoint_every=1", f"run_dir={run}"])).train()
    return run


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, copy_function=shutil.copy)
    return to


# ----------------------------------------------------------------------------------- 1. the same experiment
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


# ----------------------------------------------------------------------------------- 2. SIGHUP
def test_sighup_asks_the_run_to_stop_at_the_end_of_the_iteration_like_sigterm(tmp_path):
    """SIGHUP (a closed terminal) is caught like SIGTERM: the run is asked to stop at its next safe
    point, and the stop says which signal and exits 129 (the end-to-end stop with a checkpoint is
    test_resilience's SIGINT / SIGTERM test: the same code path)."""
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

"""The run directory and its checkpoints (``trainers/run_dir.py``, ``trainers/checkpointing.py``): a
training run that survives a bad week: checkpoints that are hostile, damaged or of another
model, ``resume=auto`` on copied or damaged run directories, runs started together or on one
folder, full disks, signals, killed trainers and their orphans. Every fault is caused for real."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchrl_agent.trainers.checkpointing import (
    CheckpointLoadError,
    find_resumable,
    read_checkpoint,
    write_checkpoint,
)
from torchrl_agent.trainers.cli import compose_config, main

SMALL = ["experiment=smoke", "iterations=2", "eval_every=0", "env.num_groups=2", "env.group_size=2",
         "env.eval_episodes=2", "env.max_steps=3", "rollout.max_new_tokens=6", "progress=false", "warm_start.steps=0"]


def _one_line(err: str) -> str:
    """The program's message: exactly one ``torchrl-agent:`` line and no traceback (a model's
    loading progress bar may share stderr)."""
    lines = [x for x in err.splitlines() if x.startswith("torchrl-agent")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _iterations(run_dir: Path) -> list[int]:
    return [json.loads(x)["iteration"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, copy_function=shutil.copy)  # copied without its timestamps
    return to


# ----------------------------------------------------------------------------------- code in a checkpoint
class _RunsCode:
    """Unpickling this creates ``marker``: what a hostile checkpoint could do instead."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_whose_pickle_runs_code_is_refused_by_resume_and_eval_without_running_it(
        finished_run, tmp_path, capsys):
    marker = tmp_path / "code_ran"
    good = read_checkpoint(finished_run / "checkpoints" / "last.pt")
    hostile = tmp_path / "shared.pt"
    torch.save({**good, "payload": _RunsCode(str(marker))}, hostile)
    torch.load(hostile, weights_only=False)  # the file is live: a plain unpickling runs it
    assert marker.exists()
    marker.unlink()

    assert main(["train", *SMALL, f"run_dir={tmp_path / 'run'}", f"resume={hostile}"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert str(hostile) in err and "would run code" in err and "checkpointing convert" in err, err
    assert main(["eval", "experiment=smoke", "env.eval_episodes=2", f"eval.checkpoint={hostile}"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert str(hostile) in err and "would run code" in err, err
    assert not marker.exists()


def test_an_older_pickled_checkpoint_is_refused_and_converted_when_trusted(finished_run, tmp_path, capsys):
    import numpy as np

    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.checkpointing import main as checkpointing_main

    state = read_checkpoint(finished_run / "checkpoints" / "iteration_00000.pt")
    old = {k: v for k, v in state.items() if k not in ("format", "checksum")}
    old["rng"] = {**old["rng"], "numpy": np.random.get_state()}  # the older format: numpy's own tuple
    old["evals"] = [tuple(e) for e in old["evals"]]
    del old["history_records"], old["history_sha256"]  # the older format held the metrics records themselves
    old["history"] = [json.loads(x) for x in (finished_run / "metrics.jsonl").read_text().splitlines()][:1]
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(CheckpointLoadError, match="would run code.*checkpointing convert"):
        read_checkpoint(tmp_path / "old.pt")
    assert checkpointing_main(["convert", str(tmp_path / "old.pt"), str(tmp_path / "new.pt")]) == 0
    assert read_checkpoint(tmp_path / "new.pt")["iteration"] == 0
    trainer = Trainer(compose_config([*SMALL, f"run_dir={tmp_path / 'run'}", f"resume={tmp_path / 'new.pt'}"]))
    trainer.train()
    assert _iterations(tmp_path / "run") == [0, 1, 2]


# ----------------------------------------------------------------------------------- damaged checkpoints
def test_flipped_bytes_never_load_silently(finished_run, tmp_path):
    """16 flipped bytes anywhere in the file: the read fails, or what it reads is exactly what was
    written (the bytes hit padding of the archive); never different weights."""
    path = finished_run / "checkpoints" / "iteration_00001.pt"
    original = read_checkpoint(path)
    data = path.read_bytes()
    refused = 0
    for seed in range(12):
        rng = random.Random(seed)
        damaged = bytearray(data)
        for i in rng.sample(range(len(data)), 16):
            damaged[i] ^= 0xFF
        copy = tmp_path / f"flipped_{seed}.pt"
        copy.write_bytes(bytes(damaged))
        try:
            state = read_checkpoint(copy)
        except CheckpointLoadError as err:
            assert str(copy) in str(err)
            refused += 1
            continue
        assert state["checksum"] == original["checksum"]
        for k, v in original["model"].items():
            assert torch.equal(state["model"][k], v), k
    assert refused >= 10  # the file is almost all tensor data
    # flipped bytes inside the weights: the checksum catches them
    damaged = bytearray(data)
    middle = len(data) // 2
    for i in range(middle, middle + 16):
        damaged[i] ^= 0xFF
    (tmp_path / "weights.pt").write_bytes(bytes(damaged))
    with pytest.raises(CheckpointLoadError, match="checksum|damaged"):
        read_checkpoint(tmp_path / "weights.pt")


def test_resume_auto_takes_the_newest_checkpoint_by_iteration_and_says_what_it_skipped(
        finished_run, tmp_path, caplog):
    from torchrl_agent.trainers import Trainer

    run = _copy(finished_run, tmp_path / "run")
    ckpt = run / "checkpoints"
    (ckpt / "last.pt").unlink()
    now = time.time()
    os.utime(ckpt / "iteration_00000.pt", (now + 100, now + 100))  # the oldest has the newest file time
    assert find_resumable(run)[0] == ckpt / "iteration_00002.pt"
    # the newer ones damaged four ways: truncated, empty, a text file, flipped bytes in the weights
    good = (ckpt / "iteration_00001.pt").read_bytes()
    (ckpt / "iteration_00005.pt").write_bytes(good[: len(good) // 2])
    (ckpt / "iteration_00004.pt").write_bytes(b"")
    (ckpt / "iteration_00003.pt").write_text("checkpoint moved to the other disk\n")
    flipped = bytearray((ckpt / "iteration_00002.pt").read_bytes())
    for i in range(len(flipped) // 2, len(flipped) // 2 + 16):
        flipped[i] ^= 0xFF
    (ckpt / "iteration_00002.pt").write_bytes(bytes(flipped))
    with caplog.at_level(logging.WARNING, logger="torchrl_agent"):
        trainer = Trainer(compose_config([*SMALL, "iterations=3", "checkpoint_every=1", f"run_dir={run}",
                                          "resume=auto"]))
    assert trainer.checkpoints.resume_path == ckpt / "iteration_00001.pt"
    for name, reason in [("iteration_00005.pt", "truncated"), ("iteration_00004.pt", "empty (0 bytes)"),
                         ("iteration_00003.pt", "a text file"), ("iteration_00002.pt", "checksum")]:
        assert any(name in r.getMessage() and reason in r.getMessage() for r in caplog.records), (name, caplog.text)
    trainer.train()
    assert _iterations(run) == [0, 1, 2, 3]  # 2 retrained once, nothing repeated or skipped
    assert read_checkpoint(ckpt / "iteration_00002.pt")["iteration"] == 2  # rewritten whole


def test_resume_of_a_damaged_file_names_it_in_one_line(finished_run, tmp_path, capsys):
    for name, content in [("empty.pt", b""), ("notes.pt", b"see the wiki\n"),
                          ("cut.pt", (finished_run / "checkpoints" / "last.pt").read_bytes()[:5000])]:
        (tmp_path / name).write_bytes(content)
        assert main(["train", *SMALL, f"run_dir={tmp_path / name}.run", f"resume={tmp_path / name}"]) == 2
        assert str(tmp_path / name) in _one_line(capsys.readouterr().err)
        assert main(["eval", "experiment=smoke", f"eval.checkpoint={tmp_path / name}"]) == 2
        assert str(tmp_path / name) in _one_line(capsys.readouterr().err)


def test_a_checkpoint_of_another_model_size_is_one_line(finished_run, tmp_path, capsys):
    checkpoint = finished_run / "checkpoints" / "last.pt"
    assert main(["eval", "experiment=smoke", "model.name=tiny-large", f"eval.checkpoint={checkpoint}"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "another model" in err and "model.name=tiny " in err, err
    assert main(["train", *SMALL, "model.name=tiny-large", f"run_dir={tmp_path}", f"resume={checkpoint}"]) == 2
    assert "another model" in _one_line(capsys.readouterr().err)


def test_resume_auto_on_metrics_without_a_checkpoint_keeps_the_curve(finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(finished_run / "metrics.jsonl", run / "metrics.jsonl")
    before = (run / "metrics.jsonl").read_text()
    assert main(["train", *SMALL, f"run_dir={run}", "resume=auto"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint" in err and "checkpoint_every" in err and "another run_dir" in err, err
    assert (run / "metrics.jsonl").read_text() == before


def test_resume_of_a_finished_run_for_more_iterations_extends_its_metrics(finished_run, tmp_path):
    from torchrl_agent.trainers import Trainer

    run = _copy(finished_run, tmp_path / "run")
    Trainer(compose_config([*SMALL, "iterations=4", "checkpoint_every=1", f"run_dir={run}", "resume=auto"])).train()
    assert _iterations(run) == [0, 1, 2, 3, 4]


# ----------------------------------------------------------------------------------- atomic writes
def test_a_checkpoint_write_is_atomic_and_carries_a_checksum(tmp_path):
    path = tmp_path / "c.pt"
    size = write_checkpoint({"model": {"w": torch.ones(3)}, "iteration": 7, "history": [{"iteration": 0}]}, path)
    assert size == path.stat().st_size and not list(tmp_path.glob("*.tmp"))
    assert torch.load(path, weights_only=True)["iteration"] == 7  # plain torch reads it, no code
    state = read_checkpoint(path)
    assert state["format"].startswith("torchrl_agent.checkpoint/") and len(state["checksum"]) == 64
    with pytest.raises(TypeError, match=r"state\['bad'\]"):
        write_checkpoint({"bad": object()}, tmp_path / "d.pt")
    assert not (tmp_path / "d.pt").exists() and not list(tmp_path.glob("*.tmp"))


# ----------------------------------------------------------------------------------- run directories
# run_dir.py loaded by its path in the child processes: importing the package would load torch (slow)
_LOAD_RUN_DIR = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("run_dir", {path!r})
run_dir = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_dir)
"""


def _child(code: str, *args: str) -> subprocess.Popen:
    import torchrl_agent.trainers.run_dir as module

    return subprocess.Popen([sys.executable, "-c", _LOAD_RUN_DIR.format(path=module.__file__) + code, *args],
                            stdout=subprocess.PIPE, text=True)


def test_runs_started_together_without_run_dir_get_their_own_folders(tmp_path):
    start = time.time() + 3  # the three processes create their folder in the same instant
    procs = [_child("import time; time.sleep(max(0, float(sys.argv[2]) - time.time()))\n"
                    "print(run_dir.new_run_dir(sys.argv[1]))", str(tmp_path), str(start)) for _ in range(3)]
    folders = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert len(set(folders)) == 3 and all(Path(f).is_dir() for f in folders), folders
    assert len({Path(f).name[:15] for f in folders}) == 1  # the same second: suffixes kept them apart


def test_a_run_dir_is_held_by_one_run_and_a_dead_holders_lock_is_taken_over(tmp_path, caplog):
    from torchrl_agent.trainers.run_dir import RunDirBusyError, RunDirLock

    run = tmp_path / "run"
    holder = _child("run_dir.RunDirLock(sys.argv[1]).acquire(); print('held', flush=True)\n"
                    "import time; time.sleep(120)", str(run))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusyError, match=f"held by a running run \\(pid {holder.pid}"):
            RunDirLock(run).acquire()
        # the trainer refuses the folder in one line naming the holder
        assert main(["train", *SMALL, f"run_dir={run}", "resume=auto"]) == 2
    finally:
        holder.kill()
        holder.wait()
    assert (run / ".lock").exists()  # a SIGKILL leaves the lock behind
    with caplog.at_level(logging.WARNING, logger="torchrl_agent"):
        lock = RunDirLock(run).acquire()
    assert f"pid {holder.pid}" in caplog.text and "no longer running" in caplog.text
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / ".lock").exists()


def test_run_dir_a_file_and_seed_minus_one_are_one_line(tmp_path, capsys):
    (tmp_path / "taken").write_text("x")
    assert main(["train", *SMALL, f"run_dir={tmp_path / 'taken'}"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "run_dir=" in err and "is a file" in err, err
    assert main(["train", *SMALL, "seed=-1"]) == 2
    assert "seed=-1" in _one_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------------- full disks
@pytest.fixture
def small_disk(tmp_path):
    """``make(mb)``: a real filesystem of ``mb`` MB (a tmpfs; mounting needs root, else the test is
    skipped: tests/test_checkpointer.py causes a failed write with ``ulimit -f`` without privileges)."""
    mounts = []

    def make(mb: int, name: str = "disk") -> Path:
        mnt = tmp_path / name
        mnt.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(mnt)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"mounting a {mb} MB tmpfs (a real full disk) needs root: {done.stderr.decode().strip()}")
        mounts.append(mnt)
        return mnt

    yield make
    for mnt in mounts:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(folder: Path, leave: int = 0) -> Path:
    """Fill ``folder``'s filesystem until ``leave`` bytes are free (0: until a write fails with ENOSPC)."""
    ballast = folder / "ballast"
    with open(ballast, "wb") as f:
        try:
            while True:
                free = shutil.disk_usage(folder).free
                if free <= leave:
                    break
                f.write(b"\0" * min(1 << 20, max(4096, free - leave)))
                f.flush()
        except OSError:
            pass
    return ballast


def test_a_disk_that_fills_keeps_the_run_going_and_a_refused_last_checkpoint_keeps_the_summary(
        small_disk, tmp_path, capsys, monkeypatch, caplog):
    """Checkpoints of a run on a 32 MB disk: 1.5 times a checkpoint's size free is enough to write
    it (no fixed margin); TensorBoard on a full disk is reported once and the run goes on; with half
    a checkpoint free, the final ``last.pt`` is refused, and the final evaluation and the summary
    still come (exit code 1); freed, ``resume=auto`` continues from the last good one."""
    from torchrl_agent.trainers.checkpointer import Checkpointer
    from torchrl_agent.trainers.trainer import Trainer

    disk, tb_disk = small_disk(32), small_disk(1, "tb_disk")
    run = disk / "run"
    run.mkdir()
    _fill(tb_disk)
    (run / "tensorboard").symlink_to(tb_disk)  # TensorBoard writes to a full disk from the start
    original = Checkpointer.save
    ballast = []

    def fill_after_the_first(self, iteration, path=None, **kwargs):
        if iteration >= 1:  # the first checkpoint is written: now the disk fills
            size = (disk / "run" / "checkpoints" / "iteration_00000.pt").stat().st_size
            for old in ballast:
                old.unlink()
            ballast[:] = [_fill(disk, leave=size // 2 if path is not None else size * 3 // 2)]
        return original(self, iteration, path, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", fill_after_the_first)
    with caplog.at_level(logging.ERROR, logger="torchrl_agent"):
        code = main(["train", *SMALL, "checkpoint_every=1", f"run_dir={run}"])
    out, err = capsys.readouterr()
    assert code == 1 and out.strip(), err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["iterations"] == 2 and "eval_success_last" in summary and "No space left" in summary["checkpoint_error"]
    assert _iterations(run) == [0, 1, 2]  # the final evaluation is in the metrics
    assert sorted(p.name for p in (run / "checkpoints").glob("*")) == ["iteration_00000.pt", "iteration_00001.pt"]
    # TensorBoard's failed writes: at most one message (when its writer surfaces the error), no traceback
    assert sum("TensorBoard stopped logging" in r.getMessage() for r in caplog.records) <= 1
    assert "Traceback" not in err and "last.pt" in _one_line(err), err
    monkeypatch.undo()
    ballast[0].unlink()
    (run / "tensorboard").unlink()
    Trainer(compose_config([*SMALL, "checkpoint_every=1", f"run_dir={run}", "resume=auto"])).train()
    assert _iterations(run) == [0, 1, 2]  # resumed after iteration 1: only the final evaluation again
    assert read_checkpoint(run / "checkpoints" / "last.pt")["iteration"] == 1


def test_a_disk_that_fills_completely_ends_the_run_in_one_line_and_resume_repairs_it(small_disk, capsys, monkeypatch,
                                                                                     caplog):
    """The disk fills completely after the first checkpoint. Whatever fails next (TensorBoard,
    a checkpoint, a metrics line once the file's last page is full) the run ends in one line with
    exit code 1; if it stopped early, the log's "metrics through iteration N" is what the file
    holds. Freed, ``resume=auto`` continues from the first checkpoint, the metrics repaired."""
    from torchrl_agent.trainers.checkpointer import Checkpointer

    disk = small_disk(32)
    run = disk / "run"
    original = Checkpointer.periodic
    ballast = []

    def fill_after(self, iteration):
        original(self, iteration)
        if not ballast:
            ballast.append(_fill(disk))

    monkeypatch.setattr(Checkpointer, "periodic", fill_after)
    args = [*SMALL, "iterations=3", "checkpoint_every=1", f"run_dir={run}"]
    with caplog.at_level(logging.ERROR, logger="torchrl_agent"):
        code = main(["train", *args])
    assert code == 1 and "No space left" in _one_line(capsys.readouterr().err)
    stopped = [r.getMessage() for r in caplog.records if "the run stopped" in r.getMessage()]
    if stopped:
        assert f"metrics through iteration {max(_iterations_written(run))} " in stopped[0], stopped
    monkeypatch.undo()
    ballast[0].unlink()
    assert main(["train", *args, "resume=auto"]) == 0
    assert _iterations(run) == [0, 1, 2, 3]


def _iterations_written(run: Path) -> list[int]:
    """The iterations of the complete lines (a line cut by the full disk is not one)."""
    from torchrl_agent.trainers.run_dir import metrics_iterations

    return metrics_iterations(run)


# ----------------------------------------------------------------------------------- signals, kills, orphans
def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (its env workers, the multiprocessing resource tracker, ...)."""
    out, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                if child not in out:
                    out.add(child)
                    todo.append(child)
    return out


def _gone(pids: set[int], within: float = 10.0) -> set[int]:
    """The pids of ``pids`` still running (not zombies) after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = set()
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                alive.add(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _start_trainer(run: Path, *extra: str) -> tuple[subprocess.Popen, set[int]]:
    """A trainer process with 2 env worker processes; returns it and its child processes once its
    first iteration is in ``metrics.jsonl``."""
    proc = subprocess.Popen([sys.executable, "-m", "torchrl_agent.trainers.cli", "train", *SMALL, "iterations=50",
                             "checkpoint_every=1", "env.num_workers=2", f"run_dir={run}", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 1200
    try:
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the trainer did not finish an iteration in 1200 s"
            time.sleep(0.2)
        children = _descendants(proc.pid)
        assert len(children) >= 2, children  # the env workers
    except BaseException:
        proc.kill()
        raise
    return proc, children


@pytest.mark.parametrize("signum, code", [(2, 130), (15, 143)])  # SIGINT (Ctrl-C), SIGTERM (a scheduler)
def test_sigint_and_sigterm_stop_at_the_end_of_an_iteration_with_a_checkpoint_and_resume_continues(
        tmp_path, signum, code):
    from torchrl_agent.trainers import Trainer

    run = tmp_path / "run"
    proc, children = _start_trainer(run)
    os.kill(proc.pid, signum)
    try:
        _, err = proc.communicate(timeout=1200)  # the end of the iteration under way (a loaded machine: minutes)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == code, err
    message = _one_line(err)
    assert "stopped by SIG" in message and f"resume=auto run_dir={run}" in message, message
    assert not _gone(children)  # the env workers and the resource tracker ended with it
    assert not (run / ".lock").exists()  # released
    done = _iterations(run)
    last = max(done)
    assert done == list(range(last + 1))
    assert read_checkpoint(run / "checkpoints" / f"iteration_{last:05d}.pt")["iteration"] == last
    Trainer(compose_config([*SMALL, f"iterations={last + 2}", "checkpoint_every=1", f"run_dir={run}",
                            "resume=auto"])).train()
    assert _iterations(run) == list(range(last + 3))


def test_a_killed_trainer_leaves_no_orphans_and_resume_auto_takes_over_its_lock(tmp_path, caplog):
    from torchrl_agent.trainers import Trainer

    run = tmp_path / "run"
    proc, children = _start_trainer(run)
    deadline = time.monotonic() + 600  # iteration 0's checkpoint is written just after its metrics line
    while find_resumable(run)[0] is None and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.kill()  # SIGKILL: no handler runs
    proc.communicate()
    assert not _gone(children, within=5.0)  # PR_SET_PDEATHSIG: the workers went with it
    assert (run / ".lock").exists()
    last = find_resumable(run)[1]["iteration"]
    with caplog.at_level(logging.WARNING, logger="torchrl_agent"):
        trainer = Trainer(compose_config([*SMALL, f"iterations={last + 2}", "checkpoint_every=1", f"run_dir={run}",
                                          "resume=auto"]))
    assert "no longer running" in caplog.text
    trainer.train()
    assert _iterations(run) == list(range(last + 3))  # the lines after the checkpoint were replaced


def test_the_short_chaos_run_survives_a_kill_and_a_corrupted_checkpoint(tmp_path):
    """benchmarks/chaos.py --schedule short: 6 iterations, a trainer killed mid-iteration, then its
    newest checkpoint corrupted before another kill; both resumes continue, nothing is lost."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "chaos.py"
    done = subprocess.run([sys.executable, str(script), "--schedule", "short", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, result
    assert result["faults_injected"] == result["faults_survived"] == 2, result
    assert result["resumes"] >= 2 and result["iterations_done"] == 6
    assert result["rows_lost_beyond_faulted"] == 0 and result["metrics_consistent"] is True

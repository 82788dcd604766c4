"""Chaos run: a training run on the smoke config while a supervisor injects faults on a seeded
schedule, then checks that nothing written was lost or left inconsistent.

The trainer runs as a child process (``python -m torchrl_agent.trainers.cli train``, the smoke
experiment with ``checkpoint_every=1`` and ``env.num_workers=2``). The supervisor watches
``metrics.jsonl`` and, when the iteration of a scheduled fault is done, injects it for real:

- ``trainer_kill``: SIGKILL of the trainer at a random moment of the next iteration (mid-update,
  mid-checkpoint-write), then a restart with ``resume=auto``;
- ``worker_kill``: SIGKILL of one of the env worker processes (the trainer's, or with
  ``collector.kind=multiprocess`` a collector process's; the env restarts it, the episodes it was
  running are left out of training, ``env_faults`` in the metrics);
- ``collector_kill`` / ``engine_kill``: SIGKILL of one of the ``MultiProcessStepCollector``'s
  collector processes / of its engine server (their pids are in the line the trainer logs when they
  start) at a moment of
  the next iteration: the collector names it with its exit code and stops, the run stops with an
  error (no hang), and the supervisor restarts it with ``resume=auto``, which redoes the iteration
  that was cut short from the last checkpoint. A schedule with this fault trains with
  ``collector.kind=multiprocess rollout.engine=vllm`` (two collector processes over one vLLM engine
  server);
- ``corrupt_checkpoint``: the trainer is stopped (SIGSTOP), 16 bytes in the middle of its newest
  checkpoint are flipped, the trainer is killed and restarted with ``resume=auto``, which must skip
  that checkpoint (named in its log) and continue from the one before;
- ``sighup``: SIGHUP to the trainer (a closed terminal) at a moment of the next iteration: the
  trainer finishes the iteration, writes its checkpoint and exits with code 129 and one line; then
  a restart with ``resume=auto``;
- ``changed_resume``: the trainer is killed after an iteration and restarted with ``resume=auto``
  and another experiment (``env.group_size`` one larger): refused at start (exit 2) in one line
  naming ``env.group_size``, nothing in the run folder changed; then the restart of the same one;
- ``nan_reward``: the env's reward of one step turns NaN (a custom env, :func:`nan_reward_numberline`,
  a reward model gone wrong once: the supervisor creates a flag file, the first game that steps
  after it takes it): that episode is an env fault named in the log, left out of training, the run
  goes on (a schedule with this fault trains on that env, NumberLine otherwise unchanged);
- ``disk_full``: the filesystem of the checkpoints folder (a tmpfs mounted for the run when the
  supervisor may mount, else the trainer's file-size limit via ``prlimit``: EFBIG) is filled just
  below one checkpoint's size for one checkpoint write: the write is refused, the run goes on.

A fault is *survived* when it had its designed outcome (named above) and the run then finished.
Which faults fire is fixed by the seed: a scheduled fault that could not fire before the run ended
is counted in ``faults_not_fired`` and fails the run (exit code 1), never dropped silently.
At the end: ``metrics_consistent`` (the metrics lines are iterations ``0..N-1`` once each plus the
final evaluation, and equal the records stored in ``last.pt``), ``rows_lost_beyond_faulted``
(summed over iterations: rows collected - rows trained - rows left out for a fault; 0 when only
faulted episodes were lost) and, for ``--schedule kill-only`` and ``--schedule stops`` (faults that
stop and resume the run, nothing else), ``final_weights_equal_clean_run`` (the final weights against
an unfaulted run of the same seed; ``null`` for schedules with other faults, whose dropped episodes
change the training). Prints one JSON object as its LAST line::

    python benchmarks/chaos.py --iterations 30 --schedule mixed --seed 0
    python benchmarks/chaos.py --iterations 30 --schedule kill-only --seed 0
    python benchmarks/chaos.py --iterations 8 --schedule stops --seed 0     # SIGHUP, a changed experiment, a kill
    python benchmarks/chaos.py --iterations 8 --schedule safety --seed 0    # SIGHUP, a changed experiment, a NaN reward
    python benchmarks/chaos.py --schedule short     # 6 iterations: one kill + resume, one corrupted checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOKE = ["experiment=smoke", "eval_every=0", "env.num_groups=2", "env.group_size=2", "env.eval_episodes=2",
         "env.max_steps=3", "rollout.max_new_tokens=6", "progress=false", "warm_start.steps=0", "checkpoint_every=1",
         "env.num_workers=2"]
# collector_kill / engine_kill need the collector's own processes: a schedule with them collects with
# collector.kind=multiprocess
MULTIPROCESS = ["collector.kind=multiprocess", "rollout.engine=vllm", "collector.num_collectors=2"]
SCHEDULES = {
    "mixed": ["trainer_kill", "trainer_kill", "worker_kill", "worker_kill", "corrupt_checkpoint", "disk_full",
              "collector_kill", "engine_kill"],
    "kill-only": ["trainer_kill", "trainer_kill", "trainer_kill"],
    "stops": ["sighup", "changed_resume", "trainer_kill"],
    "safety": ["sighup", "changed_resume", "nan_reward"],
    "short": ["trainer_kill", "corrupt_checkpoint"],
}
#: schedules whose faults only stop and resume the run: its final weights are those of an unfaulted run
SAME_TRAINING = ("kill-only", "stops")
#: the env of a schedule with ``nan_reward``: NumberLine and its prompt, one reward NaN when the flag file appears
NAN_ENV = ["env.name=chaos_nan_numberline", "env.template=numberline"]
NAN_FLAG = "TORCHRL_AGENT_CHAOS_NAN_FLAG"


def register_nan_env() -> None:
    """Register ``chaos_nan_numberline``: NumberLine (``NumberLineEnv``'s arguments) whose game
    returns a NaN reward once, at the first step any game takes after the file named by
    ``$TORCHRL_AGENT_CHAOS_NAN_FLAG`` appears (the game that removes it, in the trainer or in an env
    worker process). A custom env with a bug, caused for real: the trainer sees what it would see
    from such an env. The trainer runs as ``chaos.py --trainer train OVERRIDES``, which registers it."""
    from torchrl_agent.envs import register_env
    from torchrl_agent.envs.base import TextEnv
    from torchrl_agent.envs.games.numberline import NumberLineGame

    class FlaggedNumberLine(NumberLineGame):
        def step(self, action):
            state, reward, terminated, success = super().step(action)
            flag = os.environ.get(NAN_FLAG)
            if flag:
                try:
                    os.unlink(flag)  # exactly one game takes it
                    reward = float("nan")
                except FileNotFoundError:
                    pass
            return state, reward, terminated, success

    def constructor(*, max_position: int = 5, min_distance: int = 1, max_distance: int | None = None,
                    invalid_reward: float = 0.0, observation: str = "absolute", max_steps: int = 10, **kwargs):
        return TextEnv(lambda: FlaggedNumberLine(max_position, min_distance, max_distance, invalid_reward, observation),
                       max_steps=max_steps, **kwargs)

    register_env("chaos_nan_numberline", constructor)

def _metrics(run: Path) -> list[dict]:
    out = []
    path = run / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _collector_processes(log: str) -> dict[str, int]:
    """``{name: pid}`` of the multi-process collector's engine server and collector processes, from the
    line a launch logs once they started (``collector processes started: torchrl_agent-engine (pid N), ...``)."""
    found: dict[str, int] = {}
    for line in log.splitlines():
        if "collector processes started:" in line:
            found = {m[0]: int(m[1]) for m in re.findall(r"(torchrl_agent-[\w-]+) \(pid (\d+)\)", line)}
    return found


def _is_env_worker(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"resource_tracker" not in cmdline and b"semaphore_tracker" not in cmdline


def _snapshot(run: Path) -> dict[str, str]:
    """SHA-256 of every file of the run folder but its lock (a refused launch may take a dead run's lock)."""
    import hashlib

    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


def _newest_checkpoint(folder: Path) -> Path | None:
    found = sorted(folder.glob("iteration_*.pt"))
    return found[-1] if found else None


class Disk:
    """The checkpoints folder's filesystem, to fill for one write: a tmpfs when mounting is allowed,
    else the trainer's RLIMIT_FSIZE (set on the running process with prlimit)."""

    def __init__(self, folder: Path, mb: int):
        self.folder, self.ballast, self.limited = folder, folder / "ballast.bin", None
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(folder)],
                              capture_output=True)
        self.method = "tmpfs" if done.returncode == 0 else "rlimit_fsize"

    def fill(self, pid: int, checkpoint_bytes: int) -> None:
        if self.method == "tmpfs":
            leave = checkpoint_bytes // 2
            with open(self.ballast, "wb") as f:
                try:
                    while (free := shutil.disk_usage(self.folder).free) > leave:
                        f.write(b"\0" * min(1 << 20, max(4096, free - leave)))
                        f.flush()
                except OSError:
                    pass
        else:
            self.limited = (pid, resource.prlimit(pid, resource.RLIMIT_FSIZE))
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (checkpoint_bytes // 2, self.limited[1][1]))

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)
        if self.limited is not None:
            pid, limits = self.limited
            try:
                resource.prlimit(pid, resource.RLIMIT_FSIZE, limits)
            except ProcessLookupError:
                pass
            self.limited = None

    def close(self) -> None:
        self.free()
        if self.method == "tmpfs":
            subprocess.run(["umount", "-l", str(self.folder)], check=False)


class Supervisor:
    def __init__(self, run: Path, overrides: list[str], logs: Path, trainer: list[str] | None = None,
                 env: dict | None = None):
        self.run, self.overrides, self.logs, self.env = run, overrides, logs, env
        self.trainer = trainer or [sys.executable, "-m", "torchrl_agent.trainers.cli"]
        self.launches: list[dict] = []
        self.proc: subprocess.Popen | None = None

    def start(self, resume: bool, changed: list[str] = ()) -> None:
        """A launch of the trainer; ``changed``: overrides that replace those of the same keys."""
        log = self.logs / f"launch_{len(self.launches)}.log"
        keys = {c.split("=", 1)[0] for c in changed}
        overrides = [o for o in self.overrides if o.split("=", 1)[0] not in keys] + list(changed)
        args = [*self.trainer, "train", *overrides, f"run_dir={self.run}"]
        if resume:
            args.append("resume=auto")
        handle = open(log, "w")
        self.proc = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=self.env)
        self.launches.append({"log": log, "handle": handle, "resume": resume, "pid": self.proc.pid})

    def log_text(self, index: int) -> str:
        return self.launches[index]["log"].read_text(errors="replace")

    def wait_exit(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        self.launches[-1]["handle"].close()
        self.launches[-1]["code"] = code
        return code

    def wait_or_kill(self, event: dict) -> None:
        """The run's exit code into ``event``: seconds by design, minutes on a loaded machine, never
        forever (after 900 s the run is killed and ``event["hung"]`` set)."""
        try:
            event["code"] = self.wait_exit(timeout=900)
        except subprocess.TimeoutExpired:
            event["hung"] = True
            self.proc.kill()
            event["code"] = self.wait_exit()


def run_chaos(out: Path, iterations: int, schedule: str, seed: int, clean: Path | None = None,
              timeout: float = 4 * 3600) -> dict:
    rng = random.Random(seed)
    kinds = list(SCHEDULES[schedule])
    rng.shuffle(kinds)
    # the faults at distinct iterations, spaced (each one's outcome is seen before the next), the last one
    # with two iterations after it: a resumed launch that trains fast cannot finish before it fires
    slots = list(range(1, iterations - 2))
    step = max(1, len(slots) // len(kinds))
    at = [slots[min(len(slots) - 1, i * step + rng.randrange(step))] for i in range(len(kinds))]
    events = [{"kind": k, "after_iteration": it, "fired": False, "survived": False} for k, it in zip(kinds, at)]
    run, logs = out / "run", out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    disk = Disk(run / "checkpoints", mb=256) if "disk_full" in kinds else None
    nan = "nan_reward" in kinds
    overrides = [*SMOKE, *(MULTIPROCESS if {"collector_kill", "engine_kill"} & set(kinds) else []),
                 *(NAN_ENV if nan else []), f"iterations={iterations}", f"seed={seed}"]
    flag = out / "nan_reward.flag"
    # with nan_reward the trainer runs as `chaos.py --trainer`, which registers the env first
    sup = Supervisor(run, overrides, logs, [sys.executable, str(Path(__file__).resolve()), "--trainer"] if nan else None,
                     {**os.environ, NAN_FLAG: str(flag)} if nan else None)
    resumes, deadline = 0, time.monotonic() + timeout
    sup.start(resume=disk is not None)  # a mounted checkpoints folder: resume=auto starts the (empty) run
    try:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the chaos run did not finish within {timeout:.0f} s (--timeout)")
            code = sup.proc.poll()
            if code is not None:
                sup.launches[-1]["handle"].close()
                sup.launches[-1]["code"] = code
                if code == 0:
                    break
                if len(sup.launches) > 3 * len(events) + 3:
                    raise RuntimeError(f"the trainer keeps failing (exit code {code}); see {sup.launches[-1]['log']}")
                sup.start(resume=True)  # an exit not caused by the supervisor: resume as a user would
                resumes += 1
                continue
            done = [r["iteration"] for r in _metrics(run)]
            pending = [e for e in events if not e["fired"]]
            # a fault only after the current launch trained an iteration itself: the previous fault's outcome
            # (a resume) is in its log before the next fault can cut it short
            trained = "metrics {" in sup.log_text(len(sup.launches) - 1)
            if pending and trained and done and max(done) >= pending[0]["after_iteration"] and max(done) < iterations:
                event = pending[0]
                event["fired"], event["launch"] = True, len(sup.launches) - 1
                kind = event["kind"]
                if kind == "trainer_kill":
                    # somewhere in the next iteration or its checkpoint write (an iteration lasts about as long
                    # as the last one did)
                    time.sleep(rng.uniform(0.0, _metrics(run)[-1].get("iteration_s", 1.0)))
                    sup.proc.kill()
                    sup.wait_exit()
                    sup.start(resume=True)
                    resumes += 1
                elif kind == "corrupt_checkpoint":
                    sup.proc.send_signal(signal.SIGSTOP)
                    newest = _newest_checkpoint(run / "checkpoints")
                    data = bytearray(newest.read_bytes())
                    middle = len(data) // 2
                    for i in range(middle, middle + 16):
                        data[i] ^= 0xFF
                    newest.write_bytes(bytes(data))
                    event["file"] = newest.name
                    sup.proc.kill()
                    sup.wait_exit()
                    sup.start(resume=True)
                    resumes += 1
                elif kind == "worker_kill":
                    # the env workers: the trainer's children, or the collector processes' (collector.kind=multiprocess)
                    owners = [pid for name, pid in _collector_processes(sup.log_text(event["launch"])).items()
                              if "collector-" in name] or [sup.proc.pid]
                    workers = [p for owner in owners for p in _children(owner) if _is_env_worker(p)]
                    if workers:
                        victim = rng.choice(workers)
                        os.kill(victim, signal.SIGKILL)
                        event["pid"] = victim
                elif kind in ("collector_kill", "engine_kill"):
                    # SIGKILL of a collector process / the engine server, at a moment of the next iteration: the
                    # collector names it and stops, so does the run (an error exit); then resume=auto
                    processes = sorted((name, pid) for name, pid in _collector_processes(
                        sup.log_text(event["launch"])).items() if ("engine" in name) == (kind == "engine_kill"))
                    time.sleep(rng.uniform(0.0, _metrics(run)[-1].get("iteration_s", 1.0)))
                    if processes:
                        event["victim"], event["pid"] = rng.choice(processes)
                        try:
                            os.kill(event["pid"], signal.SIGKILL)
                        except ProcessLookupError:
                            event["victim_gone"] = True
                    sup.wait_or_kill(event)
                    sup.start(resume=True)
                    resumes += 1
                elif kind == "sighup":
                    # a closed terminal: the iteration finishes, its checkpoint is written, exit 129 and one line
                    time.sleep(rng.uniform(0.0, _metrics(run)[-1].get("iteration_s", 1.0)))
                    sup.proc.send_signal(signal.SIGHUP)
                    sup.wait_or_kill(event)
                    sup.start(resume=True)
                    resumes += 1
                elif kind == "changed_resume":
                    # killed, then continued with another experiment (a larger group): refused, nothing touched
                    sup.proc.kill()
                    sup.wait_exit()
                    before = _snapshot(run)
                    group = next(int(o.split("=")[1]) for o in overrides if o.startswith("env.group_size="))
                    sup.start(resume=True, changed=[f"env.group_size={group + 1}"])
                    event["code"], event["group_size"] = sup.wait_exit(timeout=900), (group, group + 1)
                    event["run_dir_unchanged"] = _snapshot(run) == before
                    sup.start(resume=True)
                    resumes += 1
                elif kind == "nan_reward":
                    flag.write_text("")  # the next step of any game returns NaN
                    event["until_iteration"] = max(done) + 1
                elif kind == "disk_full":
                    newest = _newest_checkpoint(run / "checkpoints")
                    disk.fill(sup.proc.pid, newest.stat().st_size if newest else 1 << 20)
                    event["method"] = disk.method
                    event["until_iteration"] = max(done) + 2
                continue
            for e in events:  # a full disk lasts for one checkpoint write
                if e["kind"] == "disk_full" and e["fired"] and "freed" not in e and done and max(done) >= e["until_iteration"]:
                    disk.free()
                    e["freed"] = True
            time.sleep(0.05)
        result = _check(run, iterations, events, sup)
        state = None
        if schedule in SAME_TRAINING:
            from torchrl_agent.trainers.checkpointing import read_checkpoint

            state = read_checkpoint(run / "checkpoints" / "last.pt")["model"]
    finally:
        if sup.proc is not None and sup.proc.poll() is None:
            sup.proc.kill()
        if disk is not None:
            disk.close()
    result.update(resumes=resumes, schedule=schedule, seed=seed, launches=len(sup.launches),
                  disk_full_method=disk.method if disk else None)
    result["final_weights_equal_clean_run"] = None
    if state is not None:
        result["final_weights_equal_clean_run"] = _equal_to_clean_run(out, overrides, state, clean)
    return result


def _check(run: Path, iterations: int, events: list[dict], sup: Supervisor) -> dict:
    from torchrl_agent.trainers.checkpointing import read_checkpoint
    from torchrl_agent.trainers.run_dir import checkpoint_history, records_digest

    records = _metrics(run)
    its = [r["iteration"] for r in records]
    state = read_checkpoint(run / "checkpoints" / "last.pt")
    history = checkpoint_history(run / "checkpoints" / "last.pt", state)  # metrics.jsonl checked against its digest
    consistent = (its == list(range(iterations + 1)) and records[:-1] == history
                  and state["history_sha256"] == records_digest(records[:-1]))
    lost = 0
    for r in records[:-1]:
        trained = round(r.get("episodes", 0) * r.get("episode_length", 0)) if "episodes" in r else 0
        lost += r["env_steps"] - trained - r.get("fault_rows_dropped", 0)
    for e in events:
        if not e["fired"]:
            continue
        nxt = e["launch"] + (2 if e["kind"] == "changed_resume" else 1)  # after the refused launch
        later = sup.log_text(nxt) if nxt < len(sup.launches) else ""
        same = sup.log_text(e["launch"])
        if e["kind"] == "trainer_kill":
            e["survived"] = "resumed from" in later
        elif e["kind"] == "corrupt_checkpoint":
            e["survived"] = f"skipped checkpoint {run / 'checkpoints' / e['file']}" in later and "resumed from" in later
        elif e["kind"] == "worker_kill":
            e["survived"] = "pid" in e and "worker fault" in same + later
        elif e["kind"] in ("collector_kill", "engine_kill"):
            # named with its exit code in the killed launch's log, which ended with an error (not a hang, not
            # the supervisor's kill); the next launch resumed
            e["survived"] = ("pid" in e and f"{e['victim']} (pid {e['pid']}, exit code -9) exited" in same
                             and e.get("code") not in (None, 0, -signal.SIGKILL) and "resumed from" in later)
        elif e["kind"] == "sighup":
            e["survived"] = (e.get("code") == 128 + signal.SIGHUP and "stopped by SIGHUP after iteration" in same
                             and "resumed from" in later)
        elif e["kind"] == "changed_resume":
            # refused in one line naming the key (exit 2), nothing in the run folder changed; then resumed
            old, new = e["group_size"]
            refused = sup.log_text(e["launch"] + 1)
            e["survived"] = (e.get("code") == 2 and f"env.group_size ({old} -> {new})" in refused
                             and e["run_dir_unchanged"] and "resumed from" in later)
        elif e["kind"] == "nan_reward":
            # one game's reward NaN: named in the log, an env fault of its episode, the run went on
            # (the flag waits for the next step a game takes: in a later launch when this one was stopped first)
            after = "".join(sup.log_text(i) for i in range(e["launch"], len(sup.launches)))
            e["survived"] = ("returned a non-finite reward nan" in after and "ended by a fault, left out of training" in after
                             and not (sup.logs.parent / "nan_reward.flag").exists())
        elif e["kind"] == "disk_full":
            e["survived"] = any(s in same for s in ("No space left", "File too large")) and "training continues" in same
    fired = [e for e in events if e["fired"]]
    return {
        "faults_scheduled": len(events),  # a fault that did not fire is a failure (faults_not_fired), not dropped
        "faults_not_fired": len(events) - len(fired),
        "iterations_done": len({i for i in its if i < iterations}),
        "faults_injected": len(fired),
        "faults_survived": sum(e["survived"] for e in fired),
        "rows_lost_beyond_faulted": lost,
        "metrics_consistent": consistent,
        "env_faults_in_metrics": sum(r.get("env_faults", 0) for r in records),
        "faults": [{k: v for k, v in e.items() if k in ("kind", "after_iteration", "fired", "survived", "file", "method",
                                                        "victim", "code", "hung", "run_dir_unchanged")}
                   for e in events],
    }


def clean_run_args(iterations: int, seed: int, run_dir: Path) -> list[str]:
    """The command of the unfaulted run the kill-only schedule compares with (``--clean``: run it
    beforehand or beside the chaos run)."""
    return [sys.executable, "-m", "torchrl_agent.trainers.cli", "train", *SMOKE, f"iterations={iterations}",
            f"seed={seed}", f"run_dir={run_dir}"]


def _equal_to_clean_run(out: Path, overrides: list[str], state: dict, clean: Path | None = None) -> bool:
    import torch

    from torchrl_agent.trainers.checkpointing import read_checkpoint

    if clean is None or not (clean / "checkpoints" / "last.pt").exists():
        clean = clean or out / "clean"
        done = subprocess.run([sys.executable, "-m", "torchrl_agent.trainers.cli", "train", *overrides,
                               f"run_dir={clean}"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the clean run failed:\n{done.stderr[-2000:]}")
    reference = read_checkpoint(clean / "checkpoints" / "last.pt")["model"]
    return reference.keys() == state.keys() and all(torch.equal(reference[k], state[k]) for k in reference)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=None, help="training iterations (default 30; short: 6)")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="mixed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="working folder (default: a temporary one, removed)")
    parser.add_argument("--clean", default=None, help="kill-only: the run directory of the unfaulted run (made "
                        "with `--print-clean-command`'s command; run when missing)")
    parser.add_argument("--print-clean-command", action="store_true", help="print the unfaulted run's command and exit")
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="seconds before the run is given up")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--trainer"]:  # the trainer of a schedule with nan_reward: its env registered first
        from torchrl_agent.trainers.cli import main as cli

        register_nan_env()
        return cli(argv[1:])
    args = parser.parse_args(argv)
    iterations = args.iterations or (6 if args.schedule == "short" else 30)
    if iterations < len(SCHEDULES[args.schedule]) + 3:
        parser.error(f"--iterations must be >= {len(SCHEDULES[args.schedule]) + 3} for --schedule {args.schedule}")
    if args.print_clean_command:
        print(" ".join(clean_run_args(iterations, args.seed, Path(args.clean or "runs/chaos_clean"))))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        t0 = time.perf_counter()
        result = run_chaos(out, iterations, args.schedule, args.seed, Path(args.clean) if args.clean else None,
                           args.timeout)
        result["wall_s"] = round(time.perf_counter() - t0, 1)
    result = {k: result[k] for k in ("iterations_done", "faults_scheduled", "faults_injected", "faults_survived",
                                       "faults_not_fired", "resumes",
                                       "rows_lost_beyond_faulted", "metrics_consistent",
                                       "final_weights_equal_clean_run")} | result
    print(json.dumps(result))
    ok = (result["faults_not_fired"] == 0 and result["faults_survived"] == result["faults_injected"] and result["rows_lost_beyond_faulted"] == 0
          and result["metrics_consistent"] and result["final_weights_equal_clean_run"] is not False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

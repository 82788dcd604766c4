"""The run directory: a folder of its own for every run, held by one run at a time, its
``metrics.jsonl`` always in step with the checkpoint it continues from.

- :func:`new_run_dir`: ``runs/<YYYYmmdd-HHMMSS>``, created with an atomic ``mkdir`` (``-2``, ``-3``,
  ... appended when a run started in the same second took it), so runs started together without
  ``run_dir=`` never share a folder.
- :class:`RunDirLock`: ``RUN_DIR/.lock`` holds the holder's pid, host and process start time,
  created atomically (a link, which fails if the lock exists). A second run on the folder
  (``resume=auto`` while the first still runs) is refused naming the holder; a lock left by a dead
  process of this host (``kill -9``) is taken over with a message. Released on any exit that
  Python sees (the end of the run, an exception, SIGINT / SIGTERM / SIGHUP, ``atexit``).
- :func:`check_run_dir`: what a run may do with its folder: start (it is new or empty), continue
  (``resume=``), or be refused with a message naming the next step (a used folder without
  ``resume=``; ``resume=auto`` on metrics that no checkpoint covers, whose curve a fresh start
  would overwrite).
- :func:`open_metrics`: ``metrics.jsonl`` rewritten from the checkpoint's own records (so the
  lines are exactly the iterations the checkpoint trained, none repeated or skipped after a
  resume) and opened for appending.
- :func:`checkpoint_history`: those records, read back from the ``metrics.jsonl`` of the
  checkpoint's run folder (the history is kept there once, not in every checkpoint) and checked
  against the count and digest (:func:`records_digest`) the checkpoint holds.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path

__all__ = ["STOP_SIGNALS", "GuardedSink", "RunDirBusyError", "RunInterrupted", "StopSignals", "open_tensorboard", "RunDirLock", "check_run_dir", "checkpoint_history", "metrics_iterations", "new_run_dir", "open_metrics"]

logger = logging.getLogger("torchrl_agent")


class RunDirBusyError(ValueError):
    """The run directory is held by another live run (its pid and host in the message)."""


def new_run_dir(root: str | Path = "runs") -> Path:
    """A new, empty folder ``root/<timestamp>[-n]``, created atomically (never one another run has)."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"run_dir (default: {root}/ here): {root} cannot be created ({type(err).__name__}: "
                         f"{err.strerror or err}); pass run_dir= a writable folder") from None
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1, 10_000):
        path = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new run directory under {root}")


# ----------------------------------------------------------------------------------- the lock
def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or ``None``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    """Whether process ``pid`` of this host is the one that took the lock (a reused pid is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    now = _start_time(pid)
    return started is None or now is None or now == started


class RunDirLock:
    """``RUN_DIR/.lock``: this process holds the run directory (see the module notes).

    ``acquire()`` raises :class:`RunDirBusyError` when a live run holds it; ``release()`` removes
    the lock if it is still this process's (also run at exit)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ".lock"
        self.held = False
        self.info = {"pid": os.getpid(), "host": socket.gethostname(), "started": _start_time(os.getpid()),
                     "since": datetime.datetime.now().isoformat(timespec="seconds")}

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def acquire(self) -> RunDirLock:
        tmp = self.run_dir / f".lock.{os.getpid()}.tmp"
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.info))
        except OSError as err:  # a read-only or full file system, a file where a folder goes: one line
            raise ValueError(f"run_dir={self.run_dir}: cannot be written ({type(err).__name__}: {err.strerror or err}); "
                             "choose another run_dir") from None
        try:
            for _ in range(3):
                try:
                    os.link(tmp, self.path)  # atomic: fails if a lock exists; the lock is never half-written
                    self.held = True
                    atexit.register(self.release)
                    return self
                except FileExistsError:
                    pass
                holder = self._read()
                if holder is None:  # unreadable: being replaced right now, or garbage
                    time.sleep(0.2)
                    holder = self._read()
                    if holder is None:
                        logger.warning("run_dir=%s: an unreadable lock file %s, taken over", self.run_dir, self.path)
                        self.path.unlink(missing_ok=True)
                        continue
                if holder.get("pid") == os.getpid() and holder.get("host") == self.info["host"]:
                    self.held = True  # this process took it already (a second Trainer in one process)
                    return self
                if holder.get("host") != self.info["host"]:
                    raise RunDirBusyError(
                        f"run_dir={self.run_dir} is held by pid {holder.get('pid')} on host {holder.get('host')} "
                        f"(since {holder.get('since')}): wait for that run to end, or choose another run_dir; if it is "
                        f"gone, delete {self.path}")
                if _alive(int(holder.get("pid", -1)), holder.get("started")):
                    raise RunDirBusyError(
                        f"run_dir={self.run_dir} is held by a running run (pid {holder.get('pid')} on this host, since "
                        f"{holder.get('since')}): wait for it to end or stop it (it saves a checkpoint on SIGTERM), "
                        "or choose another run_dir")
                logger.warning("run_dir=%s: taking over the lock of pid %s (since %s), which is no longer running",
                               self.run_dir, holder.get("pid"), holder.get("since"))
                stale = self.run_dir / f".lock.stale.{os.getpid()}"
                try:
                    os.replace(self.path, stale)  # only one taker wins the stale lock
                    stale.unlink()
                except FileNotFoundError:
                    pass
            raise RunDirBusyError(f"run_dir={self.run_dir}: could not take the lock {self.path}; choose another run_dir")
        finally:
            tmp.unlink(missing_ok=True)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = self._read()
        if holder is not None and holder.get("pid") == self.info["pid"] and holder.get("host") == self.info["host"]:
            self.path.unlink(missing_ok=True)
        try:
            atexit.unregister(self.release)
        except Exception:
            pass


# ----------------------------------------------------------------------------------- start / continue / refuse
def metrics_iterations(run_dir: str | Path) -> list[int]:
    """The iterations of the complete lines of ``RUN_DIR/metrics.jsonl`` (a line cut by a kill is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(int(json.loads(line)["iteration"]))
            except (ValueError, KeyError, TypeError):
                continue
    return out


RUN_FILES = ("metrics.jsonl", "checkpoints")
"""What a run writes into its folder; a folder holding any of them holds a run."""


def run_files(run_dir) -> list[Path]:
    """The :data:`RUN_FILES` that ``run_dir`` holds (empty: no run has written there)."""
    return [Path(run_dir) / name for name in RUN_FILES if (Path(run_dir) / name).exists()]


def check_run_dir(run_dir: Path, resume: str | None, checkpoint_every: int) -> tuple[Path | None, dict | None]:
    """The checkpoint to continue from and its verified state (``(None, None)``: a new run), or a
    ``ValueError`` whose message names the next step:

    - no ``resume=`` and the folder holds a run (``metrics.jsonl`` or ``checkpoints/``): refused;
    - ``resume=auto`` and no usable checkpoint: a new run if the folder has no metrics, or only
      metrics up to where the first checkpoint would have been written (the run died before it:
      nothing trained is lost); refused otherwise (a fresh start would overwrite the curve).
    """
    if resume is None:
        used = [path.name for path in run_files(run_dir)]
        if used:
            raise ValueError(f"run_dir={run_dir} already holds a run ({', '.join(used)}): pass resume=auto to "
                             "continue it, or choose another run_dir")
        return None, None
    from torchrl_agent.trainers.checkpointing import resolve_resume

    path, state = resolve_resume(resume, run_dir)
    if path is not None:
        return path, state
    done = metrics_iterations(run_dir)
    if not done:
        logger.info("resume=auto: no checkpoint in %s, starting a new run", run_dir)
        return None, None
    if checkpoint_every and max(done) < checkpoint_every:
        logger.warning("resume=auto: no checkpoint in %s yet (the run stopped before its first one, at iteration "
                       "%d): starting over, its metrics of iterations %s are replaced", run_dir,
                       checkpoint_every - 1, sorted(set(done)))
        return None, None
    raise ValueError(
        f"resume=auto: run_dir={run_dir} holds metrics of iterations {min(done)}..{max(done)} but no checkpoint to "
        f"continue from (checkpoint_every={checkpoint_every}); a new run would overwrite that curve: choose another "
        "run_dir (and set checkpoint_every, e.g. checkpoint_every=1, to be able to resume)")


def records_digest(records: list[dict]) -> str:
    """SHA-256 of ``records`` as the lines of ``metrics.jsonl`` (strict JSON, one per record)."""
    import hashlib

    digest = hashlib.sha256()
    for record in records:
        digest.update((json.dumps(record, allow_nan=False) + "\n").encode())
    return digest.hexdigest()


def checkpoint_history(path: Path, state: dict) -> list[dict]:
    """The metrics records checkpoint ``path`` (its ``state``) was written after: its own
    ``"history"`` (an earlier version's checkpoint), else the lines of ``metrics.jsonl`` of its run
    folder (``RUN/checkpoints/X.pt`` -> ``RUN``) up to its iteration, checked against the count and
    digest it holds. A mismatch (lines lost or edited since) is logged and the records found are
    used: the training state does not depend on them, only the curve and the plot."""
    if "history" in state:
        return list(state["history"])
    path = Path(path)
    run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    records = []
    if (run / "metrics.jsonl").exists():
        for line in (run / "metrics.jsonl").read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line cut by a kill
                continue
            if isinstance(record, dict) and isinstance(record.get("iteration"), int) \
                    and record["iteration"] <= state["iteration"]:
                records.append(record)
    want = state.get("history_records")
    if want is not None and (len(records) != want or records_digest(records) != state.get("history_sha256")):
        logger.warning("resume: %s holds %d metrics records up to iteration %d, not the %d checkpoint %s was written "
                       "after (lines lost or changed since): the history and the curve go on from what is there",
                       run / "metrics.jsonl", len(records), state["iteration"], want, path)
    return records


def open_metrics(run_dir: Path, history: list[dict]):
    """``RUN_DIR/metrics.jsonl`` holding exactly the records of ``history`` (the resumed
    checkpoint's; ``[]`` for a new run), written atomically, opened for appending."""
    path = run_dir / "metrics.jsonl"
    tmp = path.with_name("metrics.jsonl.tmp")
    with open(tmp, "w") as f:
        for record in history:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return open(path, "a")


def open_tensorboard(folder: Path):
    """A :class:`GuardedSink` over TensorBoard's ``SummaryWriter`` in ``folder``; ``None`` (logged
    once) when it cannot even be created. The writer's background thread reports a failed write on
    the next call (logged once by the sink): its own traceback is not printed."""
    import threading

    from torch.utils.tensorboard import SummaryWriter

    previous = threading.excepthook
    if not getattr(previous, "_torchrl_agent", False):
        def hook(args):
            if type(args.thread).__name__ == "_AsyncWriterThread":  # TensorBoard's writer: surfaced by the sink
                return
            previous(args)

        hook._torchrl_agent = True
        threading.excepthook = hook
    try:
        return GuardedSink("TensorBoard", SummaryWriter(str(folder)))
    except Exception as err:  # noqa: BLE001 - a logging view must never end training
        logger.error("TensorBoard is off (%s: %s); metrics.jsonl, the run's record, goes on", type(err).__name__, err)
        return None


class GuardedSink:
    """A TensorBoard ``SummaryWriter`` or a W&B run whose write errors never end the run.

    ``metrics.jsonl`` is the run's record; TensorBoard and W&B are views of it. The first error of
    a sink (a full disk: ``OSError``; a W&B connection error) is logged once, naming the sink and
    that ``metrics.jsonl`` goes on; the sink is then left alone. Calls go through to the wrapped
    object (``add_scalar``, ``log``, ``close``, ...)."""

    def __init__(self, name: str, target):
        self.name, self.target, self.failed = name, target, False

    def __getattr__(self, attr):
        method = getattr(self.target, attr)
        if not callable(method):
            return method

        def guarded(*args, **kwargs):
            if self.failed:
                return None
            try:
                return method(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - a logging view must never end training
                self.failed = True
                logger.error("%s stopped logging (%s: %s); metrics.jsonl, the run's record, goes on", self.name,
                             type(err).__name__, str(err).splitlines()[0] if str(err) else "")
                return None

        return guarded


# ----------------------------------------------------------------------------------- stop signals
#: the signals that stop a run at the end of its iteration, with a checkpoint
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

class RunInterrupted(Exception):
    """The run stopped on SIGINT / SIGTERM / SIGHUP at a safe point, with a checkpoint; ``exit_code``
    is ``128 + signal`` (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP), the message says how to
    continue."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum, self.exit_code = signum, 128 + signum


class StopSignals:
    """SIGINT (Ctrl-C), SIGTERM (what a scheduler sends before its kill) and SIGHUP (the terminal
    closed, the SSH session dropped) ask the run to stop at its next safe point (the end of the current iteration: :attr:`requested` is set; the trainer
    saves a checkpoint and raises :class:`RunInterrupted`) instead of killing it mid-update. A second
    signal stops at once (``KeyboardInterrupt``). :meth:`install` / :meth:`uninstall` (or a context
    manager): the previous handlers come back after. Outside the main thread (signals cannot be
    caught there) it does nothing."""

    def __init__(self):
        self.requested: int | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} received twice")
        self.requested = signum
        logger.warning("%s received: stopping at the end of this iteration with a checkpoint (send it again to "
                       "stop now, without one)", signal.Signals(signum).name)

    def install(self) -> StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread() and not self._previous:
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    __enter__ = install

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def stop_message(self, run_dir: Path, checkpoint: Path | None, iteration: int) -> RunInterrupted:
        """The :class:`RunInterrupted` to raise once the run stopped after ``iteration``."""
        name = signal.Signals(self.requested).name
        return RunInterrupted(f"stopped by {name} after iteration {iteration}, checkpoint {checkpoint}; continue "
                              f"with: torchrl-agent train <the same overrides> resume=auto run_dir={run_dir}",
                              self.requested)

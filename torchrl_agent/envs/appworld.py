"""AppWorld: complete a user's day-to-day task by writing Python against 9 real apps' APIs.

Each game runs in AppWorld's own sandbox (``appworld`` package, Trivedi et al. 2024): an IPython
shell with AppWorld's safety guard and frozen clock, where ``apis.<app>.<api>(...)`` calls the
apps (Simple Note, Spotify, Venmo, Gmail, ...) on their SQLite databases.

* the **action** is Python code: the content of the first ``<code>...</code>`` in the action
  string, or the whole string when it has no such tags. Its printed output (or AppWorld's error
  message) is the next observation. Any string is accepted: code that fails is answered with the
  traceback, as AppWorld does;
* the episode ends when the code calls ``apis.supervisor.complete_task(...)`` (or after 50
  steps); then the task is checked (AppWorld's evaluator on its own tasks, the task's checker on
  the project's tasks) and the reward is **10 on success**, 0 otherwise (the reference's rule);
* ``task`` holds the supervisor's details and the instruction (the reference puts both in every
  prompt); ``admissible_actions`` and ``expert_action`` are ``""``; ``task_type`` is the task's
  scenario (the part of its id before ``_``).

Tasks: with AppWorld's data (``appworld download data``; ``data_dir=`` the folder that holds
``data/``) the train split is AppWorld's ``train`` set and the eval split its ``test_normal``
set, checked by AppWorld's evaluator. Without it, the env uses tasks written for this project
against the real Simple Note and supervisor APIs (``data/appworld/tasks.json`` in the package):
their databases are built once per machine from each task's records plus AppWorld's own model
factories, and each task has a checker run on the databases after the episode.

Running AppWorld: ``appworld`` pins ``pydantic<2`` (and ``fastapi``/``SQLAlchemy`` versions)
that cannot share an environment with vLLM, so it lives in its own virtual environment
(``make appworld`` creates ``.venv-appworld`` and runs ``appworld install``). Each game talks to a
worker process on that Python (:mod:`torchrl_agent.envs.appworld_worker`) over JSON lines, as the
reference talks to one AppWorld server per environment. A worker that dies or stops answering
ends its episode (observation says why, reward 0) and is restarted at the next reset.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import select
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from torchrl_agent.envs.base import GameState, TextEnv, TextGame, _as_str_list

__all__ = ["AppWorldEnv", "AppWorldGame", "AppWorldWorker", "load_project_tasks", "parse_code", "appworld_python"]

logger = logging.getLogger(__name__)

TASKS_FILE = Path(__file__).parent / "data" / "appworld" / "tasks.json"
WORKER_SCRIPT = Path(__file__).with_name("appworld_worker.py")
_CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"^```(?:python|py)?\s*\n(.*?)\n?```\s*$", re.DOTALL)


def parse_code(action: str) -> str:
    """The code of an action: the first ``<code>...</code>`` content, else the whole string (a Markdown fence removed)."""
    match = _CODE.search(action)
    code = match.group(1) if match else action
    fence = _FENCE.match(code.strip())
    return fence.group(1) if fence else code.strip("\n")


#: Where ``make appworld`` puts AppWorld's Python.
DEFAULT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-appworld" / "bin" / "python"


def appworld_python(python: str | os.PathLike | None = None) -> Path:
    """The Python that has ``appworld`` installed: ``python``, ``$TORCHRL_AGENT_APPWORLD_PYTHON``, or ``.venv-appworld``."""
    given = python or os.environ.get("TORCHRL_AGENT_APPWORLD_PYTHON")
    if given:
        if not Path(given).is_file():
            raise FileNotFoundError(f"AppWorld python {given} does not exist")
        return Path(given)
    if DEFAULT_PYTHON.is_file():
        return DEFAULT_PYTHON
    raise FileNotFoundError(
        "AppWorld needs its own Python environment (appworld pins pydantic<2, which vLLM cannot share): "
        "run `make appworld` (creates .venv-appworld and runs `appworld install`), or pass python=/path/to/python "
        "or set TORCHRL_AGENT_APPWORLD_PYTHON"
    )


def load_project_tasks() -> list[dict]:
    """The AppWorld tasks written for this project (records, instruction, checker), in file order."""
    return json.loads(TASKS_FILE.read_text(encoding="utf-8"))["tasks"]


class AppWorldWorker:
    """One worker process on AppWorld's Python, spoken to with JSON lines (see :mod:`~torchrl_agent.envs.appworld_worker`)."""

    def __init__(self, python: Path, *, timeout: float = 300.0, log_path: Path | None = None):
        self.python, self.timeout, self.log_path = Path(python), float(timeout), log_path
        self.process: subprocess.Popen | None = None

    def _start(self) -> None:
        stderr = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ""}
        self.process = subprocess.Popen([str(self.python), str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=stderr, env=env, text=True, bufsize=1)
        if stderr is not subprocess.DEVNULL:
            stderr.close()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def send(self, request: dict) -> None:
        if not self.alive:
            self._start()
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            self.kill()
            raise RuntimeError(f"AppWorld worker is gone ({err})") from err

    def receive(self, timeout: float | None = None) -> dict:
        timeout = self.timeout if timeout is None else timeout
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            code = self.process.poll()
            self.kill()
            raise RuntimeError("AppWorld worker " + (f"exited with code {code}" if code is not None
                                                     else f"did not answer within {timeout:.0f} s"))
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"AppWorld: {reply.get('error')}")
        return reply

    def request(self, request: dict, timeout: float | None = None) -> dict:
        self.send(request)
        return self.receive(timeout)

    def kill(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        self.process = None

    def close(self) -> None:
        if self.alive:
            try:
                self.request({"op": "close"}, timeout=30)
            except (RuntimeError, ValueError):
                pass
        self.kill()


def _default_cache_dir() -> Path:
    return Path(os.environ.get("TORCHRL_AGENT_CACHE", Path.home() / ".cache" / "torchrl_agent"))


def build_project_root(python: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """The AppWorld data folder of the project's tasks, built once (about 20 s) and cached."""
    tasks_text = TASKS_FILE.read_bytes()
    key = hashlib.blake2b(tasks_text + WORKER_SCRIPT.read_bytes() + str(python).encode(), digest_size=8).hexdigest()
    root = Path(cache_dir or _default_cache_dir()) / "appworld" / f"project-{key}"
    if (root / "data" / "tasks").is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    worker = AppWorldWorker(python, timeout=600, log_path=tmp / "worker.log")
    try:
        worker.request({"op": "build", "root": str(tmp), "tasks": load_project_tasks()})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        worker.close()
    try:
        os.rename(tmp, root)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return root


class AppWorldGame(TextGame):
    """One AppWorld episode on a worker process; seed ``s`` opens task ``(s // 2) % len(task_ids)``."""

    def __init__(self, root: Path, task_ids: Sequence[str], checks: dict[str, dict], python: Path, *,
                 max_steps: int = 50, timeout: float = 300.0, ground_truth: bool = False, experiment: str = "torchrl_agent"):
        self.root, self.task_ids, self.checks = root, tuple(task_ids), checks
        self.max_steps, self.ground_truth, self.experiment = max_steps, ground_truth, experiment
        self.worker = AppWorldWorker(python, timeout=timeout, log_path=root / "worker.log")
        self.task_id, self.task, self.steps, self.broken = "", "", 0, False
        self.detail = ""
        self.defer_reset, self._reset_sent, self.awaiting_reset = False, False, False

    def reset(self, seed: int) -> GameState:
        """Open task ``(seed // 2) % len(task_ids)``. With ``defer_reset`` set, only send the request
        (the env then calls :meth:`finish_reset` for every game, so the worlds open in parallel)."""
        self.task_id = self.task_ids[(int(seed) // 2) % len(self.task_ids)]
        self.steps, self.broken, self.detail, self.awaiting_reset = 0, False, "", True
        try:
            self.worker.send({"op": "reset", "root": str(self.root), "task_id": self.task_id,
                              "experiment": self.experiment, "ground_truth": self.ground_truth})
            self._reset_sent = True
        except RuntimeError:
            self._reset_sent = False
        return GameState("") if self.defer_reset else self.finish_reset()

    def finish_reset(self) -> GameState:
        """Wait for the world opened by :meth:`reset`; return the episode's first state."""
        self.awaiting_reset = False
        try:
            if not self._reset_sent:
                raise RuntimeError("the worker could not be started")
            self._reset_sent = False
            reply = self.worker.receive()
        except (RuntimeError, ValueError) as err:
            self.broken, self.task = True, f"AppWorld task {self.task_id}"
            return self._state(f"The AppWorld environment failed to start: {err}")
        s = reply["supervisor"]
        self.task = (f"My name is: {s['first_name']} {s['last_name']}. My personal email is {s['email']} and phone "
                     f"number is {s['phone_number']}.\nTask: {reply['instruction']}")
        return self._state("Write Python code inside <code> </code> to use the apps' APIs (start with "
                           "print(apis.api_docs.show_app_descriptions())). Call apis.supervisor.complete_task() "
                           "when the task is done (with answer=... when it asks a question).")

    def _state(self, observation: str) -> GameState:
        return GameState(observation=observation, task=self.task, task_type=self.task_id.split("_")[0])

    def send_step(self, action: str) -> bool:
        """Send ``action``'s code to the worker without waiting (the env steps every game at once)."""
        if self.broken:
            return False
        try:
            self.worker.send({"op": "step", "code": parse_code(action)})
            return True
        except RuntimeError:
            return False

    def step(self, action: str, sent: bool = False) -> tuple[GameState, float, bool, bool]:
        if self.broken:
            return self._state("The AppWorld environment is not available; the episode has ended."), 0.0, True, False
        self.steps += 1
        try:
            if not sent:
                self.worker.send({"op": "step", "code": parse_code(action)})
            reply = self.worker.receive()
        except (RuntimeError, ValueError) as err:
            if self.worker.alive:  # the code raised inside AppWorld's own machinery: report it, go on
                return self._state(f"Execution failed: {err}"), 0.0, False, False
            self.broken = True
            return self._state(f"The AppWorld environment failed: {err}"), 0.0, True, False
        output = reply["output"]
        if not (reply["completed"] or self.steps >= self.max_steps):
            return self._state(output), 0.0, False, False
        try:
            result = self.worker.request({"op": "evaluate", "check": self.checks.get(self.task_id)})
            success, self.detail = bool(result["success"]), result["detail"]
        except (RuntimeError, ValueError) as err:
            success, self.detail = False, f"evaluation failed: {err}"
        return self._state(output), 10.0 if success else 0.0, bool(reply["completed"]), success

    def close(self) -> None:
        self.worker.close()
        shutil.rmtree(self.root / "experiments" / "outputs" / self.experiment, ignore_errors=True)


class AppWorldEnv(TextEnv):
    """A batch of AppWorld games (one worker process each). See the module doc for the rules.

    Args:
        data_dir: the folder that holds AppWorld's ``data/`` (``appworld download data``); ``None``
            uses the project's tasks.
        train_dataset, eval_dataset: AppWorld datasets of the two splits (``train``, ``test_normal``).
        python: AppWorld's Python (:func:`appworld_python`).
        task_ids: explicit task ids instead (both splits).
        max_steps: 50, as the reference. timeout: seconds a worker may take for one request.
        cache_dir: where the project tasks' AppWorld data is built (``$TORCHRL_AGENT_CACHE``).
    """

    def __init__(
        self,
        *,
        data_dir: str | None = None,
        train_dataset: str = "train",
        eval_dataset: str = "test_normal",
        python: str | None = None,
        task_ids: Sequence[str] | None = None,
        max_steps: int = 50,
        timeout: float = 300.0,
        cache_dir: str | None = None,
        split: Literal["train", "eval"] = "train",
        **kwargs,
    ):
        self.python = appworld_python(python)
        if data_dir:
            root = Path(data_dir).expanduser()
            if not (root / "data" / "tasks").is_dir():
                raise FileNotFoundError(f"data_dir {root} has no data/tasks folder (run `appworld download data` there)")
            checks: dict[str, dict] = {}
            if task_ids is None:
                lister = AppWorldWorker(self.python, timeout=timeout)
                try:
                    dataset = eval_dataset if split == "eval" else train_dataset
                    task_ids = lister.request({"op": "list", "root": str(root), "dataset": dataset})["task_ids"]
                finally:
                    lister.close()
        else:
            root = build_project_root(self.python, cache_dir)
            tasks = load_project_tasks()
            checks = {t["id"]: t["check"] for t in tasks}
            if task_ids is None:
                task_ids = [t["id"] for t in tasks if t["split"] == ("test" if split == "eval" else "train")]
        if not task_ids:
            raise ValueError(f"no AppWorld tasks for split={split!r}")
        unknown = [t for t in task_ids if not data_dir and t not in checks]
        if unknown:
            raise ValueError(f"unknown project task ids {unknown}; known: {sorted(checks)}")
        self.root, self.task_ids = root, list(task_ids)
        ground_truth, names = bool(data_dir), iter(range(1 << 30))
        super().__init__(lambda: AppWorldGame(root, self.task_ids, checks, self.python, max_steps=max_steps,
                                              timeout=timeout, ground_truth=ground_truth,
                                              experiment=f"torchrl_agent-{os.getpid()}-{next(names)}"),
                         max_steps=max_steps, split=split, **kwargs)

    def _reset(self, tensordict=None, **kwargs):
        for game in self.games:  # send every reset first: the worlds open in parallel
            game.defer_reset = True
        try:
            super()._reset(tensordict, **kwargs)
        finally:
            for game in self.games:
                game.defer_reset = False
        for i, game in enumerate(self.games):
            if game.awaiting_reset:
                self._states[i] = game.finish_reset()
        n = self.batch_size[0]
        return self._observation_td(None, np.zeros(n, dtype=bool), np.zeros(n, dtype=bool))

    def _step(self, tensordict):
        n = self.batch_size[0]
        actions = _as_str_list(tensordict.get("action"), n)
        sent = [not self._done[i] and self.games[i].send_step(actions[i]) for i in range(n)]  # all run at once
        reward = np.zeros(n, dtype=np.float32)
        terminated, truncated = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        for i in range(n):
            if self._done[i]:
                terminated[i] = True
                continue
            self._record_step(i, self.games[i].step(actions[i], sent=sent[i]), reward, terminated, truncated)
        return self._observation_td(reward, terminated, truncated)

    def close(self, *args, **kwargs):
        for game in self.games:
            game.close()
        return super().close(*args, **kwargs)

    def __del__(self):
        for game in getattr(self, "games", []):
            try:
                game.worker.kill()
            except Exception:  # interpreter shutdown
                pass


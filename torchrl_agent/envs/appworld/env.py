"""The AppWorld game (one task on a worker process) and its batched env."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from torchrl_agent.envs.appworld.client import AppWorldWorker, appworld_python
from torchrl_agent.envs.appworld.tasks import build_project_root, check_appworld_tasks, load_project_tasks
from torchrl_agent.envs.base import GameState, TextEnv, TextGame, _as_str_list

__all__ = ["AppWorldEnv", "AppWorldGame", "parse_code"]

_CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"^```(?:python|py)?\s*\n(.*?)\n?```\s*$", re.DOTALL)


def parse_code(action: str) -> str:
    """The code of an action: the first ``<code>...</code>`` content, else the whole string (a Markdown fence removed)."""
    match = _CODE.search(action)
    code = match.group(1) if match else action
    fence = _FENCE.match(code.strip())
    return fence.group(1) if fence else code.strip("\n")


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
    """A batch of AppWorld games (one worker process each). See :mod:`torchrl_agent.envs.appworld` for the rules.

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
                dataset = eval_dataset if split == "eval" else train_dataset
                dataset_file = root / "data" / "datasets" / f"{dataset}.txt"
                if not dataset_file.is_file():
                    raise FileNotFoundError(f"AppWorld dataset {dataset!r} has no file {dataset_file}")
                lister = AppWorldWorker(self.python, timeout=timeout)
                try:
                    task_ids = lister.request({"op": "list", "root": str(root), "dataset": dataset})["task_ids"]
                finally:
                    lister.close()
            check_appworld_tasks(root, list(task_ids))
        else:
            tasks = load_project_tasks()  # checked before the (slow) build of their data folder
            root = build_project_root(self.python, cache_dir)
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


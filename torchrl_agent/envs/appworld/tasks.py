"""The AppWorld tasks written for this project (``tasks.json``) and their AppWorld data folder, built once."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from torchrl_agent.envs.appworld.client import WORKER_SCRIPT, AppWorldWorker

__all__ = ["TASKS_FILE", "build_project_root", "load_project_tasks"]

TASKS_FILE = Path(__file__).with_name("tasks.json")


def load_project_tasks() -> list[dict]:
    """The AppWorld tasks written for this project (records, instruction, checker), in file order."""
    return json.loads(TASKS_FILE.read_text(encoding="utf-8"))["tasks"]


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

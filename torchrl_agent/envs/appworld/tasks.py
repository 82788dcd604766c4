"""The AppWorld tasks written for this project (``tasks.json``) and their AppWorld data folder, built once."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from datetime import datetime
from pathlib import Path

from torchrl_agent.envs.appworld.client import WORKER_SCRIPT, AppWorldWorker
from torchrl_agent.envs.data_files import DataFileError, check_type, read_json

__all__ = ["TASKS_FILE", "build_project_root", "check_appworld_tasks", "load_project_tasks"]

TASKS_FILE = Path(__file__).with_name("tasks.json")


#: The fields of a project task and their types (``seed``, ``accounts``, ``records``, ``generated`` are optional).
TASK_FIELDS = {"id": str, "split": str, "instruction": str, "supervisor": dict, "datetime": str, "check": dict}
_OPTIONAL_FIELDS = {"seed": int, "accounts": dict, "records": dict, "generated": dict}
_SUPERVISOR_FIELDS = ("first_name", "last_name", "email", "phone_number")


def _check_project_task(task, index: int, path) -> None:
    """One task of the project's ``tasks.json``: the fields the env and the worker read."""
    check_type(task, dict, path, record=index)
    where = f"{index} (id {task['id']})" if isinstance(task.get("id"), str) else index
    for field, kind in TASK_FIELDS.items():
        if field not in task:
            raise DataFileError(path, "is missing", record=where, field=field)
        check_type(task[field], kind, path, record=where, field=field)
    for field, kind in _OPTIONAL_FIELDS.items():
        if field in task:
            check_type(task[field], kind, path, record=where, field=field)
    if task["split"] not in ("train", "test"):
        raise DataFileError(path, f"must be 'train' or 'test', got {task['split']!r}", record=where, field="split")
    try:
        datetime.fromisoformat(task["datetime"])
    except ValueError:
        raise DataFileError(path, f"must be an ISO date and time, got {task['datetime']!r}", record=where,
                            field="datetime") from None
    for field in _SUPERVISOR_FIELDS:
        check_type(task["supervisor"].get(field), str, path, record=where, field=f"supervisor.{field}")
    check = task["check"]
    if "answer" not in check:
        for field in ("app", "model"):
            check_type(check.get(field), str, path, record=where, field=f"check.{field}")
        for field in ("exists", "absent"):
            for i, row in enumerate(check_type(check.get(field, []), list, path, record=where, field=f"check.{field}")):
                check_type(row, dict, path, record=where, field=f"check.{field}[{i}]")


def load_project_tasks(path: str | os.PathLike = TASKS_FILE) -> list[dict]:
    """The AppWorld tasks written for this project (records, instruction, checker), in file order.

    Every task is checked (:data:`TASK_FIELDS`, unique ids): a bad file raises
    :class:`~torchrl_agent.envs.data_files.DataFileError` naming the file, the task and the field.
    """
    content = check_type(read_json(path), dict, path)
    if "tasks" not in content:
        raise DataFileError(path, "is missing", field="tasks")
    tasks = check_type(content["tasks"], list, path, field="tasks")
    first: dict[str, int] = {}
    for index, task in enumerate(tasks):
        _check_project_task(task, index, path)
        if task["id"] in first:
            raise DataFileError(path, f"{task['id']!r} is also the id of record {first[task['id']]}", record=index,
                                field="id")
        first[task["id"]] = index
    return tasks


#: The fields of an AppWorld task's ``specs.json`` that AppWorld reads when it opens the task.
SPECS_FIELDS = {"instruction": str, "datetime": str}


def check_appworld_tasks(root: Path, task_ids: list[str]) -> None:
    """Check AppWorld's own data under ``root`` (the folder holding ``data/``) for ``task_ids``:
    each task folder has a ``specs.json`` with an instruction, a date and a supervisor
    (:class:`~torchrl_agent.envs.data_files.DataFileError` naming the file and field, or
    FileNotFoundError naming the missing file) -- before any worker opens one mid-run."""
    for task_id in task_ids:
        specs_file = root / "data" / "tasks" / str(task_id) / "specs.json"
        if not specs_file.is_file():
            raise FileNotFoundError(f"AppWorld task {task_id!r} has no {specs_file} (is the AppWorld data complete? "
                                    "`appworld download data`)")
        specs = check_type(read_json(specs_file), dict, specs_file)
        for field, kind in SPECS_FIELDS.items():
            if field not in specs:
                raise DataFileError(specs_file, "is missing", field=field)
            check_type(specs[field], kind, specs_file, field=field)
        if "db_version" not in specs:
            raise DataFileError(specs_file, "is missing", field="db_version")
        field = "supervisor" if "supervisor" in specs else "main_user"  # AppWorld reads either
        check_type(specs.get(field), dict, specs_file, field=field)


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

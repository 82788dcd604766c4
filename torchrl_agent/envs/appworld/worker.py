"""The AppWorld side of the ``appworld`` environment: run by the Python that has ``appworld`` installed.

``appworld`` pins ``pydantic<2``, ``fastapi 0.110`` and ``SQLAlchemy<2``, which cannot live beside
vLLM, so AppWorld runs in its own virtual environment (``make appworld``: ``.venv-appworld``) and
this file is its entry point (``<appworld python> worker.py``). It imports only the
standard library and ``appworld``. One process holds one AppWorld world at a time (AppWorld keeps
process-global state), as each of the reference's AppWorld servers does.

Protocol: one JSON object a line on stdin, one JSON reply a line on stdout (everything AppWorld
prints goes to stderr). Requests (``op``):

* ``build`` ``{root, tasks}``: write the project's tasks into an AppWorld data folder ``root``
  (API docs built from the apps' code, one task folder per task with its databases filled from
  the task's records and AppWorld's own model factories); replies ``{built: [task ids]}``;
* ``list`` ``{root, dataset}``: AppWorld's task ids of a dataset (``train``, ``test_normal``, ...);
* ``reset`` ``{root, task_id, experiment}``: open the task's world; replies the instruction, the
  supervisor and the task's date;
* ``step`` ``{code}``: run ``code`` in AppWorld's sandbox (its safety guard, its time freeze);
  replies ``{output, completed}``;
* ``evaluate`` ``{check}``: with a project check, run it on the world's databases; without one,
  AppWorld's own evaluator (``world.evaluate()``); replies ``{success, detail}``;
* ``close``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

# Run as a script, this file's folder heads sys.path, where the modules beside it (env.py, tasks.py, ...)
# would shadow top-level modules of the same names: take the folder out.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _build(root: str, tasks: list[dict]) -> list[str]:
    from datetime import datetime, timedelta

    from appworld.apps import get_all_apps
    from appworld.apps.admin.models import MainUserMunch
    from appworld.apps.api_lib import set_local_date_and_time, unset_local_date_and_time
    from appworld.collections.api_docs import ApiDocCollection
    from appworld.collections.models import ModelCollection
    from appworld.common.constants import CANARY_STRING, DB_VERSION
    from appworld.common.random import set_random_seed
    from appworld.task import Task

    docs_dir = os.path.join(root, "data", "api_docs", "standard")
    os.makedirs(docs_dir, exist_ok=True)
    for app_name, api_docs in ApiDocCollection.build(tuple(get_all_apps(skip_admin=True))).items():
        with open(os.path.join(docs_dir, app_name + ".json"), "w") as f:
            json.dump({name: {**doc, "canary_string": CANARY_STRING} for name, doc in api_docs.items()}, f)
    built = []
    for spec in tasks:
        set_random_seed(int(spec.get("seed", 0)), python=True, faker_=True, model_factory=True)
        when = datetime.fromisoformat(spec.get("datetime", "2023-05-18T12:00:00"))
        clock = set_local_date_and_time(when - timedelta(days=1))  # records exist a day before the task
        models = ModelCollection.load(to_db_home_path=f":memory:build-{spec['id']}", load_apps=get_all_apps(),
                                      create_db=True)
        supervisor = spec["supervisor"]
        sup = models["supervisor"].Supervisor.create_save(**supervisor)
        models["supervisor"].Task.create_save(supervisor_id=sup.id, instruction=spec["instruction"])
        for app_name, password in spec.get("accounts", {}).items():
            models["supervisor"].AccountPassword.create_save(supervisor_id=sup.id, account_name=app_name,
                                                             password=password)
            user = models[app_name].User.create_save(
                first_name=supervisor["first_name"], last_name=supervisor["last_name"], email=supervisor["email"],
                password=password, verified=True,
            )
            for model_name, records in spec.get("records", {}).get(app_name, {}).items():
                for record in records:
                    models[app_name][model_name].create_save(user_id=user.id, **record)
        for app_name, counts in spec.get("generated", {}).items():  # other users' data from AppWorld's factories
            for model_name, count in counts.items():
                model = models[app_name][model_name]
                made = 0
                for _ in range(20 * count):
                    if made == count:
                        break
                    try:
                        if model_name != "User":
                            owner = models[app_name].User.factory().build()
                            owner.save()
                            model.factory().build(user_id=owner.id).save()
                        else:
                            model.factory().build().save()
                        made += 1
                    except Exception:  # faker sometimes repeats a unique value: draw again
                        continue
        task = Task(
            id=spec["id"], instruction=spec["instruction"],
            supervisor=MainUserMunch({k: supervisor[k] for k in ("first_name", "last_name", "email", "phone_number")}),
            datetime=when,
            allowed_apps=get_all_apps(skip_admin=True), db_version=DB_VERSION, model_collection=models,
        )
        task.save(save_ground_truth=False, delete_if_exists=True)
        task.close()
        unset_local_date_and_time(clock)
        built.append(spec["id"])
    return built


def _check(world, check: dict) -> tuple[bool, str]:
    """A project task's checker, run on the world's databases after the episode."""
    supervisor_app = world.models["supervisor"]
    if "answer" in check:
        tasks = supervisor_app.Task.find_all()
        answer = str(tasks[0].answer if tasks and tasks[0].answer is not None else "").strip().lower()
        expected = str(check["answer"]).strip().lower()
        try:  # AppWorld stores numbers as floats: 5 and "5.0" are the same answer
            same = float(answer) == float(expected)
        except ValueError:
            same = answer == expected
        return same, f"answer {answer!r}, expected {expected!r}"
    app = world.models[check["app"]]
    model = app[check["model"]]
    owner = app.User.find_one(email=world.task.supervisor.email)
    rows = [r for r in model.find_all() if owner is not None and getattr(r, "user_id", None) == owner.id]
    for where in check.get("exists", []):
        if not any(all(_same(getattr(r, k, None), v) for k, v in where.items()) for r in rows):
            return False, f"no {check['model']} with {where}"
    for where in check.get("absent", []):
        if any(all(_same(getattr(r, k, None), v) for k, v in where.items()) for r in rows):
            return False, f"a {check['model']} with {where} is still there"
    if "count" in check and len(rows) != check["count"]:
        return False, f"{len(rows)} {check['model']} rows, expected {check['count']}"
    return True, "all checks passed"


def _same(value, expected) -> bool:
    if isinstance(expected, str) and isinstance(value, str):
        return value.strip().lower() == expected.strip().lower()
    return value == expected


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # AppWorld's prints go to stderr
    sys.stdout = sys.stderr
    world = None
    for line in sys.stdin:
        try:
            request = json.loads(line)
            op = request["op"]
            if "root" in request:
                os.environ["APPWORLD_ROOT"] = request["root"]
                from appworld.common.path_store import path_store

                path_store.update_root(request["root"])
            if op == "build":
                reply = {"built": _build(request["root"], request["tasks"])}
            elif op == "list":
                from appworld.task import load_task_ids

                reply = {"task_ids": load_task_ids(request["dataset"])}
            elif op == "reset":
                from appworld import AppWorld

                if world is not None:
                    world.close()
                world = AppWorld(task_id=request["task_id"], experiment_name=request.get("experiment", "torchrl_agent"),
                                 load_ground_truth=request.get("ground_truth", False),
                                 timeout_seconds=request.get("timeout_seconds", 100))
                reply = {"instruction": world.task.instruction, "supervisor": dict(world.task.supervisor),
                         "datetime": world.task.datetime.isoformat()}
            elif op == "step":
                output = world.execute(request["code"])
                reply = {"output": output, "completed": bool(world.task_completed())}
            elif op == "evaluate":
                if request.get("check"):
                    success, detail = _check(world, request["check"])
                else:
                    tracker = world.evaluate()
                    success, detail = bool(tracker.success), tracker.to_dict() if hasattr(tracker, "to_dict") else ""
                reply = {"success": bool(success), "detail": str(detail)[:2000]}
            elif op == "close":
                if world is not None:
                    world.close()
                protocol.write(json.dumps({"ok": True}) + "\n")
                return
            else:
                raise ValueError(f"unknown op {op!r}")
            reply["ok"] = True
        except Exception as err:  # reported to the env, which ends the episode: never a silent crash
            reply = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        protocol.write(json.dumps(reply, default=str) + "\n")


if __name__ == "__main__":
    main()

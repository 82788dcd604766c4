"""AppWorld on the real ``appworld`` apps (its own venv) with the project's tasks and checkers."""

from __future__ import annotations

import json

import pytest
from torchrl.envs.utils import check_env_specs

from torchrl_agent.envs import make_env
from torchrl_agent.envs.appworld import AppWorldEnv, appworld_python, client, load_project_tasks, parse_code

LOGIN = ("pw = {a['account_name']: a['password'] for a in apis.supervisor.show_account_passwords()}\n"
         "me = apis.supervisor.show_profile()['email']\n"
         "tok = apis.simple_note.login(username=me, password=pw['simple_note'])['access_token']\n")


def _step(env, td, actions):
    td["action"] = list(actions)
    return env.step(td)["next"]


@pytest.fixture(scope="module")
def env():
    # the eval panel walks the given tasks in order: episode 1 notecreate_1, episode 2 notecount_1
    env = make_env("appworld", num_groups=1, group_size=2, split="eval", task_ids=["notecreate_1", "notecount_1"])
    yield env
    env.close()


def test_scripted_code_solves_and_wrong_code_fails(env):
    td = env.reset()
    assert td["task"][0] == td["task"][1]  # the group shares its task
    assert td["task"][0].startswith("My name is: Ada Quinn. My personal email is ada.quinn@gmail.com")
    assert td["task"][0].endswith("Task: Create a note in Simple Note titled 'Groceries' with the content 'milk, eggs, bread'.")
    assert td["task_type"] == ["notecreate", "notecreate"] and td["admissible_actions"] == ["", ""]
    create = "print(apis.simple_note.create_note(access_token=tok, title='Groceries', content={!r}))"
    out = _step(env, td, [f"<think>log in, then create</think><code>{LOGIN}{create.format('milk, eggs, bread')}</code>",
                          f"```python\n{LOGIN}{create.format('milk and eggs')}\n```"])
    assert all(o.startswith('{"message": "Note created.", "note_id": ') for o in out["observation"])
    assert not out["done"].any() and out["reward"].eq(0).all()
    out = _step(env, out, ["<code>apis.supervisor.complete_task()</code>"] * 2)
    assert out["reward"].squeeze(-1).tolist() == [10.0, 0.0] and out["success"].squeeze(-1).tolist() == [True, False]
    assert out["terminated"].all()
    assert env.games[0].detail == "all checks passed" and "no Note with" in env.games[1].detail
    # the next episode of the panel: a question, answered through complete_task(answer=...)
    td = env.reset()
    assert td["task"][0].endswith("Task: How many notes do I have in Simple Note?")
    count = f"{LOGIN}n = len(apis.simple_note.search_notes(access_token=tok, page_limit=20))\n"
    out = _step(env, td, [f"<code>{count}apis.supervisor.complete_task(answer=n)</code>",
                          f"<code>{count}apis.supervisor.complete_task(answer=n + 1)</code>"])
    assert out["reward"].squeeze(-1).tolist() == [10.0, 0.0] and out["done"].all()
    assert env.games[1].detail == "answer '6.0', expected '5'"  # AppWorld stores numbers as floats


def test_specs_garbage_and_sandbox(env):
    check_env_specs(env)
    td = env.reset()
    for actions in (["", "x" * 20_000], ["\x00\x07 print(", "\ud800 lone surrogates \udfff"],
                    ["open('/etc/passwd').read()", "import subprocess; subprocess.run(['ls'])"]):
        td = _step(env, td, actions)
        assert all(isinstance(o, str) and o for o in td["observation"]) and not td["done"].any()
    assert "not allowed" in td["observation"][0]  # AppWorld's safety guard
    assert td["step_count"].squeeze(-1).tolist() == [3, 3]


def test_a_dead_worker_ends_its_episode_and_restarts(env):
    td = env.reset()
    env.games[1].worker.process.kill()
    out = _step(env, td, ["print(1 + 1)", "print(2 + 2)"])
    assert out["observation"][0].strip() == "2" and not out["done"][0]
    assert out["observation"][1].startswith("The AppWorld environment failed") and out["done"][1]
    assert out["reward"][1].item() == 0.0
    td = env.reset()  # a fresh worker
    out = _step(env, td, ["print(3)", "print(4)"])
    assert [o.strip() for o in out["observation"]] == ["3", "4"]


def test_project_tasks_and_splits():
    tasks = load_project_tasks()
    ids = [t["id"] for t in tasks]
    assert len(set(ids)) == len(ids) and all(i.count("_") == 1 for i in ids)
    assert all(t["check"] and t["split"] in ("train", "test") for t in tasks)
    train, evaluation = AppWorldEnv(num_groups=1), AppWorldEnv(num_groups=1, split="eval")  # workers start lazily
    assert set(train.task_ids) == {t["id"] for t in tasks if t["split"] == "train"}
    assert set(evaluation.task_ids) == {t["id"] for t in tasks if t["split"] == "test"}
    assert not set(train.task_ids) & set(evaluation.task_ids)
    with pytest.raises(ValueError, match="unknown project task ids"):
        AppWorldEnv(task_ids=["nope_1"])
    with pytest.raises(FileNotFoundError, match="data/tasks"):
        AppWorldEnv(data_dir="/nonexistent")
    assert json.loads(json.dumps(tasks)) == tasks


def test_missing_appworld_python_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHRL_AGENT_APPWORLD_PYTHON", raising=False)
    monkeypatch.setattr(client, "DEFAULT_PYTHON", tmp_path / "python")
    with pytest.raises(FileNotFoundError, match="make appworld"):
        appworld_python()
    with pytest.raises(FileNotFoundError, match="/nonexistent/python"):
        appworld_python("/nonexistent/python")


def test_parse_code():
    assert parse_code("<think>x</think><code>print(1)</code> trailing") == "print(1)"
    assert parse_code("```python\nprint(2)\n```") == "print(2)"
    assert parse_code("print(3)") == "print(3)"
    assert parse_code("<CODE>a = 1\nb = 2</CODE>") == "a = 1\nb = 2"

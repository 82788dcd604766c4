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
against the real Simple Note and supervisor APIs (``tasks.json`` in this package):
their databases are built once per machine from each task's records plus AppWorld's own model
factories, and each task has a checker run on the databases after the episode.

Running AppWorld: ``appworld`` pins ``pydantic<2`` (and ``fastapi``/``SQLAlchemy`` versions)
that cannot share an environment with vLLM, so it lives in its own virtual environment
(``make appworld`` creates ``.venv-appworld`` and runs ``appworld install``). Each game talks to a
worker process on that Python (:mod:`torchrl_agent.envs.appworld.worker`) over JSON lines, as the
reference talks to one AppWorld server per environment. A worker that dies or stops answering
ends its episode (observation says why, reward 0) and is restarted at the next reset.

Modules: ``tasks`` (the project's tasks and their data folder), ``client`` (AppWorld's Python and
the worker process), ``worker`` (the worker itself, run on AppWorld's Python) and ``env`` (the game
and the env).
"""

from torchrl_agent.envs.appworld import prompts as _prompts  # noqa: F401 - registers its templates
from torchrl_agent.envs.appworld.client import AppWorldWorker, appworld_python
from torchrl_agent.envs.appworld.env import AppWorldEnv, AppWorldGame, parse_code
from torchrl_agent.envs.appworld.tasks import load_project_tasks

__all__ = ["AppWorldEnv", "AppWorldGame", "AppWorldWorker", "load_project_tasks", "parse_code", "appworld_python"]

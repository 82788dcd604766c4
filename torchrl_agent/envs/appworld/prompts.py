"""AppWorld's prompt template, registered by name when the package is imported."""

from __future__ import annotations

from torchrl_agent.envs.transforms.templates import register_template

register_template("appworld", (
    "I am your supervisor and you are a super intelligent AI Assistant whose job is to achieve my day-to-day "
    "tasks completely autonomously. You interact with apps (e.g. spotify, venmo, simple_note) through their "
    "APIs in a Python REPL: write code, read its output, write the next code. Useful APIs: "
    "apis.api_docs.show_app_descriptions(), apis.api_docs.show_api_descriptions(app_name=...), "
    "apis.api_docs.show_api_doc(app_name=..., api_name=...); apis.supervisor.show_account_passwords() gives my "
    "passwords. When the task is done call apis.supervisor.complete_task() (with answer=... if it asks a "
    "question). First reason inside <think> </think>, then give exactly one code block inside <code> </code>.\n"
    "{task}\n"
    "{history}\n"
    "You have taken {step} steps. Output of your last code: {observation}"
))

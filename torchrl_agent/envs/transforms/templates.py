"""Prompt templates: ours (one per environment) and the reference's texts with the way it fills them.

Our templates are one user message with the stable part (instructions, task) first and the
changing part (history, step, observation, actions) last, so an engine's prefix cache can reuse
it. Fields: ``{task}``, ``{history}``, ``{step}`` (steps taken), ``{observation}``,
``{admissible_actions}`` (comma-joined, or ``"any"`` when free-form).

**Reference mode** (``template="reference"`` with the env name, or ``"reference_<env>"``): the
prompt texts of verl-agent (``agent_system/environments/prompts/*.py``) filled the way its
environment managers fill them (:class:`ReferenceTemplate`): the no-history text at the first step
(or without memory), the history lines ``[Observation n: '...', Action n: '...']`` (ALFWorld,
Sokoban) or ``Step n:<action> <information>`` (Search), ALFWorld's admissible actions quoted one a
line without ``help``. The reference's Gym Cards prompts carry the state in an image (``<image>``);
here the image is replaced by the observation text. These prompts put the changing part first, so
they share less prefix between steps than ours.

:func:`resolve_template` turns a config value into a template;
:class:`~torchrl_agent.envs.transforms.prompt.PromptTransform` renders it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchrl_agent.envs.registry import load_env_packages

__all__ = ["PROMPT_TEMPLATES", "REFERENCE_TEMPLATES", "TAGS_INSTRUCTION", "ReferenceTemplate", "register_template",
           "resolve_template"]

TAGS_INSTRUCTION = ("First reason step by step inside <think> </think>, then give exactly one action inside "
                    "<action> </action>.")

#: template name -> template string: ``default`` here, each env's own registered by its package
#: (:func:`register_template`; ``None`` in the config takes the one named after the env).
PROMPT_TEMPLATES: dict[str, str] = {
    "default": (
        "You are an agent acting in a text environment. " + TAGS_INSTRUCTION + "\n"
        "Your task: {task}\n"
        "{history}\n"
        "You have taken {step} steps. Current observation: {observation}\n"
        "Admissible actions: {admissible_actions}"
    ),
}


# ------------------------------------------------------------------------------------------ reference mode
# The prompt texts of verl-agent (agent_system/environments/prompts/, upstream commit 796ed31), verbatim,
# so that prompts match in the reference mode. Fields are the reference's own names.


def _window_lines(records: list[dict]) -> str:
    """The reference's ``SimpleMemory.fetch`` lines: one ``[Observation n: '...', Action n: '...']`` a step."""
    return "\n".join(f"[Observation {r['step'] + 1}: '{r['observation']}', Action {r['step'] + 1}: '{r['action']}']"
                     for r in records)


def _search_lines(records: list[dict], observation: str) -> str:
    """The reference's ``SearchMemory.fetch`` lines: ``Step n:<action> <what it returned>`` a step.

    The reference stores each action with the observation that *followed* it; a record here holds
    the observation *before* its action, so the one after is the next record's (or the current one).
    """
    after = [r["observation"] for r in records[1:]] + [observation]
    return "\n".join(f"Step {r['step'] + 1}:{r['action']} {obs}\n" for r, obs in zip(records, after))


def _formula(observation: str) -> str:
    """The formula typed so far, as the reference writes it (``''.join`` of the tokens), from a
    formula game's observation (``... Formula so far: 3 + 4`` or ``(empty)``); ``""`` for an image
    observation, whose text holds no formula (it is drawn in the frame)."""
    _, found, typed = observation.rpartition("Formula so far:")
    typed = typed.strip()
    return "" if not found or typed == "(empty)" else "".join(typed.split())


@dataclass(frozen=True)
class ReferenceTemplate:
    """One environment's reference prompt and how its environment manager fills it.

    Attributes:
        first: the text without history (the reference's ``*_TEMPLATE_NO_HIS``), used at the first
            step and when the memory keeps nothing.
        later: the text with history (``*_TEMPLATE``).
        history: ``"window"`` (ALFWorld, Sokoban lines), ``"search"`` (Search lines) or ``"none"``.
        image: the Gym Cards prompts start with ``<image>``; it is replaced by the observation text.
        intro: how the reference's environment shows the first observation, from ours (fields
            ``{observation}``, ``{task}``); ALFWorld's reset text holds a banner and the task, which
            our env splits into ``observation`` and ``task``. Empty: as it is.
    """

    first: str
    later: str
    history: str = "window"
    image: bool = False
    intro: str = ""

    def _observation(self, observation: str, step: int, task: str) -> str:
        return self.intro.format(observation=observation, task=task) if self.intro and step == 0 else observation

    def content(self, task: str, observation: str, actions: list[str], step: int,
                records: list[dict] | None, history_text: str, window: bool = True) -> str:
        """The user message. ``records``: the memory's records (``None``: no memory, or one that keeps
        nothing); ``window``: they are (observation, action) records of a window memory, written as the
        reference writes its history; otherwise the memory's own ``history_text`` is used."""
        use_history = records is not None and step > 0 and self.history != "none"
        if records:
            records = [{**r, "observation": self._observation(r["observation"], r["step"], task)}
                       if "observation" in r else r for r in records]
        observation = self._observation(observation, step, task)
        if not use_history:
            text = self.first
        else:
            if window:
                lines = _window_lines(records) if self.history == "window" else _search_lines(records, observation)
            else:  # e.g. a summary: the memory's own rendering
                lines = history_text
            text = self.later
        text = text.format(
            task_description=task, current_observation=observation, step_count=step, current_step=step + 1,
            history_length=len(records or []), action_history=lines if use_history else "",
            memory_context=lines if use_history else "", text_formula=_formula(observation),
            admissible_actions="\n ".join(f"'{a}'" for a in actions if a != "help"),
        )
        return text.replace("<image>", observation + "\n", 1) if self.image else text


#: ``reference_<env>`` -> the reference's prompt of that environment (filled by the env packages).
REFERENCE_TEMPLATES: dict[str, ReferenceTemplate] = {}


def register_template(name: str, template: str | ReferenceTemplate) -> None:
    """Make ``template`` available as ``env.template=<name>``: a template string goes to
    :data:`PROMPT_TEMPLATES` (named after its env, it is that env's default), a
    :class:`ReferenceTemplate` to :data:`REFERENCE_TEMPLATES` (named ``reference_<env>``)."""
    if isinstance(template, ReferenceTemplate):
        if not name.startswith("reference_"):
            raise ValueError(f"register_template: a ReferenceTemplate is named reference_<env>, got {name!r}")
        REFERENCE_TEMPLATES[name] = template
    else:
        PROMPT_TEMPLATES[name] = template


def resolve_template(template: str | None, env_name: str) -> str | ReferenceTemplate:
    """The template of a config value: ``None`` -> ours by env name (else ``"default"``);
    ``"reference"`` -> ``REFERENCE_TEMPLATES["reference_<env_name>"]``; a key of
    :data:`PROMPT_TEMPLATES` or :data:`REFERENCE_TEMPLATES`; else the string itself (a template).

    The env's package is imported first (it registers its templates); a name no package has
    registered yet has every registered env's package imported before it is taken as a string."""
    load_env_packages(env_name)
    if template not in (None, "reference") and template not in PROMPT_TEMPLATES and template not in REFERENCE_TEMPLATES:
        load_env_packages()
    if template is None:
        return PROMPT_TEMPLATES.get(env_name, PROMPT_TEMPLATES["default"])
    if template == "reference":
        template = f"reference_{env_name}"
        if template not in REFERENCE_TEMPLATES:
            load_env_packages()  # the error lists every env's
            raise ValueError(f"template 'reference': the reference has no prompt for env {env_name!r}; it has one "
                             f"for {sorted(k.removeprefix('reference_') for k in REFERENCE_TEMPLATES)}")
    if template in REFERENCE_TEMPLATES:
        return REFERENCE_TEMPLATES[template]
    return PROMPT_TEMPLATES.get(template, template)

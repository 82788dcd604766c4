"""Action projection: the model's raw response -> the environment command and its validity.

Two families of formats, both linear in the response length (every rule is a left-to-right
``find`` of a literal tag, never a backtracking regular expression), and a response longer than
``max_chars`` is cut to its first ``max_chars`` characters before parsing (the cut is reported).

**Our formats** (the defaults):

* ``"tags"``: the action is the first ``<action>...</action>`` content, lower-cased and stripped
  (tag names are case-insensitive). The response is valid when it also holds
  ``<think>...</think>`` (in that order) and no CJK character. Without action tags the command is
  the last 30 characters of the lower-cased response (which the environment answers as a no-op);
  with action tags but an invalid response, the extracted action is still sent, flagged invalid.
* ``"json"`` (the cards): ``<think>...</think>`` and a JSON object with an ``"action"`` field,
  parsed as JSON (the first object that parses and has one).
* ``"search"``: ``<think>...</think>`` and one ``<search>q</search>`` or ``<answer>a</answer>``;
  the action is the whole tag (``"<search>q</search>"``). A response holding both tags, or one
  tag twice, is invalid (its first block is still sent).
* ``"code"`` (AppWorld): ``<think>...</think>`` and ``<code>...</code>``; the action is the code,
  case and indentation kept.

**Reference formats** (``"reference_<env>"``, see :func:`reference_formats`): the parsing rules of
verl-agent's ``env_package/*/projection.py``, rule for rule, so a model trained there sees the same
validity here. ``"reference"`` with the env name (:func:`resolve_format`) picks the env's one. Each
is registered by its env's package (:func:`register_format`, in :data:`ACTION_FORMATS`, as any
env's own rule is); the generic pieces they share (:func:`reference_action_tags`,
:func:`gym_cards_rule`) are here.

* ``reference_alfworld`` (and any free-text ``<action>`` env): the response is lower-cased; the
  action is the text between the first ``<action>`` and the first ``</action>``, stripped. No
  action tags: the command is the last 30 characters of the lower-cased response, invalid. Then the
  response is invalid when the *original* text lacks ``<think>`` or ``</think>`` (case-sensitive,
  in any order) or holds a character in U+4E00..U+9FFF.
* ``reference_sokoban``: the same extraction; the command is the first of ``up``, ``down``,
  ``left``, ``right``, ``still`` contained in the action text, written as the reference's memory
  writes it (``"Up"``...; ``"Still"`` is a no-op). No tags or none of the five: ``"Still"``,
  invalid. The ``<think>`` check as for ALFWorld; no CJK check.
* ``reference_numberline``, ``reference_blackjack``, ``reference_ezpoints``,
  ``reference_points24`` (the Gym Cards rule): the lower-cased response from its first
  ``"action":`` on (the last character alone when there is none) must contain exactly one of the
  game's tokens (for the formula games ``10`` is taken first and removed); that token is the
  command, else ``""`` (a no-op), invalid. No ``<think>`` and no CJK check.
* ``reference_search``: the text is cut after the first ``</search>`` (else the first
  ``</answer>``); the first ``<search>q</search>`` block (tags case-insensitive), else the first
  ``<answer>a</answer>`` block, is the command with its content stripped (case kept); none: ``""``,
  invalid. A response holding both ``<search>`` and ``<answer>``, or either tag twice, is invalid.
  No ``<think>`` and no CJK check.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from torchrl.data import Categorical, Composite, NonTensor
from torchrl.envs import Transform

from torchrl_agent.envs.base import clean_text
from torchrl_agent.envs.registry import load_env_packages
from torchrl_agent.envs.transforms.memory import _string_stack, _strings

__all__ = ["ACTION_FORMATS", "ActionFormat", "ActionProjection", "OUR_FORMATS", "count_tag", "expert_response",
           "gym_cards_rule", "project_action", "reference_action_tags", "reference_formats", "register_format",
           "resolve_format", "response_tail", "tag_block"]

#: Responses are cut to this many characters before parsing (a response is a few hundred tokens).
MAX_RESPONSE_CHARS = 32_768
_TAIL = 30

_JSON = re.compile(r"\{[^{}]*\}")  # an innermost {...}: linear (it cannot backtrack past a brace)
_CJK = re.compile(r"[\u2e80-\u2fff\u3040-\u30ff\u3100-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_TAG_CACHE: dict[str, re.Pattern] = {}

OUR_FORMATS = ("tags", "json", "search", "code")


@dataclass(frozen=True)
class ActionFormat:
    """One parsing rule of :data:`ACTION_FORMATS`.

    Attributes:
        parse: ``response -> (action, valid)``, on the response already cleaned and cut; never raises.
        expert: how :func:`expert_response` writes an action for it: ``"tags"`` (``<action>a</action>``),
            ``"json"`` (``{"action": "a"}``) or ``"search"`` (the action is itself a tag).
    """

    parse: Callable[[str], tuple[str, bool]]
    expert: str = "tags"


#: format name -> its :class:`ActionFormat`: ours (:data:`OUR_FORMATS`) here, the reference's
#: (``reference_<env>``) and any env's own registered by the env's package (:func:`register_format`).
ACTION_FORMATS: dict[str, ActionFormat] = {}


def register_format(name: str, parse: Callable[[str], tuple[str, bool]], *, expert: str = "tags") -> None:
    """Make ``parse`` available as ``env.action_format=<name>`` (``reference_<env>``: the reference's
    rule of that env, which ``action_format=reference`` picks)."""
    if expert not in ("tags", "json", "search"):
        raise ValueError(f"register_format: expert must be tags, json or search, got {expert!r}")
    ACTION_FORMATS[name] = ActionFormat(parse, expert)


def reference_formats() -> tuple[str, ...]:
    """The reference's parsing rules, one per environment that the reference has (every env package imported)."""
    load_env_packages()
    return tuple(f for f in ACTION_FORMATS if f.startswith("reference_"))


def _action_format(fmt: str) -> ActionFormat:
    if fmt not in ACTION_FORMATS:
        load_env_packages()  # a format an env's package registers
    if fmt not in ACTION_FORMATS:
        raise ValueError(f"unknown action format {fmt!r}; use one of {list(OUR_FORMATS)}, 'reference' or "
                         f"{list(reference_formats())}")
    return ACTION_FORMATS[fmt]


def resolve_format(fmt: str, env_name: str) -> str:
    """``"reference"`` -> ``"reference_<env_name>"``; any other format is returned as is (and checked)."""
    if fmt == "reference":
        load_env_packages(env_name)
        fmt = f"reference_{env_name}"
        if fmt not in ACTION_FORMATS:
            raise ValueError(f"action_format 'reference': the reference has no parsing rule for env {env_name!r}; "
                             f"it has one for {sorted(f.removeprefix('reference_') for f in reference_formats())}")
    _action_format(fmt)
    return fmt


# ---------------------------------------------------------------------------------------- linear scanning
def _tag(literal: str) -> re.Pattern:
    """A case-insensitive pattern for one literal tag (a literal search is linear)."""
    if literal not in _TAG_CACHE:
        _TAG_CACHE[literal] = re.compile(re.escape(literal), re.IGNORECASE)
    return _TAG_CACHE[literal]


def tag_block(text: str, name: str, start: int = 0) -> tuple[int, str] | None:
    """``(position, content)`` of the first ``<name>...</name>`` at or after ``start`` whose closing
    tag follows its opening tag (the leftmost match of ``<name>(.*?)</name>``), tags case-insensitive."""
    opening = _tag(f"<{name}>").search(text, start)
    if opening is None:
        return None
    closing = _tag(f"</{name}>").search(text, opening.end())
    if closing is None:
        return None
    return opening.start(), text[opening.end():closing.start()]


def count_tag(text: str, literal: str, limit: int = 2) -> int:
    """How many times ``literal`` occurs (case-insensitive), counting up to ``limit``."""
    n, pos = 0, 0
    while n < limit:
        match = _tag(literal).search(text, pos)
        if match is None:
            break
        n, pos = n + 1, match.end()
    return n


def _has_think(text: str) -> bool:
    return tag_block(text, "think") is not None


# ---------------------------------------------------------------------------------------- our formats
def _ours(response: str, fmt: str) -> tuple[str | None, bool]:
    valid = _has_think(response) and not _CJK.search(response)
    if fmt == "tags":
        block = tag_block(response, "action")
        return (block[1].strip().lower() if block else None), valid
    if fmt == "code":
        block = tag_block(response, "code")
        return (block[1] if block else None), valid
    if fmt == "search":
        first = _first_of(response)
        if first is None:
            return None, False
        (_, content), name = first
        single = count_tag(response, "<search>") + count_tag(response, "<answer>") == 1
        return f"<{name}>{content.strip()}</{name}>", valid and single
    for candidate in _JSON.findall(response):  # json
        try:
            value = json.loads(candidate).get("action")
        except (ValueError, AttributeError):
            continue
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value).strip().lower(), valid
    return None, False


def response_tail(response: str) -> str:
    """The command of a response without an action: its last characters, lower-cased (a no-op for the env)."""
    return response.lower()[-_TAIL:]


def _our_format(fmt: str) -> Callable[[str], tuple[str, bool]]:
    def parse(response: str) -> tuple[str, bool]:
        action, valid = _ours(response, fmt)
        return (response_tail(response), False) if action is None else (action, valid)

    return parse


for _fmt, _expert in zip(OUR_FORMATS, ("tags", "json", "search", "tags")):
    register_format(_fmt, _our_format(_fmt), expert=_expert)


def _first_of(response: str) -> tuple[tuple[int, str], str] | None:
    """The leftmost complete ``<search>`` or ``<answer>`` block and its tag name."""
    search, answer = tag_block(response, "search"), tag_block(response, "answer")
    if search is not None and (answer is None or search[0] < answer[0]):
        return search, "search"
    return (answer, "answer") if answer is not None else None


# ---------------------------------------------------------------------------------------- reference formats
def reference_action_tags(response: str) -> tuple[str | None, bool]:
    """verl-agent's ``alfworld_projection`` extraction (also its Sokoban one's): ``(action or None,
    think_ok)``: the lower-cased text between the first ``<action>`` and the first ``</action>``,
    and whether the original text holds ``<think>`` and ``</think>``."""
    lower = response.lower()
    start, end = lower.find("<action>"), lower.find("</action>")
    think_ok = response.find("<think>") != -1 and response.find("</think>") != -1
    if start == -1 or end == -1:
        return None, think_ok
    return lower[start + len("<action>"):end].strip().lower(), think_ok


def gym_cards_rule(tokens: tuple[str, ...], *, ten_first: bool = False) -> Callable[[str], tuple[str, bool]]:
    """verl-agent's ``gym_projection`` for a game of ``tokens`` (in its order): the lower-cased response
    from its first ``"action":`` on must contain exactly one token (``ten_first``: ``10`` is taken
    first and removed, as in the formula games); that token is the command, else ``""``, invalid."""
    def parse(response: str) -> tuple[str, bool]:
        text = response.lower()
        text = text[text.find('"action":'):]  # no key: find() is -1 and only the last character is kept
        found = set()
        if ten_first and "10" in text:
            found.add("10")
            text = text.replace("10", "")
        found.update(t for t in tokens if t in text)
        if len(found) == 1:
            return found.pop(), True
        return "", False

    return parse


# ---------------------------------------------------------------------------------------- API
def project_action(response: str, fmt: str = "tags", *, max_chars: int | None = MAX_RESPONSE_CHARS
                   ) -> tuple[str, bool]:
    """Return ``(action, valid)`` for one raw response. Never raises on any response.

    Linear in ``min(len(response), max_chars)``; the response is cut to ``max_chars`` first.
    """
    response = clean_text(response)
    if max_chars is not None:
        response = response[:max_chars]
    return _action_format(fmt).parse(response)


def expert_response(action: str, fmt: str = "tags", think: str | None = None) -> str:
    """A well-formed response that projects to ``(action, True)`` in format ``fmt`` (for warm starts).

    ``think`` is the text inside ``<think> </think>`` (``{action}`` is filled in; ``""`` gives the
    shortest valid response); ``None``: "The best next action is {action}." (search: a fixed
    sentence, since the action is itself a tag)."""
    try:
        style = _action_format(fmt).expert
    except ValueError:  # an unknown format: the tags form
        style = "tags"
    if think is None:
        think = "The best next step is this one." if style == "search" else "The best next action is {action}."
    think = "<think>" + think.format(action=action) + "</think>"
    if style == "json":
        return think + '{"action": "' + action + '"}'
    if style == "search":  # the tag once only: a repeated tag is invalid
        return think + action
    return think + f"<action>{action}</action>"


class ActionProjection(Transform):
    """Parses ``("text", "response")`` into ``action`` (str), ``action_valid`` (``[*B, 1]`` bool) and
    ``response_cut`` (``[*B, 1]`` bool: the response was longer than ``max_chars`` and only its first
    ``max_chars`` characters were parsed), for a batch of any shape ``B``.

    In a ``TransformedEnv`` it is an action transform (``in_keys_inv=["action"]``,
    ``out_keys_inv=[("text", "response")]``): the transformed env's action is the response text the
    policy writes, the inverse call parses it into the base env's ``action``, and the step's output
    holds the parse, ``("next", "action")``, ``("next", "action_valid")`` and
    ``("next", "response_cut")`` (like a step's ``info``; TorchRL runs inverse transforms on a copy of
    the step's input, so the input itself is left as the policy wrote it). ``env.rollout(n, policy)``
    and TorchRL's collectors therefore record them; they are declared in the env's
    ``fake_tensordict``. A response-less input keeps its provided ``action``.

    Called as a module (``projection(td)``) it writes the same keys into ``td`` itself.
    Each response is parsed once per step: a call with the same responses as the previous call
    reuses its result (``num_parsed`` counts the parses).

    Args:
        fmt: a name of :data:`ACTION_FORMATS` (``"reference"`` needs
            ``env_name``).
        max_chars: the cut; ``None``: no cut.
        env_name: resolves ``fmt="reference"`` (see :func:`resolve_format`).

    Examples:
        >>> env = TransformedEnv(base, Compose(WindowMemory(2), PromptTransform(tok), ActionProjection()))  # doctest: +SKIP
        >>> rollout = env.rollout(10, policy)  # policy: ("text", "prompt") -> ("text", "response")  # doctest: +SKIP
        >>> rollout["next", "action"], rollout["next", "action_valid"]  # the command sent, its validity  # doctest: +SKIP
    """

    response_key = ("text", "response")
    #: What the projection writes (into the step's output in an env, into ``td`` as a module).
    parsed_keys = ("action", "action_valid", "response_cut")

    def __init__(self, fmt: str = "tags", *, max_chars: int | None = MAX_RESPONSE_CHARS, env_name: str = ""):
        fmt = resolve_format(fmt, env_name)
        if max_chars is not None and max_chars < 1:
            raise ValueError(f"ActionProjection: max_chars must be >= 1 or None, got {max_chars}")
        super().__init__(in_keys=[], out_keys=[], in_keys_inv=["action"], out_keys_inv=[self.response_key])
        self.fmt, self.max_chars = fmt, max_chars
        self.num_parsed = 0
        self._last: tuple[list[str], list[tuple[str, bool]]] | None = None

    def project(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Write ``action``, ``action_valid`` and ``response_cut`` from ``("text", "response")`` in place."""
        response = tensordict.get(self.response_key, None)
        if response is None:  # nothing generated: keep a provided action
            return tensordict
        shape = tensordict.batch_size
        responses = _strings(response, shape.numel())
        if self._last is not None and self._last[0] == responses:
            pairs = self._last[1]
        else:
            pairs = [project_action(r, self.fmt, max_chars=self.max_chars) for r in responses]
            self.num_parsed += len(responses)
            self._last = (responses, pairs)
        cut = [self.max_chars is not None and len(r) > self.max_chars for r in responses]
        tensordict.set("action", _string_stack([a for a, _ in pairs], shape))
        tensordict.set("action_valid", torch.tensor([v for _, v in pairs], dtype=torch.bool).reshape(*shape, 1))
        tensordict.set("response_cut", torch.tensor(cut, dtype=torch.bool).reshape(*shape, 1))
        return tensordict

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.project(tensordict)

    # ---------------------------------------------------------------- TorchRL plumbing
    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.project(tensordict)

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        # ``tensordict`` is the inverse-transformed copy of the step's input: it holds the parse
        return next_tensordict.update(tensordict.select(*self.parsed_keys, strict=False))

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        # the base env's placeholder ``action`` is not an input of this env (the response is)
        return tensordict_reset.exclude("action")

    def parsed_spec(self, shape: torch.Size) -> Composite:
        """The specs of :attr:`parsed_keys` for a batch ``shape``."""
        return Composite(
            action=NonTensor(shape=shape, example_data="", dtype=None),
            action_valid=Categorical(2, shape=(*shape, 1), dtype=torch.bool),
            response_cut=Categorical(2, shape=(*shape, 1), dtype=torch.bool),
            shape=shape,
        )

    def transform_action_spec(self, action_spec: Composite) -> Composite:
        action_spec = action_spec.clone()
        del action_spec["action"]
        action_spec[self.response_key] = NonTensor(shape=action_spec.shape, example_data="", dtype=None)
        return action_spec

    def transform_fake_tensordict(self, fake_tensordict: TensorDictBase) -> TensorDictBase:
        fake_tensordict.get("next").update(self.parsed_spec(fake_tensordict.batch_size).zero())
        return fake_tensordict

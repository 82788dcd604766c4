"""Action projection: the model's raw response -> the environment command and its validity.

Reference rules (``ALGORITHMS.md``): the action is the first ``<action>...</action>`` content,
lower-cased and stripped; the response is invalid when the action tags or the think tags are
missing, or when it contains CJK characters. An invalid response still reaches the environment
as the last 30 characters of the lower-cased response (which the environment answers as a
no-op), so a malformed output is an invalid action, never a crash.

Formats: ``"tags"`` (``<think>`` + ``<action>``), ``"json"`` (``<think>`` + a JSON object with an
``"action"`` field, the cards), ``"search"`` (``<think>`` + ``<search>q</search>`` or
``<answer>a</answer>``; the action is the whole tag, e.g. ``"<search>q</search>"``), ``"code"``
(``<think>`` + ``<code>...</code>``; the action is the code, case and indentation kept: AppWorld).
"""

from __future__ import annotations

import json
import re

import torch
from tensordict import NonTensorStack, TensorDictBase
from torchrl.envs import Transform

from torchrl_agent.envs.base import clean_text
from torchrl_agent.envs.transforms.memory import _strings

__all__ = ["ActionProjection", "project_action"]

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_ACTION = re.compile(r"<action>(.*?)</action>", re.DOTALL)
_SEARCH = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL)
_JSON = re.compile(r"\{[^{}]*\}", re.DOTALL)
_CJK = re.compile(r"[\u2e80-\u2fff\u3040-\u30ff\u3100-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")


def project_action(response: str, fmt: str = "tags") -> tuple[str, bool]:
    """Return ``(action, valid)`` for one raw response. Never raises."""
    response = clean_text(response)
    action, valid = None, _THINK.search(response) is not None and not _CJK.search(response)
    if fmt == "tags":
        match = _ACTION.search(response)
        action = match.group(1).strip().lower() if match else None
    elif fmt == "search":
        match = _SEARCH.search(response)
        action = f"<{match.group(1)}>{match.group(2).strip()}</{match.group(1)}>" if match else None
    elif fmt == "code":
        match = _CODE.search(response)
        action = match.group(1) if match else None
    elif fmt == "json":
        action = None
        for candidate in _JSON.findall(response):
            try:
                value = json.loads(candidate).get("action")
            except (ValueError, AttributeError):
                continue
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                action = str(value).strip().lower()
                break
    else:
        raise ValueError(f"unknown action format {fmt!r}; use 'tags', 'json', 'search' or 'code'")
    if action is None or not valid:
        return response.lower()[-30:], False
    return action, True


class ActionProjection(Transform):
    """Parses ``("text", "response")`` into ``action`` (``[B]`` str) and ``action_valid`` (``[B, 1]``).

    In a ``TransformedEnv`` it runs as an inverse transform before the base env steps. Called as a
    module (``projection(td)``, e.g. as the policy's last stage) it writes the same keys in place,
    so the collected step rows record them.
    """

    def __init__(self, fmt: str = "tags"):
        project_action("", fmt)  # validates fmt
        super().__init__(in_keys=[], out_keys=[], in_keys_inv=[], out_keys_inv=[])
        self.fmt = fmt

    def project(self, tensordict: TensorDictBase) -> TensorDictBase:
        response = tensordict.get(("text", "response"), None)
        if response is None:  # nothing generated: keep a provided action
            return tensordict
        n = tensordict.batch_size[0]
        pairs = [project_action(r, self.fmt) for r in _strings(response, n)]
        tensordict.set("action", NonTensorStack(*[a for a, _ in pairs], batch_size=[n]))
        tensordict.set("action_valid", torch.tensor([v for _, v in pairs], dtype=torch.bool).reshape(n, 1))
        return tensordict

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.project(tensordict)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.project(tensordict)

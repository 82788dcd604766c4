"""Action projection: the reference validity rules, and malformed outputs become invalid actions."""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from torchrl_agent.envs.transforms import ActionProjection, project_action


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>go</think><action> Go To Sink 1 </action>", ("go to sink 1", True)),
        ("<think>a</think><action>+</action><action>-</action>", ("+", True)),  # the first action counts
        ("<action>+</action>", ("<action>+</action>", False)),  # no think tags
        ("<think>a</think> +", ("<think>a</think> +", False)),  # no action tags
        ("<think>想</think><action>+</action>", ("nk>想</think><action>+</action>", False)),  # CJK: invalid
        ("", ("", False)),
    ],
)
def test_tags_projection(response, expected):
    assert project_action(response, "tags") == expected


def test_invalid_action_is_the_tail_of_the_lowercased_response():
    response = "I THINK the answer is obviously to move RIGHT now"
    action, valid = project_action(response)
    assert not valid and action == response.lower()[-30:] and len(action) == 30


def test_json_and_search_formats():
    assert project_action('<think>t</think>{"action": "+"}', "json") == ("+", True)
    assert project_action('<think>t</think>{"action": 7}', "json") == ("7", True)
    assert project_action('<think>t</think>{"move": "+"}', "json")[1] is False
    assert project_action("<think>t</think>{broken json", "json")[1] is False
    assert project_action("<think>t</think><search> who wrote x </search>", "search") == (
        "<search>who wrote x</search>", True)
    assert project_action("<think>t</think><answer>Paris</answer>", "search") == ("<answer>Paris</answer>", True)
    assert project_action("<think>t</think>Paris", "search")[1] is False
    with pytest.raises(ValueError, match="unknown action format"):
        ActionProjection("xml")


def test_malformed_outputs_never_raise():
    invalid_utf8 = b"<think>\xff\xfe</think><action>\xc3</action>".decode("utf-8", errors="replace")
    surrogates = "<think>x</think><action>\udcff</action>"
    for response in ["", "no tags at all", "x" * 20_000, invalid_utf8, surrogates, "\x00\x1b[31m", None]:
        for fmt in ("tags", "json", "search"):
            action, valid = project_action(response, fmt)
            assert isinstance(action, str) and len(action) <= 30 or valid
    assert project_action(invalid_utf8) == ("\ufffd", True)


def test_projection_transform_writes_action_and_validity():
    td = TensorDict({"text": {"response": NonTensorStack("<think>a</think><action>+</action>", "junk")}}, [2])
    ActionProjection()(td)
    assert list(td["action"]) == ["+", "junk"]
    assert td["action_valid"].tolist() == [[True], [False]]
    assert td["action_valid"].dtype == torch.bool

"""Action projection (our formats): validity rules, malformed outputs become invalid actions, parsing
is linear (checked against the backtracking regular expressions it replaces) and done once per step,
and an over-long response is cut before parsing."""

from __future__ import annotations

import random
import re

import pytest
import torch
from tensordict import NonTensorStack, TensorDict
from test_collector import ExpertOrJunk, expert_text
from torchrl.envs import Compose, TransformedEnv

from torchrl_agent.collectors import StepCollector, episode_metrics
from torchrl_agent.envs import make_env
from torchrl_agent.envs.transforms import (
    ActionProjection,
    PromptTransform,
    WindowMemory,
    project_action,
    reference_formats,
)
from torchrl_agent.envs.transforms.projection import _first_of, tag_block


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>go</think><action> Go To Sink 1 </action>", ("go to sink 1", True)),
        ("<think>a</think><action>+</action><action>-</action>", ("+", True)),  # the first action counts
        ("<THINK>a</THINK><Action> Up </ACTION>", ("up", True)),  # tag names are case-insensitive
        ("<action>+</action>", ("+", False)),  # no think tags: the action is sent, flagged invalid
        ("</think><think><action>+</action>", ("+", False)),  # think tags in the wrong order
        ("<think>a</think> +", ("<think>a</think> +", False)),  # no action tags: the tail
        ("<think>a</think></action>+<action>", ("nk>a</think></action>+<action>", False)),  # closing first
        ("<think>想</think><action>+</action>", ("+", False)),  # CJK: invalid
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
    assert project_action('{"action": "+"}', "json") == ("+", False)  # our json format asks for <think>
    assert project_action('<think>t</think>{"move": "+"}', "json")[1] is False
    assert project_action("<think>t</think>{broken json", "json")[1] is False
    assert project_action("<think>t</think><search> who wrote x </search>", "search") == (
        "<search>who wrote x</search>", True)
    assert project_action("<think>t</think><ANSWER>Paris</Answer>", "search") == ("<answer>Paris</answer>", True)
    assert project_action("<think>t</think>Paris", "search")[1] is False
    # both tags, or one tag twice: the first block is sent, flagged invalid
    assert project_action("<think>t</think><answer>a</answer><search>q</search>", "search") == (
        "<answer>a</answer>", False)
    assert project_action("<think>t</think><search>q</search><search>r</search>", "search") == (
        "<search>q</search>", False)
    with pytest.raises(ValueError, match="unknown action format"):
        ActionProjection("xml")
    with pytest.raises(ValueError, match="no parsing rule for env 'babyai'"):
        ActionProjection("reference", env_name="babyai")


def test_malformed_outputs_never_raise():
    invalid_utf8 = b"<think>\xff\xfe</think><action>\xc3</action>".decode("utf-8", errors="replace")
    surrogates = "<think>x</think><action>\udcff</action>"
    for response in ["", "no tags at all", "x" * 20_000, invalid_utf8, surrogates, "\x00\x1b[31m", None, 17]:
        for fmt in ("tags", "json", "search", *reference_formats()):
            action, valid = project_action(response, fmt)
            assert isinstance(action, str) and isinstance(valid, bool)
            assert len(action) <= 30 or valid
    assert project_action(invalid_utf8) == ("\ufffd", True)


def test_projection_transform_writes_action_and_validity():
    td = TensorDict({"text": {"response": NonTensorStack("<think>a</think><action>+</action>", "junk")}}, [2])
    ActionProjection()(td)
    assert list(td["action"]) == ["+", "junk"]
    assert td["action_valid"].tolist() == [[True], [False]]
    assert td["action_valid"].dtype == torch.bool
    assert td["response_cut"].tolist() == [[False], [False]]


# ------------------------------------------------------------------------------------------- linear time
_PIECES = ["<action>", "</action>", "<ACTION>", "</Action>", "<search>", "</search>", "<answer>", "</ANSWER>",
           "<think>", "</think>", "a", " b ", "<", ">", "/", "\n"]


def test_linear_scanner_equals_the_backtracking_regex_on_random_inputs():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 12)))
        for name in ("action", "search", "answer", "think"):
            match = re.search(rf"<{name}>(.*?)</{name}>", text, re.DOTALL | re.IGNORECASE)
            expected = None if match is None else (match.start(), match.group(1))
            assert tag_block(text, name) == expected, text
        match = re.search(r"<(search|answer)>(.*?)</\1>", text, re.DOTALL | re.IGNORECASE)
        first = _first_of(text)
        assert (first is None) == (match is None), text
        if match is not None:
            (start, content), name = first
            assert (start, content, name) == (match.start(), match.group(2), match.group(1).lower()), text


@pytest.mark.timeout(20)
@pytest.mark.parametrize("fmt", ["tags", "json", "search", *reference_formats()])
def test_pathological_200kb_responses_parse(fmt):
    # each of these took quadratic time with the old backtracking patterns (a 160 kB one took 22 s);
    # the timeout is a guard, the speed figure is benchmarks/parse_speed.py's
    n = 200_000
    for response in ("<think>" * (n // 7), "<action>" * (n // 8), "<search><answer>" * (n // 16),
                     "{" * n, '"action":' * (n // 9), "<think>" + "x" * n):
        action, valid = project_action(response, fmt, max_chars=None)
        assert not valid


def test_overlong_responses_are_cut_before_parsing_and_counted():
    head = "<think>t</think><action>+</action>"
    long = head + "x" * 100 + "<action>-</action>"
    projection = ActionProjection(max_chars=len(head) + 10)
    td = TensorDict({"text": {"response": NonTensorStack(long, head)}}, [2])
    projection(td)
    assert list(td["action"]) == ["+", "+"] and td["response_cut"].tolist() == [[True], [False]]
    # the action lies past the cut: no action tags in what is parsed, the tail of the cut text is sent
    assert project_action("<think>t</think>" + "x" * 50 + "<action>+</action>", max_chars=40) == (
        ("<think>t</think>" + "x" * 24)[-30:], False)
    with pytest.raises(ValueError, match="max_chars"):
        ActionProjection(max_chars=0)


def test_each_response_is_parsed_once_per_step(tokenizer):
    # the collector projects before stepping and the env's inverse transform would project again
    projection = ActionProjection(max_chars=60)
    env = TransformedEnv(make_env("numberline", num_groups=2, group_size=3, max_steps=6),
                         Compose(WindowMemory(2), PromptTransform(tokenizer, "numberline"), projection))
    calls = {"n": 0}

    def responses(prompt):
        calls["n"] += 1
        return expert_text(prompt) + ("z" * 100 if calls["n"] % 4 == 0 else "")

    collector = StepCollector(env, ExpertOrJunk(tokenizer, responses), seed=0)
    rows = collector.collect()
    assert collector.stats["generation_slots"] == calls["n"] == rows.batch_size[0]
    # one parse of the batch (6 environments) per step of the collector, not two
    steps = int(torch.bincount(rows["traj_id"].reshape(-1)).max())
    assert projection.num_parsed == 6 * steps
    cut = rows["response_cut"].reshape(-1)
    assert 0 < int(cut.sum()) == episode_metrics(rows)["responses_cut"]
    assert rows["action_valid"].all()  # the cut tail held nothing the parse needed

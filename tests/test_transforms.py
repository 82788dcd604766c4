"""Memory and prompt transforms: composition in a TransformedEnv, window semantics, replay, budget."""

from __future__ import annotations

import json

import pytest
from torchrl.envs import Compose, TransformedEnv
from torchrl.envs.utils import check_env_specs, step_mdp

from torchrl_agent.envs import make_env
from torchrl_agent.envs.transforms import (
    ActionProjection,
    ActionWindow,
    FullHistory,
    MemoryTransform,
    NoHistory,
    PromptTransform,
    WindowMemory,
    load_memory,
)

RESPONSES = ["<think>a</think><action>+</action>", "oops no tags", "<think>b</think><action>-</action>",
             "<think>c</think><action>+</action>"]


def rollout(tokenizer, memory, steps=4, **prompt_kwargs):
    prompt = PromptTransform(tokenizer, "numberline", **prompt_kwargs)
    projection = ActionProjection()
    env = TransformedEnv(make_env("numberline", num_groups=1, group_size=2, max_steps=20),
                         Compose(memory, prompt, projection))
    td = env.reset()
    rows = []
    for response in RESPONSES[:steps]:
        td["text", "response"] = [response, response]
        projection(td)
        rows.append(td[0].clone())
        td = step_mdp(env.step(td))
    return env, prompt, rows, td


@pytest.mark.parametrize("memory", [WindowMemory(2), ActionWindow(2), FullHistory(), NoHistory()],
                         ids=["window", "actions", "full", "none"])
def test_env_with_transforms_passes_check_env_specs(tokenizer, memory):
    env = TransformedEnv(make_env("numberline", num_groups=2, group_size=2),
                         Compose(memory, PromptTransform(tokenizer, "numberline"), ActionProjection()))
    check_env_specs(env)


@pytest.mark.parametrize("make_memory", [lambda: WindowMemory(2), FullHistory, NoHistory, lambda: WindowMemory(1),
                                         lambda: ActionWindow(2)])
def test_replay_reproduces_every_prompt_token_for_token(tokenizer, make_memory):
    _, prompt, rows, _ = rollout(tokenizer, make_memory())
    for row in rows:
        replayed = prompt.render_row(row)
        assert replayed == row["text", "prompt"]
        assert tokenizer(replayed)["input_ids"] == tokenizer(row["text", "prompt"])["input_ids"]


def test_window_memory_keeps_the_last_k_pairs_with_invalid_tail(tokenizer):
    _, _, rows, td = rollout(tokenizer, WindowMemory(2))
    records = json.loads(td["memory"][0])["records"]
    assert [r["step"] for r in records] == [2, 3]
    # the record holds the observation *before* the action and the projected action
    assert records[0]["observation"] == rows[2]["observation"] and records[0]["action"] == "-"
    second = json.loads(rows[2]["memory"])["records"]
    assert second[1]["action"] == "oops no tags"  # invalid: the lower-cased tail of the response
    assert "[Step 3]" in td["text", "prompt"][0] and "[Step 1]" not in td["text", "prompt"][0]


def test_action_window_shows_the_last_k_actions_without_observations(tokenizer):
    _, _, rows, td = rollout(tokenizer, ActionWindow(2))
    assert "Your last" not in rows[0]["text", "prompt"]  # nothing taken yet
    assert "Your last 1 actions: +\n" in rows[1]["text", "prompt"]
    prompt = td["text", "prompt"][0]  # after +, (invalid), -, +: the last two, oldest first
    assert "Your last 2 actions: -, +\n" in prompt and "Observation" not in prompt
    memory, records = load_memory(td["memory"][0])
    assert isinstance(memory, ActionWindow) and memory.k == 2 and [r["action"] for r in records] == ["-", "+"]


def test_full_history_replays_earlier_responses_as_turns(tokenizer):
    _, _, rows, td = rollout(tokenizer, FullHistory())
    prompt = td["text", "prompt"][0]
    assert all(r in prompt for r in RESPONSES)
    assert prompt.count("<|im_start|>assistant") == len(RESPONSES) + 1
    assert len(rows[-1]["text", "prompt"]) > len(rows[0]["text", "prompt"])


def test_prompt_budget_drops_oldest_records_and_says_so(tokenizer):
    _, prompt, rows, td = rollout(tokenizer, FullHistory())
    full = prompt.num_tokens(td["text", "prompt"][0])
    _, small, rows_small, td_small = rollout(tokenizer, FullHistory(), max_prompt_tokens=full - 1)
    state = json.loads(td_small["memory"][0])
    assert state["dropped"] >= 1
    assert state["records"][-1]["response"] == RESPONSES[-1]  # the newest records are kept
    assert small.num_tokens(td_small["text", "prompt"][0]) <= full - 1
    assert not td_small["prompt_over_budget"].any()
    for row in rows_small:  # replay stays exact after drops
        assert small.render_row(row) == row["text", "prompt"]
    # a budget below the bare prompt: the observation is kept whole and the row is flagged
    _, tiny, _, td_tiny = rollout(tokenizer, WindowMemory(2), max_prompt_tokens=5)
    assert td_tiny["prompt_over_budget"].all()
    assert td_tiny["observation"][0] in td_tiny["text", "prompt"][0]


def test_custom_memory_subclass_round_trips(tokenizer):
    class LastObservation(MemoryTransform):
        kind = "last_observation_test"

        def update(self, records, record):
            return [record]

        def render(self, records):
            return ("Before: " + records[-1]["observation"]) if records else "", []

    env, prompt, rows, td = rollout(tokenizer, LastObservation())
    memory, records = load_memory(td["memory"][0])
    assert isinstance(memory, LastObservation) and len(records) == 1
    assert "Before: " + rows[-1]["observation"] in td["text", "prompt"][0]
    assert prompt.render_row(rows[-1]) == rows[-1]["text", "prompt"]


def test_bad_template_and_memory_arguments_fail_clearly(tokenizer):
    with pytest.raises(ValueError, match="bad template field"):
        PromptTransform(tokenizer, "Hello {name}")
    with pytest.raises(ValueError, match="k must be >= 0"):
        WindowMemory(-1)

"""Replay equality for every environment and every memory: a step row alone re-renders the exact
prompt (text and tokens) that the policy saw at that step."""

from __future__ import annotations

import os
import random
import shutil

import pytest
from conftest import SHARED_DATA
from torchrl.envs import Compose, TransformedEnv
from torchrl.envs.utils import step_mdp

from torchrl_agent.envs import make_env
from torchrl_agent.envs.registry import load_env_packages
from torchrl_agent.envs.transforms import (
    PROMPT_TEMPLATES,
    ActionProjection,
    FullHistory,
    NoHistory,
    PromptTransform,
    SummaryMemory,
    WindowMemory,
)
from torchrl_agent.modules import TransformersPolicy

REAL_GAME = ("json_2.1.1/train/pick_heat_then_place_in_recep-Potato-None-SinkBasin-14/"
             "trial_T20190908_231731_054988")
SHARED = SHARED_DATA / "alfworld"
FORMATS = {"search": "search", "ezpoints": "json", "points24": "json", "blackjack": "json"}
ENVS = ["numberline", "ezpoints", "points24", "blackjack", "sokoban", "babyai", "search", "alfworld", "webshop"]


def env_kwargs(name, tmp_path_factory):
    if name != "alfworld":
        return {}
    pytest.importorskip("textworld")
    root = tmp_path_factory.mktemp("alfworld")
    shutil.copytree(SHARED / REAL_GAME, root / REAL_GAME)
    return {"game_files": [str(root / REAL_GAME / "game.tw-pddl")]}


def response_for(fmt, action):
    if fmt == "json":
        return '<think>t</think>{"action": "' + action + '"}'
    if fmt == "search":
        return f"<think>t</think><search>{action or 'capital'}</search>"
    return f"<think>t</think><action>{action}</action>"


@pytest.mark.parametrize("memory_kind", ["window", "full", "none", "summary"])
@pytest.mark.parametrize("name", ENVS)
def test_replay_equality(name, memory_kind, tokenizer, tiny_model, tmp_path_factory):
    fmt = FORMATS.get(name, "tags")
    summarizer = TransformersPolicy(tiny_model, tokenizer, max_new_tokens=8)
    memory = {"window": WindowMemory(2), "full": FullHistory(), "none": NoHistory(),
              "summary": SummaryMemory(1, summarizer=summarizer, max_summary_tokens=8)}[memory_kind]
    load_env_packages(name)  # the env's package registers its template
    prompt = PromptTransform(tokenizer, name if name in PROMPT_TEMPLATES else
                             ("cards" if fmt == "json" else "default"))
    projection = ActionProjection(fmt)
    env = TransformedEnv(make_env(name, num_groups=1, group_size=2, seed=3, **env_kwargs(name, tmp_path_factory)),
                         Compose(memory, prompt, projection))
    rng = random.Random(0)
    td = env.reset()
    rows = []
    for step in range(4):
        responses = []
        for i in range(2):
            actions = [a for a in td["admissible_actions"][i].split("\n") if a]
            action = td["expert_action"][i] or (rng.choice(actions) if actions else "")
            responses.append(response_for(fmt, action) if (step + i) % 3 else "malformed output")
        td["text", "response"] = responses
        projection(td)
        rows += [td[i].clone() for i in range(2) if not td["done"][i]]
        td = step_mdp(env.step(td))
        if td["done"].all():
            break
    assert rows
    fresh = PromptTransform(tokenizer, prompt.template)  # replay needs no state of the rollout
    for row in rows:
        replayed = fresh.render_row(row)
        assert replayed == row["text", "prompt"]
        assert tokenizer(replayed)["input_ids"] == tokenizer(row["text", "prompt"])["input_ids"]


def test_shared_alfworld_data_is_where_the_tests_expect_it():
    assert os.path.isfile(SHARED / REAL_GAME / "game.tw-pddl")

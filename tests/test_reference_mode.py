"""The reference mode: verl-agent's prompts and parsing rules per environment, on hand-written
responses (expected command and validity), the prompts it renders, replay, and the recipes that use it."""

from __future__ import annotations

import math
import random

import pytest
from test_replay import env_kwargs
from torchrl.envs import Compose, TransformedEnv
from torchrl.envs.utils import step_mdp

from torchrl_agent.envs import make_env
from torchrl_agent.envs.transforms import (
    REFERENCE_TEMPLATES,
    ActionProjection,
    FullHistory,
    NoHistory,
    PromptTransform,
    WindowMemory,
    expert_response,
    project_action,
    resolve_format,
    resolve_template,
)
from torchrl_agent.trainers.cli import compose_config

TAIL = 30

CASES = {
    "alfworld": [
        ("<think>kitchen</think><action>Go to Sink 1</action>", "go to sink 1", True),
        ("<think>a</think><ACTION> Look </Action>", "look", True),  # action tags: the response is lower-cased
        ("<action>look</action>", "look", False),  # a clean action without <think>: sent, flagged invalid
        ("</think>x<think><action>look</action>", "look", True),  # think tags in any order
        ("<THINK>a</THINK><action>look</action>", "look", False),  # the think check is case-sensitive
        ("<think>思考</think><action>look</action>", "look", False),  # CJK (U+4E00..U+9FFF)
        ("<think>ソ</think><action>look</action>", "look", True),  # katakana is outside that range
        ("<think>a</think><action>open drawer 1</action><action>look</action>", "open drawer 1", True),
        ("<think>a</think> I will GO TO THE SINK 1 now, ok?", "i will go to the sink 1 now, ok?"[-TAIL:], False),
        ("<think>a</think><action>look", "<think>a</think><action>look"[-TAIL:], False),  # no closing tag
        ("</action><think>a</think><action>look", "", True),  # the first </action> precedes <action>: empty
    ],
    "sokoban": [
        ("<think>push</think><action>up</action>", "Up", True),
        ("<think>t</think><action>Move LEFT</action>", "Left", True),
        ("<think>t</think><action>up, then left</action>", "Up", True),  # first of up/down/left/right/still
        ("<think>t</think><action>right and down</action>", "Down", True),  # ... in that order, not the text's
        ("<think>t</think><action>still</action>", "Still", True),
        ("<think>t</think><action>jump</action>", "Still", False),
        ("<action>down</action>", "Down", False),  # no <think>
        ("<think>t</think> down", "Still", False),  # no action tags
        ("<think>上</think><action>up</action>", "Up", True),  # no CJK check for Sokoban
    ],
    "numberline": [
        ('{"current number": "2", "target number": "4", "thoughts": "go up", "action": "+"}', "+", True),
        ('<think>t</think>{"action": "-"}', "-", True),
        ('{"action": "-", "thoughts": "not +"}', "", False),  # two tokens after "action":
        ('{"thoughts": "+ or -?", "action": "+"}', "+", True),  # only the text after "action": counts
        ("+", "+", True),  # no "action": key: the last character alone
        ("I choose +.", "", False),
        ('{"action": "left"}', "", False),
        ('{"Action": "+"}', "+", True),  # lower-cased first
    ],
    "blackjack": [
        ('{"thoughts": "13 against a 10: hit", "action": "hit"}', "hit", True),
        ('{"action": "Stand"}', "stand", True),
        ('{"action": "hit or stand"}', "", False),
        ('{"action": "stand", "thoughts": "never hit on 17"}', "", False),
        ("<think>t</think><action>hit</action>", "", False),  # no "action": key; last character ">"
    ],
    "ezpoints": [
        ('{"thoughts": "3 * 4 = 12", "action": "3"}', "3", True),
        ('{"action": "10"}', "10", True),  # 10 is taken first, then removed
        ('{"action": "1"}', "1", True),
        ('{"action": "*"}', "*", True),
        ('{"action": "="}', "=", True),
        ('{"action": "12"}', "", False),  # 1 and 2
        ('{"action": "-"}', "", False),  # not an EZPoints token
    ],
    "points24": [
        ('{"thoughts": "8*3*(2-1)", "action": "("}', "(", True),
        ('{"action": "/"}', "/", True),
        ('{"action": "10"}', "10", True),
        ('{"action": "(10"}', "", False),
    ],
    "search": [
        ("<think>t</think><search> Capital of France </search>", "<search>Capital of France</search>", True),
        ("<search>who wrote Hamlet</search>", "<search>who wrote Hamlet</search>", True),  # no <think> check
        ("<think>t</think><answer>Paris</answer>", "<answer>Paris</answer>", True),
        ("<SEARCH>q</SEARCH>", "<search>q</search>", True),  # tags case-insensitive
        ("<think>思</think><answer>巴黎</answer>", "<answer>巴黎</answer>", True),  # no CJK check
        ("<search>q</search><answer>a</answer>", "<search>q</search>", False),  # both tags
        ("<answer>a</answer><search>q</search>", "<search>q</search>", False),  # <search> is looked for first
        ("<answer>a</answer><answer>b</answer>", "<answer>a</answer>", False),  # a tag twice
        ("<search>q</search> and <search>r", "<search>q</search>", False),
        ("<think>the answer is Paris</think>", "", False),
        ("<search></search>", "<search></search>", True),  # empty: the env answers it as invalid
    ],
}


@pytest.mark.parametrize("env", list(CASES))
def test_reference_parsing_per_environment(env):
    fmt = resolve_format("reference", env)
    for response, action, valid in CASES[env]:
        assert project_action(response, fmt) == (action, valid), response


def test_reference_mode_covers_every_reference_environment():
    for env in CASES:
        assert resolve_format("reference", env) == f"reference_{env}"
        assert resolve_template("reference", env) is REFERENCE_TEMPLATES[f"reference_{env}"]
    with pytest.raises(ValueError, match="no prompt for env 'babyai'"):
        resolve_template("reference", "babyai")
    for env in CASES:  # the warm start's expert responses parse as valid in the reference mode too
        for action in {"alfworld": ["go to sink 1"], "sokoban": ["left"], "search": ["<answer>x</answer>"],
                       "numberline": ["+", "-"], "blackjack": ["hit", "stand"],
                       "ezpoints": ["10", "1", "*", "="], "points24": ["(", "7", "/"]}[env]:
            expected = action.capitalize() if env == "sokoban" else action
            assert project_action(expert_response(action, f"reference_{env}"), f"reference_{env}") == (expected, True)


# ------------------------------------------------------------------------------------------ prompts
def test_alfworld_reference_prompt_text():
    template = REFERENCE_TEMPLATES["reference_alfworld"]
    records = [{"step": 3, "observation": "You open the fridge 1.", "action": "open fridge 1"},
               {"step": 4, "observation": "Nothing happens.", "action": "i think i will go to"}]
    text = template.content("put a cool apple in diningtable.", "You arrive at sinkbasin 1.",
                            ["go to fridge 1", "help", "look"], 5, records, "")
    assert text == (
        "\nYou are an expert agent operating in the ALFRED Embodied Environment. Your task is to: "
        "put a cool apple in diningtable.\n"
        "Prior to this step, you have already taken 5 step(s). Below are the most recent 2 observations and the "
        "corresponding actions you took: [Observation 4: 'You open the fridge 1.', Action 4: 'open fridge 1']\n"
        "[Observation 5: 'Nothing happens.', Action 5: 'i think i will go to']\n"
        "You are now at step 6 and your current observation is: You arrive at sinkbasin 1.\n"
        "Your admissible actions of the current situation are: ['go to fridge 1'\n 'look'].\n\n"
        "Now it's your turn to take an action.\n"
        "You should first reason step-by-step about the current situation. This reasoning process MUST be "
        "enclosed within <think> </think> tags. \n"
        "Once you've finished your reasoning, you should choose an admissible action for current step and "
        "present it within <action> </action> tags.\n")
    # the first observation is the reference env's reset text: banner, room, task
    first = template.content("put a hot potato in sinkbasin.", "You are in the middle of a room.", ["look"], 0, [], "")
    assert first.startswith("\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
                            "Your current observation is: -= Welcome to TextWorld, ALFRED! =-\n\n"
                            "You are in the middle of a room.\n\nYour task is to: put a hot potato in sinkbasin.\n"
                            "Your admissible actions of the current situation are: ['look'].\n")
    later = template.content("put x.", "Nothing happens.", ["look"], 1,
                             [{"step": 0, "observation": "You are in a room.", "action": "look"}], "")
    assert ("[Observation 1: '-= Welcome to TextWorld, ALFRED! =-\n\nYou are in a room.\n\nYour task is to: "
            "put x.', Action 1: 'look']") in later
    # no memory (history_length <= 0 in the reference): the no-history text at every step
    no_memory = template.content("t", "obs", ["look"], 7, None, "")
    assert no_memory.startswith("\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
                                "Your current observation is: obs\n") and "Prior to this step" not in no_memory


def test_search_reference_prompt_pairs_each_query_with_what_it_returned():
    template = REFERENCE_TEMPLATES["reference_search"]
    records = [{"step": 0, "observation": "Question: q?", "action": "<search>a</search>"},
               {"step": 1, "observation": "<information>A</information>", "action": "<search>b</search>"}]
    text = template.content("q?", "<information>B</information>", [], 2, records, "")
    assert ("Prior to this step, you have already taken 2 step(s). Below is the interaction history where "
            "<search> </search> wrapped your past search queries and <information> </information> wrapped the "
            "corresponding search results returned by the external search engine. History:\n"
            "Step 1:<search>a</search> <information>A</information>\n\n"
            "Step 2:<search>b</search> <information>B</information>\n\n\n"
            "Now it's your turn to respond for the current step.\n") in text
    assert text.startswith("\nYou are an expert agent tasked with answering the given question step-by-step.\n"
                           "Your question: q?\n")


def test_cards_reference_prompt_replaces_the_image_with_the_observation():
    text = REFERENCE_TEMPLATES["reference_ezpoints"].content("t", "Cards: 3, 4. Formula so far: 3 *", [], 2, [], "")
    assert text.startswith("\nCards: 3, 4. Formula so far: 3 *\nYou are an expert card game player helping to "
                           "build a math formula that evaluates to **12**")
    assert "and the current formula is: '3*'\nIt's your turn to append the next character." in text
    assert "<image>" not in text and '{\n  "thoughts":' in text
    empty = REFERENCE_TEMPLATES["reference_points24"].content("t", "Cards: 8, 3. Formula so far: (empty)", [], 0,
                                                              None, "")
    assert "the current formula is: ''\n" in empty


@pytest.mark.parametrize("name", list(CASES))
def test_reference_prompts_on_real_envs_replay_token_for_token(name, tokenizer, tmp_path_factory):
    fmt = f"reference_{name}"
    prompt = PromptTransform(tokenizer, "reference", env_name=name)
    projection = ActionProjection("reference", env_name=name)
    memory = WindowMemory(4 if name == "search" else 2)
    env = TransformedEnv(make_env(name, num_groups=1, group_size=2, seed=3, **env_kwargs(name, tmp_path_factory)),
                         Compose(memory, prompt, projection))
    rng = random.Random(0)
    td = env.reset()
    assert td["text", "prompt"][0].count("<think> </think>") == (0 if name in
                                                                  ("numberline", "blackjack", "ezpoints", "points24")
                                                                  else 1)
    rows = []
    for step in range(4):
        responses = []
        for i in range(2):
            actions = [a for a in td["admissible_actions"][i].split("\n") if a]
            action = td["expert_action"][i] or (rng.choice(actions) if actions else "<search>paris</search>")
            responses.append(expert_response(action, fmt) if (step + i) % 3 else "malformed output")
        td["text", "response"] = responses
        projection(td)
        rows += [td[i].clone() for i in range(2) if not td["done"][i]]
        td = step_mdp(env.step(td))
        if td["done"].all():
            break
    assert len(rows) >= 3
    fresh = PromptTransform(tokenizer, prompt.template)
    for row in rows:
        assert fresh.render_row(row) == row["text", "prompt"]
    later = [r for r in rows if int(r["step_count"].reshape(-1)[0]) > 0]
    if name in ("alfworld", "sokoban") and later:
        assert "[Observation 1: '" in later[0]["text", "prompt"]
    if name == "search" and later:
        assert "History:\nStep 1:" in later[0]["text", "prompt"]


def test_reference_prompt_without_memory_is_the_no_history_text(tokenizer):
    env = TransformedEnv(make_env("sokoban", num_groups=1, group_size=1, seed=1),
                         Compose(NoHistory(), PromptTransform(tokenizer, "reference", env_name="sokoban"),
                                 ActionProjection("reference", env_name="sokoban")))
    td = env.reset()
    td["text", "response"] = ["<think>t</think><action>up</action>"]
    td = step_mdp(env.step(td))
    assert "Your current observation is:\n" in td["text", "prompt"][0]
    assert "Prior to this step" not in td["text", "prompt"][0]


def test_reference_prompt_with_a_multi_turn_memory_keeps_its_turns(tokenizer):
    prompt = PromptTransform(tokenizer, "reference", env_name="sokoban")
    env = TransformedEnv(make_env("sokoban", num_groups=1, group_size=1, seed=1),
                         Compose(FullHistory(), prompt, ActionProjection("reference", env_name="sokoban")))
    td = env.reset()
    td["text", "response"] = ["<think>first</think><action>up</action>"]
    td = step_mdp(env.step(td))
    text = td["text", "prompt"][0]
    assert "<think>first</think><action>up</action>" in text  # the earlier turn, as FullHistory keeps it
    assert "Prior to this step, you have already taken 1 step(s)" in text and "[Observation 1:" not in text
    assert PromptTransform(tokenizer, prompt.template).render_row(td[0]) == text


def test_a_mistyped_template_name_fails_at_start(tokenizer):
    with pytest.raises(ValueError, match="no \\{observation\\} field"):
        PromptTransform(tokenizer, "numberlin")


# ------------------------------------------------------------------------------------------ recipes
RECIPES = {
    "alfworld_gigpo": dict(env="alfworld", groups=16, size=8, minibatch=256, entropy=0.001, k=2, warmup=0.0),
    "alfworld_gigpo_7b": dict(env="alfworld", groups=16, size=8, minibatch=256, entropy=0.001, k=2, warmup=0.0),
    "alfworld_grpo": dict(env="alfworld", groups=16, size=8, minibatch=256, entropy=0.001, k=2, warmup=0.0),
    "sokoban_gigpo": dict(env="sokoban", groups=32, size=8, minibatch=64, entropy=0.001, k=2, warmup=0.0),
    "ezpoints_gigpo": dict(env="ezpoints", groups=16, size=8, minibatch=128, entropy=0.001, k=2, warmup=0.0),
    "search_gigpo": dict(env="search", groups=256, size=5, minibatch=512, entropy=0.0, k=4, warmup=0.1),
    "alfworld_hgpo": dict(env="alfworld", groups=16, size=8, minibatch=256, entropy=0.001, k=2, warmup=0.0),
    "alfworld_graphgpo": dict(env="alfworld", groups=16, size=8, minibatch=256, entropy=0.001, k=2, warmup=0.0),
    "sokoban_graphgpo": dict(env="sokoban", groups=32, size=8, minibatch=64, entropy=0.001, k=2, warmup=0.0),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipes_use_the_reference_mode_and_hyper_parameters(recipe):
    cfg = compose_config([f"experiment={recipe}"])
    want = RECIPES[recipe]
    assert cfg.env.name == want["env"] and cfg.env.template == "reference" and cfg.env.action_format == "reference"
    assert (cfg.env.num_groups, cfg.env.group_size) == (want["groups"], want["size"])
    assert cfg.algorithm.minibatch_size == want["minibatch"] and cfg.algorithm.entropy_coef == want["entropy"]
    assert cfg.memory.k == want["k"] and cfg.algorithm.lr_warmup_ratio == want["warmup"]
    assert resolve_format(cfg.env.action_format, cfg.env.name).startswith("reference_")
    if want["env"] == "alfworld":
        assert cfg.env.kwargs["eval_split"] == "valid_seen"


def test_lr_warm_up_is_linear_from_zero():
    from torchrl_agent.trainers.update import scheduled_lr

    cfg = compose_config(["experiment=search_gigpo", "iterations=20", "algorithm.lr=1e-3"])
    lrs = [scheduled_lr(cfg.algorithm, it, cfg.iterations) for it in range(4)]
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 1e-3])  # 10% of 20 iterations = 2 warm-up iterations


def test_cosine_lr_decays_from_lr_after_the_warm_up_to_the_floor_at_the_last_iteration():
    from torchrl_agent.trainers.update import scheduled_lr

    cfg = compose_config(["experiment=search_gigpo", "iterations=12", "algorithm.lr=1e-3",
                          "algorithm.lr_schedule=cosine", "algorithm.min_lr_ratio=0.1"])
    lrs = [scheduled_lr(cfg.algorithm, it, cfg.iterations) for it in range(12)]
    assert lrs[0] == 0.0  # int(10% of 12) = 1 warm-up iteration
    assert lrs[1] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)
    assert lrs[6] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))  # halfway: 5.5e-4
    assert all(a > b for a, b in zip(lrs[1:], lrs[2:]))  # strictly decreasing after the warm-up

"""The prompt budget (``env.max_prompt_tokens``): an observation over it ends its episode before
generation; the default budget holds a long Sokoban episode with full memory."""

from __future__ import annotations

import json
import logging

from torchrl_agent.envs.base import GameState, TextEnv, TextGame
from torchrl_agent.trainers.cli import compose_config


class GrowingGame(TextGame):
    """Each step's observation is 40 words longer than the last (a growing page)."""

    def reset(self, seed):
        self.t = 0
        return GameState(observation="start", task="read")

    def step(self, action):
        self.t += 1
        return GameState(observation=" ".join(["word"] * 40 * self.t), task="read"), 0.0, False, False


def test_an_observation_over_the_budget_ends_the_episode_before_generation(tokenizer, tiny_model, caplog):
    from torchrl.envs import Compose, TransformedEnv

    from torchrl_agent.collectors import StepCollector
    from torchrl_agent.envs.transforms import ActionProjection, FullHistory, PromptTransform
    from torchrl_agent.modules import TransformersPolicy

    budget = 150
    env = TransformedEnv(TextEnv(GrowingGame, num_groups=1, group_size=2, max_steps=10),
                         Compose(FullHistory(), PromptTransform(tokenizer, "default", max_prompt_tokens=budget),
                                 ActionProjection()))
    collector = StepCollector(env, TransformersPolicy(tiny_model, tokenizer, max_new_tokens=4), seed=0)
    with caplog.at_level(logging.WARNING):
        rows = collector.collect()
    prompt_tokens = rows["prompt_tokens"].reshape(-1)
    assert int(prompt_tokens.max()) <= budget  # nothing over the budget was generated for
    steps = rows["step_count"].reshape(-1).tolist()
    assert max(steps) < 9  # the episodes ended early, well before max_steps
    for traj in rows["traj_id"].unique():
        mine = rows["traj_id"].reshape(-1) == traj
        assert rows["truncated"].reshape(-1)[mine].tolist()[-1]  # each episode's last row: truncated
    assert collector.stats["prompt_budget_truncations"] == 2
    assert "over the prompt budget" in caplog.text


def test_sokoban_full_memory_200_steps_stays_within_the_default_budget(tokenizer):
    """The run of the fault report (`env=sokoban memory=full env.max_steps=200`): with the default
    budget every step's prompt stays within it (the oldest records dropped), for all 200 steps."""
    from tensordict import NonTensorStack
    from torchrl.envs.utils import step_mdp

    from torchrl_agent.trainers.builders import build_env, prompt_budget

    cfg = compose_config(["experiment=smoke", "env=sokoban", "memory=full", "env.max_steps=200", "env.num_groups=1",
                          "env.group_size=1"])
    budget = prompt_budget(cfg, tokenizer)
    assert budget == 2048
    env = build_env(cfg, tokenizer)
    td = env.reset()
    lengths = []
    for t in range(200):
        lengths.append(len(tokenizer(td["text", "prompt"][0], add_special_tokens=False)["input_ids"]))
        # a move into a wall, or an invalid action: the room never changes, the transcript grows
        td.set(("text", "response"), NonTensorStack(f"<think>step {t}</think><action>wait</action>"))
        td = env.step(td)
        if td["next", "done"].all():
            break
        td = step_mdp(td, keep_other=True)
    assert len(lengths) == 200
    assert max(lengths) <= budget and max(lengths) > budget - 200  # the budget, not the game, bounds it
    assert not td["next", "prompt_over_budget"].any()
    assert json.loads(td["next", "memory"][0])["dropped"] > 0

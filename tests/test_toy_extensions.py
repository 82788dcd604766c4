"""Adding a memory kind, a rollout engine or an environment (with its prompt and parsing rule) is one
module of one's own (plus a YAML): each toy below is declared in this file, registered from outside
the package, and trains one iteration through the config without any change to the package."""

from __future__ import annotations

import math

import pytest
import torch

from torchrl_agent.envs import GameState, TextEnv, TextGame
from torchrl_agent.envs.registry import ENV_REGISTRY, register_env
from torchrl_agent.envs.transforms import (
    ACTION_FORMATS,
    MEMORY_REGISTRY,
    PROMPT_TEMPLATES,
    MemoryTransform,
    register_format,
    register_template,
)
from torchrl_agent.modules import TransformersPolicy
from torchrl_agent.trainers.cli import compose_config
from torchrl_agent.trainers.engines import ENGINE_REGISTRY, RolloutEngine, register_engine

SMALL = ["iterations=1", "eval_every=0", "env.num_groups=2", "env.group_size=2", "env.eval_episodes=2",
         "env.max_steps=2", "rollout.max_new_tokens=6", "progress=false", "algorithm.lr=1e-3", "threads=1"]


def _train_one_iteration(overrides: list[str], run_dir):
    """A Trainer of the smoke experiment with ``overrides``, trained one iteration; returns it, its
    history's update record, and whether its weights moved."""
    from torchrl_agent.trainers import Trainer

    cfg = compose_config(["experiment=smoke", *SMALL, *overrides, f"run_dir={run_dir}"])
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    record = next(h for h in trainer.history if "loss" in h)
    moved = any(not torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    return trainer, record, moved


# ------------------------------------------------------------------------------ a memory kind
@pytest.fixture
def last_move_memory():
    """``memory.kind=last_move``: the last action only, one line in the template's ``{history}``."""

    class LastMove(MemoryTransform):
        kind = "last_move"  # registers it in MEMORY_REGISTRY
        rendered: list[str] = []

        def update(self, records, record):
            return [record]

        def render(self, records):
            text = f"Last move: {records[-1]['action']}" if records else ""
            LastMove.rendered.append(text)
            return text, []

        @classmethod
        def fills_history(cls, cfg):
            return True

    yield LastMove
    MEMORY_REGISTRY.pop("last_move")


def test_a_toy_memory_kind_trains_through_the_config(last_move_memory, tmp_path):
    trainer, record, moved = _train_one_iteration(["memory.kind=last_move"], tmp_path / "run")
    assert isinstance(trainer.env.transform[0], last_move_memory)
    assert any(t.startswith("Last move: ") for t in last_move_memory.rendered)  # after a step: the line
    assert math.isfinite(record["loss"]) and moved
    # validate reads the registry: the slot check applies to it (numberline_short has no {history})
    with pytest.raises(ValueError, match="memory.kind=last_move: env.template='numberline_short' has no"):
        compose_config(["experiment=smoke", "memory.kind=last_move", "env.template=numberline_short"])


def test_an_unregistered_memory_kind_fails_naming_the_registry():
    with pytest.raises(ValueError, match="memory.kind='last_move': must be one of window, actions"):
        compose_config(["experiment=smoke", "memory.kind=last_move"])


# ------------------------------------------------------------------------------ a rollout engine
class CountingPolicy(TransformersPolicy):
    """The transformers engine, counting the prompts it answers."""

    prompts = 0

    def generate(self, prompts, seeds=None):
        CountingPolicy.prompts += len(prompts)
        return super().generate(prompts, seeds)


@pytest.fixture
def counting_engine():
    def build(cfg, model, tokenizer):
        r = cfg.rollout
        return CountingPolicy(model, tokenizer, max_new_tokens=r.max_new_tokens, temperature=r.temperature)

    register_engine(RolloutEngine("counting", build, shares_weights=True))
    CountingPolicy.prompts = 0
    yield
    ENGINE_REGISTRY.pop("counting")


def test_a_toy_rollout_engine_trains_through_the_config(counting_engine, tmp_path):
    trainer, record, moved = _train_one_iteration(["rollout.engine=counting"], tmp_path / "run")
    assert isinstance(trainer.policy, CountingPolicy) and trainer.rollout_model is trainer.model  # shares the weights
    assert CountingPolicy.prompts >= 4  # 2 groups x 2 episodes, at least one step each
    assert math.isfinite(record["loss"]) and moved


def test_an_unregistered_engine_fails_naming_the_registry():
    with pytest.raises(ValueError, match="rollout.engine='counting': must be one of transformers, vllm"):
        compose_config(["experiment=smoke", "rollout.engine=counting"])


# ------------------------------------------------------------------------------ an environment
class ParityGame(TextGame):
    """Say whether the number is odd or even: one step, reward 1 when right."""

    def reset(self, seed: int) -> GameState:
        self.number = seed % 97
        return GameState(f"The number is {self.number}.", task="Odd or even?", admissible_actions=("odd", "even"),
                         expert_action=("even", "odd")[self.number % 2])

    def step(self, action: str):
        right = action == ("even", "odd")[self.number % 2]
        return GameState("Done."), float(right), True, right


class ParityEnv(TextEnv):
    def __init__(self, max_steps: int = 1, **kwargs):
        super().__init__(ParityGame, max_steps=max_steps, **kwargs)


def parse_parity(response: str) -> tuple[str, bool]:
    """The last ``odd`` or ``even`` of the response (valid), else ``""`` (invalid)."""
    text = response.lower()
    found = max(("odd", "even"), key=text.rfind)
    return (found, True) if text.rfind(found) >= 0 else ("", False)


PARITY_YAML = """\
name: parity
num_groups: 2
group_size: 2
eval_episodes: 2
action_format: parity
"""


@pytest.fixture
def parity_env(tmp_path):
    """``env=parity``: the env, its template (named after it: its default) and its parsing rule,
    registered from here, and ``env/parity.yaml`` in a config folder of one's own."""
    folder = tmp_path / "my_configs"
    (folder / "env").mkdir(parents=True)
    (folder / "env" / "parity.yaml").write_text(PARITY_YAML)
    register_env("parity", ParityEnv)
    register_template("parity", "Parity. {task} {observation}\n{history}")
    register_format("parity", parse_parity)
    yield f"hydra.searchpath=[file://{folder}]"
    for registry in (ENV_REGISTRY, PROMPT_TEMPLATES, ACTION_FORMATS):
        registry.pop("parity")


def test_a_toy_env_with_its_template_and_parsing_rule_trains_through_the_config(parity_env, tmp_path):
    from torchrl_agent.collectors import StepCollector

    trainer, record, moved = _train_one_iteration([parity_env, "env=parity"], tmp_path / "run")
    assert (trainer.cfg.env.name, trainer.cfg.env.action_format) == ("parity", "parity")
    assert math.isfinite(record["loss"]) and moved
    rows = StepCollector(trainer.env, trainer.policy, seed=1).collect()
    assert all("Parity. Odd or even? The number is " in p for p in rows["text", "prompt"])  # its own template
    for response, action, valid in zip(rows["text", "response"], rows["action"], rows["action_valid"].reshape(-1)):
        assert (action, bool(valid)) == parse_parity(response)  # its own parsing rule

"""Every algorithm of torchrl_agent/configs/algorithm/ trains from its config (2 iterations, tiny model, NumberLine)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from torchrl_agent.trainers.algorithms import ALGORITHM_REGISTRY
from torchrl_agent.trainers.cli import compose_config, config_dir, main

TINY = ["experiment=smoke", "iterations=2", "eval_every=0", "env.num_groups=2", "env.group_size=2", "env.eval_episodes=2",
        "env.max_steps=2", "warm_start.steps=0", "rollout.max_new_tokens=6", "progress=false",
        "algorithm.lr=1e-3", "algorithm.minibatch_size=8", "threads=1"]
CONFIGS = sorted(p.stem for p in (config_dir() / "algorithm").glob("*.yaml"))


def test_every_algorithm_has_a_config():
    names = {compose_config(["experiment=smoke", f"algorithm={c}"]).algorithm.name for c in CONFIGS}
    builtin = {name for name, algorithm in ALGORITHM_REGISTRY.items()
               if (algorithm.advantage or algorithm.critic).__module__.startswith("torchrl_agent.")}
    assert builtin and names == builtin  # every registered built-in has a YAML, every YAML a registered algorithm


@pytest.mark.parametrize("config", CONFIGS)
def test_algorithm_trains_two_iterations_from_its_config(config, tmp_path):
    from torchrl_agent.trainers import Trainer

    extra = ["algorithm.max_sampling_tries=3"] if config in ("dapo", "gigpo_dynamic") else []
    cfg = compose_config([*TINY, f"algorithm={config}", f"run_dir={tmp_path}", *extra])
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    summary = trainer.train()
    assert summary["iterations"] == 2 and summary["algorithm"] == cfg.algorithm.name
    records = [h for h in trainer.history if "loss" in h]
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["loss_objective"]) for r in records)
    changed = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "no optimizer step changed the policy"
    if cfg.algorithm.name == "ppo":
        assert all(math.isfinite(r["value_loss"]) for r in records)
        assert trainer.hooks.critic is not None and abs(float(trainer.hooks.critic.model.head.weight.abs().sum())) > 0
    if cfg.algorithm.dynamic_sampling:
        assert all(1 <= r["sampling_tries"] <= 3 for r in records)
    if cfg.algorithm.name == "remax":  # the greedy baseline episodes started from the batch's states
        assert trainer.hooks.baseline.env.base_env.group_seeds == trainer.env.base_env.group_seeds
    if cfg.algorithm.kl_coef > 0:
        assert all("loss_kl" in r for r in records)


def test_kl_in_reward_with_the_adaptive_controller_trains(tmp_path):
    from torchrl_agent.trainers import Trainer

    cfg = compose_config([*TINY, "algorithm=gigpo", "algorithm.kl_in_reward=true", "algorithm.kl_ctrl=adaptive",
                          "algorithm.kl_target=0.01", "algorithm.kl_horizon=10", "algorithm.kl_reward_coef=0.1",
                          "algorithm.kl_coef=0", "algorithm.kl_type=k2", "algorithm.similarity_threshold=0.9",
                          "algorithm.aggregation=seq-mean-token-sum-norm", f"run_dir={tmp_path}"])
    trainer = Trainer(cfg)
    computed = []  # the models whose log-probs were computed
    recompute = trainer.scorer.recompute
    trainer.scorer.recompute = lambda model, rows: computed.append(model) or recompute(model, rows)
    trainer.train()
    records = [h for h in trainer.history if "loss" in h]
    assert all("reward_kl" in r and math.isfinite(r["loss"]) for r in records)
    # the old and the reference log-probs, once per iteration: written into the rows for the penalty and the loss
    assert computed == [trainer.model, trainer.reference] * len(records)
    # the controller moved the coefficient from its start (0.1) after each batch
    assert records[0]["reward_kl_coef"] == pytest.approx(0.1) and trainer.hooks.kl_ctrl.value != 0.1


def test_unknown_algorithm_lists_the_valid_ones(tmp_path, capsys):
    assert main(["train", "experiment=smoke", "algorithm=magic", f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "magic" in err and all(name in err for name in ("grpo", "gigpo", "ppo", "dapo", "gspo"))
    assert main(["train", "experiment=smoke", "algorithm.name=magic", f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.name" in err and all(name in err for name in ALGORITHM_REGISTRY)
    assert main(["train", "experiment=smoke", "algorithm.kl_type=k9", f"run_dir={tmp_path}"]) == 2
    assert "algorithm.kl_type" in capsys.readouterr().err
    assert not list(Path(tmp_path).glob("*.jsonl"))


def test_algorithm_state_round_trips(tmp_path):
    from torchrl_agent.trainers import Trainer

    cfg = compose_config([*TINY, "iterations=1", "algorithm=ppo", "algorithm.kl_in_reward=true",
                          "algorithm.kl_ctrl=adaptive", f"run_dir={tmp_path}"])
    trainer = Trainer(cfg)
    trainer.train()
    state = trainer.hooks.state_dict()
    fresh = Trainer(compose_config([*TINY, "iterations=1", "algorithm=ppo", "algorithm.kl_in_reward=true",
                                    "algorithm.kl_ctrl=adaptive", f"run_dir={tmp_path / 'b'}"]))
    fresh.hooks.load_state_dict(state)
    assert fresh.hooks.kl_ctrl.value == trainer.hooks.kl_ctrl.value != cfg.algorithm.kl_reward_coef
    for a, b in zip(fresh.hooks.critic.model.parameters(), trainer.hooks.critic.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("overrides, needle", [
    (["algorithm.similarity_threshold=0"], "algorithm.similarity_threshold=0.0: must be in (0, 1]"),
    (["algorithm.value_clip=0"], "algorithm.value_clip=0.0: must be > 0"),
    (["algorithm.lmbda=1.5"], "algorithm.lmbda=1.5: must be in [0, 1]"),
    (["algorithm.aggregation=sum"], "algorithm.aggregation='sum': must be one of token-mean"),
    (["memory.kind=everything"], "memory.kind='everything': must be one of window"),
    (["algorithm=grpo_passk", "env.group_size=1"], "env.group_size=1: must be >= 2 for algorithm.name=grpo_passk"),
    (["algorithm=remax", "algorithm.dynamic_sampling=true"], "algorithm.dynamic_sampling is not supported"),
])
def test_the_algorithm_section_is_validated_at_start_naming_the_key(overrides, needle, tmp_path, capsys):
    assert main(["train", "experiment=smoke", *overrides, f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err and needle in err, err

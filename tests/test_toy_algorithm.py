"""Adding an algorithm is one module and one YAML: a toy algorithm, declared in this file, trains one
iteration through the config without any change to the trainer."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from torchrl_agent.objectives import episode_scores
from torchrl_agent.trainers.algorithms import ALGORITHM_REGISTRY, Algorithm, register_algorithm
from torchrl_agent.trainers.cli import compose_config


class BatchMeanAdvantage(TensorDictModuleBase):
    """The toy estimator: ``A = S_row - mean(S)`` over the whole batch (no groups), ``[N, 1]``."""

    in_keys = ["reward", "traj_id", "action_valid"]
    out_keys = ["advantage"]

    def __init__(self, invalid_penalty: float) -> None:
        super().__init__()
        self.invalid_penalty = invalid_penalty
        self.calls = 0

    def forward(self, rows: TensorDictBase) -> TensorDictBase:
        self.calls += 1
        scores = episode_scores(rows["reward"].reshape(-1), rows["traj_id"].reshape(-1),
                                rows.get("action_valid", None), invalid_penalty=self.invalid_penalty)
        rows.set("advantage", (scores - scores.mean()).unsqueeze(-1).to(rows["reward"].dtype))
        return rows


TOY = Algorithm("toy", advantage=lambda cfg: BatchMeanAdvantage(cfg.algorithm.invalid_penalty),
                summary="episode score minus the batch mean")
TOY_YAML = """\
# the toy algorithm: its advantage is registered in Python, its loss settings are here
name: toy
invalid_penalty: 0.2
eps_high: 0.28  # clip-higher
kl_coef: 0.0
"""


@pytest.fixture
def toy_configs(tmp_path):
    """A config folder of one's own holding ``algorithm/toy.yaml`` (composed on top of the shipped
    configs through Hydra's search path), with ``toy`` registered."""
    folder = tmp_path / "my_configs"
    (folder / "algorithm").mkdir(parents=True)
    (folder / "algorithm" / "toy.yaml").write_text(TOY_YAML)
    register_algorithm(TOY)
    yield f"hydra.searchpath=[file://{folder}]"
    ALGORITHM_REGISTRY.pop("toy")


def test_a_toy_algorithm_trains_through_the_config(toy_configs, tmp_path):
    from torchrl_agent.trainers import Trainer

    cfg = compose_config([toy_configs, "experiment=smoke", "algorithm=toy", "iterations=1", "eval_every=0", "env.num_groups=2",
                          "env.group_size=2", "env.eval_episodes=2", "env.max_steps=2", "rollout.max_new_tokens=6",
                          "progress=false", "algorithm.lr=1e-3", "threads=1", f"run_dir={tmp_path / 'run'}"])
    assert (cfg.algorithm.name, cfg.algorithm.invalid_penalty, cfg.algorithm.eps_high) == ("toy", 0.2, 0.28)
    trainer = Trainer(cfg)
    assert isinstance(trainer.advantage, BatchMeanAdvantage) and trainer.loss.eps_high == 0.28
    assert trainer.reference is None  # kl_coef 0 in the toy's YAML: no reference model
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    summary = trainer.train()
    assert summary["algorithm"] == "toy" and trainer.advantage.calls == 1
    record = next(h for h in trainer.history if "loss" in h)
    assert record["iteration"] == 0 and math.isfinite(record["loss"])
    assert any(not torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())


def test_an_unregistered_algorithm_name_fails_at_start_naming_the_key(toy_configs):
    ALGORITHM_REGISTRY.pop("toy")
    try:
        with pytest.raises(ValueError, match="algorithm.name: unknown algorithm 'toy'; valid: .*grpo"):
            compose_config([toy_configs, "experiment=smoke", "algorithm=toy"])
    finally:
        register_algorithm(TOY)

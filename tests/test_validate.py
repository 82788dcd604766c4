"""Every config value checked at start (``trainers/validate.py``), before any model is loaded: a
bad value, a template without its placeholders, a filesystem setting that cannot be used, each
one line naming the key; a group-relative algorithm with groups of one is warned about."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchrl_agent.trainers.cli import compose_config, main

SMALL = ["experiment=smoke", "iterations=2", "eval_every=0", "env.num_groups=2", "env.group_size=2",
         "env.eval_episodes=2", "env.max_steps=3", "rollout.max_new_tokens=6", "progress=false", "warm_start.steps=0"]


def _one_line(err: str) -> str:
    """The program's message: exactly one ``torchrl-agent:`` line and no traceback."""
    lines = [x for x in err.splitlines() if x.startswith("torchrl-agent")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("override, needle", [
    ("iterations=-1", "iterations=-1: must be >= 0"),
    ("algorithm.epochs=0", "algorithm.epochs=0: must be >= 1"),
    ("algorithm.minibatch_size=0", "algorithm.minibatch_size"),
    ("warm_start.batch_size=0", "warm_start.batch_size"),
    ("env.eval_episodes=0", "env.eval_episodes"),
    ("env.num_groups=0", "env.num_groups"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens"),
    ("algorithm.lr=inf", "algorithm.lr=inf: must be finite and > 0"),
    ("algorithm.lr=0", "algorithm.lr"),
    ("algorithm.kl_coef=nan", "algorithm.kl_coef"),
    ("algorithm.target_kl=-0.01", "algorithm.target_kl=-0.01: must be finite and > 0"),  # would stop every update
    ("algorithm.adam_eps=0", "algorithm.adam_eps"),
    ("env.template=hello", "{observation}"),
    ("resume=/nonexistent/last.pt", "resume=/nonexistent/last.pt: no such file"),
    ("model.path=/nonexistent", "model.path=/nonexistent: no such folder"),
    ("iterations=abc", "could not be converted to Integer"),
])
def test_bad_values_fail_at_start_naming_the_key(override, needle, capsys):
    assert main(["train", "experiment=smoke", override]) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err and needle in err, err


@pytest.mark.parametrize("override, needle", [
    ("+env.kwargs.wrong_move_reward=abc",
     "env.kwargs.wrong_move_reward='abc': must be a number (NumberLineEnv's wrong_move_reward defaults to -1.0)"),
    ("++env.kwargs.max_position=9.5", "env.kwargs.max_position=9.5: must be a whole number"),
    ("++env.kwargs.blank_images=1", "env.kwargs.blank_images=1: must be a bool"),
    ("++env.kwargs.observation=3", "env.kwargs.observation=3: must be a string"),
    ("+env.kwargs.max_postion=9", "env.kwargs.max_postion: not a parameter of env numberline (NumberLineEnv); "
                                  "its parameters: max_position, "),
    ("env.name=nope", "env.name: unknown environment 'nope'"),
])
def test_bad_env_kwargs_fail_at_start_naming_the_key(override, needle, capsys):
    """``env.kwargs`` go to the env's constructor (and its base class, through ``**kwargs``): a key
    it does not take, or a value of another type than its default's, is one line naming the key,
    before any model is loaded (they used to fail at the env's construction, or in a worker)."""
    assert main(["train", "experiment=smoke", override]) == 2
    assert needle in _one_line(capsys.readouterr().err)


def test_env_kwargs_of_the_right_types_are_accepted():
    cfg = compose_config(["experiment=smoke", "+env.kwargs.wrong_move_reward=0", "++env.kwargs.max_position=7",
                          "++env.kwargs.blank_images=true", "++env.kwargs.max_distance=null"])
    assert cfg.env.kwargs["wrong_move_reward"] == 0 and cfg.env.kwargs["max_position"] == 7


@pytest.mark.parametrize("env", sorted(p.stem for p in (Path(__file__).parents[1] / "torchrl_agent" / "configs" / "env")
                                       .glob("*.yaml")))
def test_every_env_option_replaces_the_default_experiments_game(env):
    """``torchrl-agent train env=sokoban`` (the docs' commands) on the default experiment (the quick
    start, the long NumberLine): the quick start's game settings are an env option of their own
    (``env/numberline_long.yaml``), so choosing another env leaves none of them behind (its
    NumberLine kwargs once reached SokobanEnv, a TypeError at the env's construction)."""
    cfg = compose_config([f"env={env}"])  # validated: every kwarg is a parameter of the chosen env
    if cfg.env.name != "numberline":
        assert "max_position" not in cfg.env.kwargs and cfg.env.template != "numberline_short"


@pytest.mark.parametrize("memory", [["memory=window"], ["memory=actions"], ["memory=summary"]])
def test_a_memory_without_a_history_slot_in_the_template_fails_at_start(memory, capsys):
    assert main(["train", "experiment=learning_babyai", "env.template=babyai_short", *memory]) == 2
    err = capsys.readouterr().err
    assert "memory.kind=" in err and "env.template='babyai_short' has no {history} slot" in err, err


def test_a_template_with_the_placeholder_is_accepted():
    cfg = compose_config(["experiment=smoke", "env.template='State: {observation}. Act.'", "memory=none"])
    assert cfg.env.template == "State: {observation}. Act."
    cfg = compose_config(["experiment=smoke", "env.template='{history} State: {observation}. Act.'"])  # window memory
    assert cfg.memory.kind == "window"


def test_env_num_workers_is_a_config_key():
    cfg = compose_config(["experiment=smoke", "env.num_workers=2"])
    assert cfg.env.num_workers == 2
    assert main(["train", "experiment=smoke", "env.num_workers=-1"]) == 2


def test_every_filesystem_setting_that_cannot_be_used_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("not a folder")
    assert main(["train", *SMALL, f"run_dir={tmp_path / 'file' / 'run'}"]) == 2
    assert "run_dir=" in (line := _one_line(capsys.readouterr().err)) and "a file, not a folder" in line, line
    monkeypatch.setenv("TORCHRL_AGENT_CACHE", str(tmp_path / "file"))
    assert main(["train", *SMALL, f"run_dir={tmp_path / 'run'}"]) == 2
    assert f"TORCHRL_AGENT_CACHE={tmp_path / 'file'}: is a file" in _one_line(capsys.readouterr().err)
    # a cache that cannot be written (here: sysfs, refused even to root), named by the setting that chose it
    monkeypatch.setenv("TORCHRL_AGENT_CACHE", "/sys/kernel/torchrl_agent")
    assert main(["train", *SMALL, "model.seed=987", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "TORCHRL_AGENT_CACHE=/sys/kernel/torchrl_agent: the cache folder" in _one_line(capsys.readouterr().err)
    monkeypatch.delenv("TORCHRL_AGENT_CACHE")
    monkeypatch.setenv("HOME", "/sys/kernel")
    assert main(["train", *SMALL, "model.seed=987", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "HOME=/sys/kernel (the cache /sys/kernel/.cache/torchrl_agent)" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("algorithm, warned", [("grpo", True), ("gigpo", True), ("rloo", True), ("ppo", False),
                                               ("reinforce_pp", False), ("remax", False)])
def test_group_size_1_with_a_group_relative_algorithm_is_warned_at_start(algorithm, warned, caplog):
    from torchrl_agent.trainers.builders import build_advantage

    build_advantage(compose_config(["experiment=smoke", "env.group_size=1", f"algorithm.name={algorithm}"]))
    assert any("env.group_size=1" in r.getMessage() for r in caplog.records) == warned

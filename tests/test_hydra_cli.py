"""`torchrl-agent train` as a Hydra application: sweeps (`-m`) with the basic, joblib and submitit
(local executor) launchers, one run directory per job, a sweep summary; a user's config folder on
Hydra's search path; every run of a sweep checked before the first one starts."""

from __future__ import annotations

import json

import pytest
import yaml

from torchrl_agent.trainers.cli import compose_config, main

TINY = ["experiment=smoke", "iterations=1", "eval_every=0", "env.num_groups=2", "env.group_size=2",
        "env.max_steps=2", "env.eval_episodes=2", "rollout.max_new_tokens=6", "progress=false", "threads=1"]
LAUNCHERS = {
    "basic": [],
    "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
    # SLURM's launcher with submitit's local executor: each run a process of its own, as on a cluster
    "submitit_local": ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=20"],
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_sweep_runs_each_job_in_its_own_directory(launcher, tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    assert main(["train", "-m", *LAUNCHERS[launcher], *TINY, "seed=0,1", f"hydra.sweep.dir={sweep_dir}"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the sweep summary, last
    assert summary["jobs"] == 2 and summary["failed"] == []
    assert summary == json.loads((sweep_dir / "sweep_summary.json").read_text())
    for job, run in enumerate(summary["runs"]):
        run_dir = sweep_dir / str(job)
        assert run["job"] == job and f"seed={job}" in run["overrides"] and run["exit_code"] == 0
        assert run["run_dir"] == str(run_dir) and run["iterations"] == 1
        assert json.loads((run_dir / "summary.json").read_text())["run_dir"] == str(run_dir)
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert config["seed"] == job and config["run_dir"] == str(run_dir)
        assert [json.loads(x)["iteration"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert (sweep_dir / "multirun.yaml").exists()


def test_a_broken_run_of_a_sweep_fails_before_any_starts(tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    assert main(["train", "-m", *TINY, "algorithm.lr=1e-3,fast", f"hydra.sweep.dir={sweep_dir}"]) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err and "lr" in err
    assert not sweep_dir.exists()
    assert main(["train", "-m", *TINY, "seed=0,1", f"run_dir={tmp_path / 'one'}"]) == 2
    assert "share one run_dir" in capsys.readouterr().err


def test_train_is_the_hydra_app_of_the_shipped_configs(capsys):
    assert main(["train", "--cfg", "job"]) == 0  # Hydra's own flag: the quick start's composed config
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["name"] == "tiny-large" and config["iterations"] == 12


def test_own_config_folder_composes_on_top_of_the_shipped_ones(tmp_path, capsys):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - smoke\niterations: 3\nenv:\n  num_groups: 3\n")
    search = f"hydra.searchpath=[file://{tmp_path}]"
    cfg = compose_config([search, "experiment=mine"])
    assert (cfg.iterations, cfg.env.num_groups, cfg.model.name) == (3, 3, "tiny")  # smoke's model, our keys
    assert main(["config", search, "experiment=mine", "algorithm=gigpo"]) == 0
    assert "name: gigpo" in capsys.readouterr().out

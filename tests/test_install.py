"""The built wheel works outside the source tree: its configs and data files are inside it.

The wheel is built from a copy of the package (so the checkout gets no ``build/`` folder), installed
with ``--no-deps`` into a folder of its own (its dependencies come from the running environment),
and ``torchrl-agent`` runs from an empty directory with only that folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ONE_ITERATION = ["experiment=smoke", "iterations=1", "eval_every=0", "env.num_groups=2", "env.group_size=2",
                 "env.max_steps=2", "rollout.max_new_tokens=6", "progress=false", "threads=1"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site folder, console script) of the wheel installed outside the source tree."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    shutil.copytree(ROOT / "torchrl_agent", src / "torchrl_agent",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # without build isolation when the running environment's setuptools builds wheels itself (>= 70.1):
    # nothing to download
    local = ["--no-build-isolation"] if importlib.util.find_spec("setuptools.command.bdist_wheel") else []
    subprocess.run([*pip, "wheel", "--no-deps", *local, "-w", str(tmp / "dist"), str(src)],
                   check=True, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("torchrl_agent-*.whl")
    site = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, cwd=tmp)
    return wheel, site


def _run(site: Path, cwd: Path, *args: str, configs: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    env.pop("TORCHRL_AGENT_CONFIGS", None)
    if configs is not None:
        env["TORCHRL_AGENT_CONFIGS"] = str(configs)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_wheel_holds_the_configs_and_data(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / "torchrl_agent" / "configs").rglob("*.yaml")}
    assert shipped and shipped <= names, sorted(shipped - names)
    assert "torchrl_agent/configs/experiment/quickstart.yaml" in names
    data = {p.relative_to(ROOT).as_posix() for p in (ROOT / "torchrl_agent").rglob("data/**/*") if p.is_file()}
    assert data <= names, sorted(data - names)


def test_installed_cli_runs_from_an_empty_directory(installed, tmp_path):
    _, site = installed
    where = _run(site, tmp_path, "-c", "import torchrl_agent; print(torchrl_agent.__file__)")
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr  # not the checkout
    script = site / "bin" / "torchrl-agent"
    out = _run(site, tmp_path, str(script), "config")
    assert out.returncode == 0, out.stderr
    assert "name: tiny-large" in out.stdout and "num_groups: 16" in out.stdout  # the quickstart experiment
    out = _run(site, tmp_path, str(script), "train", *ONE_ITERATION)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["iterations"] == 1
    run_dir = tmp_path / summary["run_dir"]
    assert run_dir.is_relative_to(tmp_path / "runs") and (run_dir / "metrics.jsonl").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]  # nothing else written into the directory


def test_configs_env_var_points_elsewhere(installed, tmp_path):
    _, site = installed
    mine = tmp_path / "mine"
    shutil.copytree(ROOT / "torchrl_agent" / "configs", mine)
    (mine / "experiment" / "quickstart.yaml").write_text("# @package _global_\niterations: 7\n")
    empty = tmp_path / "cwd"
    empty.mkdir()
    out = _run(site, empty, str(site / "bin" / "torchrl-agent"), "config", configs=mine)
    assert out.returncode == 0, out.stderr
    assert "iterations: 7" in out.stdout

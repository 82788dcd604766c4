"""Shared fixtures: the tiny model (built once per session, cached on disk) and its tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: The team's shared data (``../shared/data`` beside the checkout; read-only in CI).
SHARED_DATA = Path(os.environ.get("TORCHRL_AGENT_SHARED_DATA",
                                  Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.fixture(scope="session")
def tiny_path():
    from torchrl_agent.models import build_tiny_model

    return build_tiny_model(seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="session")
def tiny_model(tiny_path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_path).eval()


@pytest.fixture(scope="session")
def torchrun_launch(tiny_path, tmp_path_factory):
    """The output folder of one 2-process launch, ``python -m torch.distributed.run --standalone
    --nproc_per_node 2 tests/torchrun_worker.py OUT MODEL`` (gloo on CPU): the FSDP2 steps and the
    Trainer of tests/test_distributed.py, then the colocated vLLM rollout run of
    tests/test_distributed_rollout.py, in one process group (the ranks' imports paid once)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("torchrun")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).with_name("torchrun_worker.py")), str(out), str(tiny_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def finished_run(request, tmp_path_factory):
    """A 3-iteration run of the test module's ``SMALL`` overrides with a checkpoint after every
    iteration (read-only: copy it)."""
    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.cli import compose_config

    run = tmp_path_factory.mktemp("finished") / "run"
    Trainer(compose_config([*request.module.SMALL, "iterations=3", "checkpoint_every=1", f"run_dir={run}"])).train()
    return run

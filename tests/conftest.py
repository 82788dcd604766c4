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

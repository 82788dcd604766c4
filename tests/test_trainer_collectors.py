"""`torchrl-agent train` through each collector of ``collector.kind``: the multi-process collector
(collector processes + one vLLM engine server) trains 2 iterations; the Ray collector's run is in
tests/test_collector_ray.py (on that module's Ray cluster); the default ``step`` collector is the
rest of the suite's."""

from __future__ import annotations

import json

import pytest

from torchrl_agent.trainers.cli import main

SMALL = ["experiment=smoke", "iterations=2", "eval_every=0", "env.num_groups=2", "env.group_size=2",
         "env.eval_episodes=2", "env.max_steps=2", "rollout.max_new_tokens=6", "progress=false", "threads=1"]


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("override, needle", [
    ("collector.kind=threads", "collector.kind"),
    ("collector.num_collectors=3", "collector.num_collectors"),  # more collectors than the 2 groups
    ("collector.max_batches_ahead=-1", "collector.max_batches_ahead"),
    ("collective_timeout_s=0", "collective_timeout_s"),
])
def test_bad_collector_settings_fail_at_start_naming_the_key(override, needle, tmp_path, capsys):
    assert main(["train", *SMALL, "collector.kind=ray", override, f"run_dir={tmp_path}"]) == 2
    assert needle in capsys.readouterr().err


def test_multiprocess_collector_needs_the_vllm_engine(tmp_path, capsys):
    assert main(["train", *SMALL, "collector.kind=multiprocess", f"run_dir={tmp_path}"]) == 2
    assert "rollout.engine=vllm" in capsys.readouterr().err


def test_train_with_the_multiprocess_collector_and_a_vllm_engine_server(tmp_path):
    pytest.importorskip("vllm")
    assert main(["train", *SMALL, "rollout.engine=vllm", "collector.kind=multiprocess", "collector.num_collectors=2",
                 f"run_dir={tmp_path}"]) == 0
    records = _records(tmp_path)
    trained = [r for r in records if "loss" in r]
    assert [r["iteration"] for r in trained] == [0, 1] and all(r["skipped_steps"] == 0 for r in trained)
    assert all(r["episodes"] == 4 for r in trained)  # both collector processes' groups
    # iteration 1 was sampled by the engine server after the first weight sync
    assert trained[1]["logprob_diff_max"] < 1e-4 and trained[1]["weight_sync_s"] > 0

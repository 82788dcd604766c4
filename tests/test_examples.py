"""The examples run as scripts, end to end, and print what they promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)


def test_compose_rollout_steps_an_episode_and_replays_a_prompt(tiny_path):  # tiny_path: the model is built
    result = run_example("compose_rollout.py", "--steps", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    # the random tiny model never reaches the target: the episode runs to the 3-step limit
    assert re.findall(r"^===== step (\d+)$", out, re.M) == ["1", "2", "3"]
    assert out.count("--- prompt\n<|im_start|>user") == 3 and out.count("--- response") == 3
    assert len(re.findall(r"^--- action .* reward [+-]\d\.\d, done (True|False)$", out, re.M)) == 3
    assert "Your last 2 steps:" in out  # the window memory reached the third prompt
    assert "===== episode over after 3 steps" in out
    assert out.rstrip().endswith("replay of step 3: identical")


def test_compose_rollout_rejects_a_bad_step_count():
    result = run_example("compose_rollout.py", "--steps", "0")
    assert result.returncode == 2 and "--steps must be >= 1" in result.stderr

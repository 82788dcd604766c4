"""The examples run as scripts (``__main__``, their command line, their exit code), end to end, and
print what they promise. They run in this process (``runpy``): the libraries they import are loaded
already, so each takes a second rather than a fresh interpreter's imports."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str, capsys, monkeypatch) -> subprocess.CompletedProcess:
    """``python examples/NAME ARGS`` run as ``__main__``: its exit code, stdout and stderr."""
    script = ROOT / "examples" / name
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the checkout first on its path
    try:
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out = capsys.readouterr()
    return subprocess.CompletedProcess(sys.argv, code, out.out, out.err)


def test_compose_rollout_steps_an_episode_and_replays_a_prompt(tiny_path, capsys, monkeypatch):  # the model is built
    result = run_example("compose_rollout.py", "--steps", "3", capsys=capsys, monkeypatch=monkeypatch)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    # the random tiny model never reaches the target: the episode runs to the 3-step limit
    assert re.findall(r"^===== step (\d+)$", out, re.M) == ["1", "2", "3"]
    assert out.count("--- prompt\n<|im_start|>user") == 3 and out.count("--- response") == 3
    assert len(re.findall(r"^--- action .* reward [+-]\d\.\d, done (True|False)$", out, re.M)) == 3
    assert "Your last 2 steps:" in out  # the window memory reached the third prompt
    assert "===== episode over after 3 steps" in out
    assert out.rstrip().endswith("replay of step 3: identical")


def test_compose_rollout_rejects_a_bad_step_count(capsys, monkeypatch):
    result = run_example("compose_rollout.py", "--steps", "0", capsys=capsys, monkeypatch=monkeypatch)
    assert result.returncode == 2 and "--steps must be >= 1" in result.stderr

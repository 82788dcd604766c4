"""The code blocks of README.md and of the docs site (docs/**/*.md) run as written.

Python blocks run in-process. Bash blocks run in a scratch directory (``torchrl-agent`` and
``.venv/bin/...`` resolve to this environment's). Blocks listed in ``NOT_RUN`` with the reason (by
their first line) are not run: every listed block must exist, so the list cannot go stale, and the
reason names the test that runs the same calls. Output
blocks (```text or a fence with no language) are not code. Any other language fails the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
OUTPUT = {"", "text", "json", "yaml"}


def _blocks(language: str) -> list[tuple[str, int, str]]:
    """(page relative to the repository, index of the block on its page, code) of one language; a
    block repeated on another page (the README's examples) is run once, where it first appears."""
    found, seen = [], set()
    for page in PAGES:
        for index, match in enumerate(FENCE.finditer(page.read_text())):
            if match.group(1) == language and match.group(2) not in seen:
                seen.add(match.group(2))
                found.append((page.relative_to(ROOT).as_posix(), index, match.group(2)))
    return found


#: Blocks that are not run, by first line, and why.
NOT_RUN = {
    "# two collector processes over one vLLM engine server, in TorchRL's collector loop":
        "an engine server and two collector processes (about a minute on 2 cores); "
        "tests/test_collector_multiprocess.py runs the same constructor, loop and weight update",
    "# two Ray actors with a transformers engine each, in TorchRL's collector loop":
        "a Ray cluster and two actors; tests/test_collector_ray.py runs the same constructor, loop and weight update",
    "torchrl-agent train -m experiment=smoke iterations=1 env.num_groups=2 env.group_size=2 env.max_steps=2 env.eval_episodes=2 progress=false seed=0,1":
        "tests/test_hydra_cli.py runs this sweep (the basic launcher, seed=0,1) and checks its run folders",
    "make quickstart   # .venv with the core install (CPU torch), then RL on NumberLine":
        "creates a venv and trains for minutes; `make quickstart` is timed by hand (docs/install.md)",
    ".venv/bin/torchrl-agent train algorithm=gigpo env.num_groups=8 iterations=20":
        "three full runs (minutes each); the CLI is run by the configs page's blocks and tests/test_trainer.py",
    "make test": "the whole suite: this test is part of it",
    "git clone <this repository> /tmp/qs && cd /tmp/qs && time make quickstart   # until its first `metrics` line":
        "a fresh clone's venv and the quick start, timed by hand (docs/install.md)",
    "pip install -c constraints-cpu.txt -e .                        # core: quick start, light games, transformers engine":
        "installs into the running environment (make test installs every extra)",
    "pip install -c constraints-cpu.txt -e .                    # core: the quick start and the light games":
        "installs into the running environment (make test installs every extra)",
    "torchrl-agent train -m experiment=alfworld_gigpo algorithm=grpo,gigpo seed=0,1,2 \\":
        "needs a SLURM cluster; tests/test_hydra_cli.py runs the submitit launcher's local executor",
    ".venv/bin/python benchmarks/collector_throughput.py --workload alfworld --num-groups 8 --group-size 4 \\":
        "a 12-minute benchmark; its figures are in the page",
    "ray start --head --port=6379              # on the head node": "needs several machines",
    ".venv/bin/python benchmarks/learning.py --plot docs/learning_curves.png     # numberline + babyai, seeds 0-9 x {grpo, gigpo}":
        "a benchmark of hours on 2 cores; tests/test_learning.py runs its --quick form",
    "torchrl-agent train collector.kind=step           # default: the trainer's process(es); under torchrun every rank its groups":
        "four full quick-start runs; tests/test_trainer_collectors.py and tests/test_collector_ray.py train with each collector kind",
    "torchrun --standalone --nproc_per_node 2 -m torchrl_agent.trainers.cli train experiment=smoke \\":
        "two ranks with a vLLM engine each (minutes on 2 cores); tests/test_distributed_rollout.py runs it",
    ".venv/bin/torchrl-agent train env=sokoban env.template=reference env.action_format=reference":
        "a full Sokoban run (minutes); tests/test_reference_mode.py checks the reference mode",
    "python -m pytest -q tests/test_layers.py": "a test of the suite, run by the suite itself",
    ".venv/bin/python benchmarks/update_diagnosis.py --seeds 11895 63457 91689 12975 --set algorithm.max_kl=null --out runs/diag_base":
        "four quick-start runs (minutes each); tests/test_learning.py runs its trainer on one update",
    'python my_train.py "hydra.searchpath=[file://$PWD/my_configs]" experiment=smoke algorithm=toy':
        "the reader's own script; tests/test_toy_algorithm.py trains the same toy algorithm",
    "python benchmarks/chaos.py --iterations 30 --schedule mixed --seed 0":
        "30-iteration chaos benchmarks (many trainer launches); tests/test_run_dir.py runs the short one",
}
PYTHON = [block for block in _blocks("python") if block[2].splitlines()[0] not in NOT_RUN]
BASH = _blocks("bash")
RUN = [block for block in BASH if block[2].splitlines()[0] not in NOT_RUN]  # the listed ones are not tests


def test_pages_have_their_examples():
    assert sum(page == "README.md" for page, _, _ in PYTHON) >= 3
    assert len(PYTHON) >= 8 and len(RUN) >= 2


def test_every_code_block_is_python_bash_or_output():
    for page in PAGES:
        for match in FENCE.finditer(page.read_text()):
            assert match.group(1) in OUTPUT | {"python", "bash"}, (page.name, match.group(1))


def test_not_run_list_names_existing_blocks():
    first_lines = {code.splitlines()[0] for _, _, code in [*_blocks("python"), *BASH]}
    assert set(NOT_RUN) <= first_lines, sorted(set(NOT_RUN) - first_lines)


@pytest.mark.parametrize("page, index, code", PYTHON, ids=[f"{p}#{i}" for p, i, _ in PYTHON])
def test_python_block_runs(page, index, code, tiny_path):
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(code, f"{page} block {index}", "exec"), namespace)


@pytest.mark.parametrize("page, index, code", RUN, ids=[f"{p}#{i}" for p, i, _ in RUN])
def test_bash_block_runs(page, index, code, tmp_path):
    bin_dir = Path(sys.executable).parent
    (tmp_path / ".venv").symlink_to(bin_dir.parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=1800)
    assert out.returncode == 0, f"{page} block {index}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"

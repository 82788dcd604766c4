"""A run saved on 2 ranks resumes on 1 and on 4 ranks and continues as the uninterrupted run.

The Trainer under ``torchrun`` (gloo on CPU, a vLLM engine per rank, the smoke experiment with a
high learning rate so that every update moves the weights) writes sharded checkpoints
(``torch.distributed.checkpoint``, each rank its own shards) after every iteration:

1. ``uninterrupted``: ``torchrun --nproc_per_node 2 ... train iterations=3 checkpoint_every=1``;
2. for each N of ``--resume-ranks``: a copy of that run folder, resumed from its iteration-0
   checkpoint on N ranks (``resume=<copy>/checkpoints/iteration_00000.pt``; N = 1 without torchrun),
   which runs iterations 1 and 2 and the final evaluation again.

Why the continuation can be identical: the collector samples every request from its own seed (vLLM's
``request_seed``) and gathers the rows in the single-process order whatever the number of engines,
and each rank's loss is scaled so that the summed gradient is the single-process one
(docs/distributed.md). What differs with the world size is the order of floating-point sums.

Measured per resumed run: for iterations 1, 2 and the final evaluation, the largest absolute
difference of every numeric metric against the uninterrupted run (timings, throughputs and the
per-engine metrics left out),
the metric where it is largest, and ``identical_rows``: the generated tokens of the two runs' rollouts
were the same (the ``generated_tokens`` and ``episode_length`` metrics equal). Prints one JSON object
as its LAST line::

    python benchmarks/resume_world_size.py [--resume-ranks 1 4] [--out runs/resume_world_size]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ["experiment=smoke", "rollout.engine=vllm", "device=cpu", "seed=5", "iterations=3", "checkpoint_every=1",
       "warm_start.steps=20", "warm_start.episodes=8",  # a policy that plays valid moves: metrics that are not all 0
       "eval_every=1", "env.num_groups=4", "env.group_size=2", "env.eval_episodes=4", "env.max_steps=3",
       "rollout.max_new_tokens=8", "algorithm.lr=1e-2", "algorithm.kl_coef=0.05", "algorithm.micro_batch_tokens=64",
       "progress=false"]
#: metrics that measure the machine, not the run
TIMING = ("_s", "per_s", "tokens_per_s", "seconds", "rss", "memory")


def launch(ranks: int, overrides: list[str], log: Path) -> float:
    """``torchrl-agent train OVERRIDES`` on ``ranks`` processes (torchrun for more than one); seconds."""
    cmd = [sys.executable, "-m", "torchrl_agent.trainers.cli", "train", *overrides]
    if ranks > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if code:
        raise SystemExit(f"{' '.join(cmd)} exited with {code}; its log: {log}")
    return time.perf_counter() - t


def records(run_dir: Path) -> dict[int, dict]:
    return {r["iteration"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def compare(resumed: dict[int, dict], clean: dict[int, dict], iterations: list[int]) -> dict:
    """The largest absolute difference of the numeric, non-timing metrics over ``iterations``."""
    worst, where, missing = 0.0, None, []
    for it in iterations:
        for key, value in clean[it].items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or key.endswith(TIMING) or "/engine" in key:
                continue  # per-engine metrics (logprob_diff_max/engineK) exist per world size
            if key not in resumed.get(it, {}):
                missing.append(f"{it}:{key}")
                continue
            diff = abs(float(resumed[it][key]) - float(value))
            if diff > worst or where is None:
                worst, where = max(worst, diff), f"iteration {it}: {key}"
    same_rows = all(resumed[it].get(k) == clean[it].get(k) for it in iterations
                    for k in ("generated_tokens", "episode_length") if k in clean[it])
    return {"max_abs_diff": worst, "where": where, "missing": missing, "identical_rows": same_rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resume-ranks", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out", default="runs/resume_world_size")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    clean_dir = out / "uninterrupted"
    result: dict = {"saved_on_ranks": 2, "seconds": {}}
    result["seconds"]["uninterrupted_2"] = round(launch(2, [*RUN, f"run_dir={clean_dir}"], out / "uninterrupted.log"), 1)
    clean = records(clean_dir)
    check = [i for i in sorted(clean) if i >= 1]
    shards = (clean_dir / "checkpoints" / "iteration_00000.shards").is_dir()
    result["checkpoint_sharded"] = shards
    result["resumed"] = {}
    for n in args.resume_ranks:
        copy = out / f"resumed_on_{n}"
        shutil.copytree(clean_dir, copy, ignore=shutil.ignore_patterns(".lock"))
        start = copy / "checkpoints" / "iteration_00000.pt"
        seconds = launch(n, [*RUN, f"run_dir={copy}", f"resume={start}"], out / f"resumed_on_{n}.log")
        result["seconds"][f"resumed_{n}"] = round(seconds, 1)
        log = (out / f"resumed_on_{n}.log").read_text(errors="replace")
        result["resumed"][str(n)] = {"resumed_from_iteration_0": "resumed from" in log and "at iteration 1" in log,
                                     **compare(records(copy), clean, check)}
    result["iterations_compared"] = check
    result["all_within_1e-4"] = all(r["max_abs_diff"] <= 1e-4 and not r["missing"] and r["resumed_from_iteration_0"]
                                    for r in result["resumed"].values())
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()

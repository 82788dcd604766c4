"""GiGPO versus GRPO on the quick-start task (NumberLine, the tiny model), over several seeds.

Each run is the quick-start experiment composed with :func:`compose_config` and trained with
:meth:`Trainer.train`, with a *short* supervised warm start (``--warm-steps`` 60 instead of the
quick start's 200, on ``--warm-episodes`` 64 expert episodes instead of 256) so that RL has room
to improve, then ``--iterations`` RL iterations at ``--lr`` (default 1e-4: at the quick start's
2e-5, 6 iterations left the held-out success unchanged to the last game) with the quick start's
other settings (4 groups x 4, no KL), with a held-out evaluation every ``--eval-every``
iterations on a fixed panel of ``--eval-episodes`` held-out games. The only override that differs
between the two methods is ``algorithm=gigpo|grpo``; the same seeds (model initialisation, warm
start, collection, panel) are used for both.

Reported per method (mean and population std over seeds, and per seed): the held-out success after
the warm start (``eval_success_start``, the curve's point at iteration 0), the final held-out
success, the gain, the number of RL iterations until the held-out success first reaches
``--threshold`` (``null`` if never; 0 if the warm start alone reaches it), the curves and the wall
time. The curve points are ``(iteration, success)``: ``0`` is the warm-started model, ``iterations``
the final one.

The warm start is run once per seed (exactly as ``Trainer.warm_start`` does it) and saved as a
model folder that both methods start from (``model.path=``, ``warm_start.steps=0``), so the two
methods of a seed start from the very same weights. Runs are separate processes, ``--jobs`` at a
time with ``--threads`` torch threads each (the two methods of a seed run side by side, under
the same load).

Prints one JSON object as the LAST line::

    python benchmarks/gigpo_vs_grpo.py [--seeds 0 1 2] [--iterations 20] [--lr 1e-4] [--warm-steps 60]
                                       [--eval-episodes 32] [--eval-every 4] [--threshold 0.9]
                                       [--jobs 2] [--threads 1] [--plot curves.png] [--quick]

``--quick`` is a smoke variant (1 seed, 1 iteration, 8 panel games, 10 warm-start steps on 16 episodes).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from torchrl_agent.trainers.cli import compose_config  # noqa: E402
from torchrl_agent.trainers.trainer import Trainer  # noqa: E402

METHODS = ("gigpo", "grpo")


def iterations_to(curve: list[tuple[int, float]], threshold: float) -> int | None:
    """The first RL iteration count after which held-out success >= threshold (``None`` if never).

    Point ``(it, s)`` is measured after ``it`` RL iterations (``it = 0``: after the warm start
    only); a point ``it = -1`` (the untrained model) is ignored."""
    for it, success in curve:
        if it >= 0 and success >= threshold:
            return int(it)
    return None


def warm_start_model(seed: int, args, root: str) -> str:
    """The tiny model after the supervised warm start of seed ``seed`` (exactly ``Trainer.warm_start``),
    saved as a Hugging Face folder that both methods start from."""
    import torch

    from torchrl_agent.models import load_model
    from torchrl_agent.modules import ResponseLogProbs
    from torchrl_agent.trainers.warm_start import expert_rows, supervised_step

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = compose_config(["experiment=smoke", f"seed={seed}", f"warm_start.steps={args.warm_steps}",
                          f"warm_start.episodes={args.warm_episodes}", "progress=false"])
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    model.train()
    w = cfg.warm_start
    if w.steps:
        rows = expert_rows(cfg, tokenizer, episodes=w.episodes)
        actor = ResponseLogProbs(model, tokenizer.pad_token_id, temperature=cfg.rollout.temperature)
        optimizer = torch.optim.AdamW(model.parameters(), lr=w.lr)
        generator = torch.Generator().manual_seed(cfg.seed)
        for _ in range(w.steps):
            idx = torch.randint(rows.batch_size[0], (w.batch_size,), generator=generator)
            supervised_step(actor, optimizer, rows[idx.tolist()])
    path = os.path.join(root, f"warm_seed{seed}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_one(method: str, seed: int, model_dir: str, args, root: str) -> dict:
    overrides = [
        f"algorithm={method}", f"seed={seed}", f"iterations={args.iterations}", f"eval_every={args.eval_every}",
        f"model.path={model_dir}", "warm_start.steps=0", f"env.eval_episodes={args.eval_episodes}",
        f"algorithm.lr={args.lr}", "progress=false", f"run_dir={os.path.join(root, f'{method}_seed{seed}')}",
    ]
    if args.threads:
        overrides.append(f"threads={args.threads}")
    cfg = compose_config(overrides)
    t0 = time.perf_counter()
    summary = Trainer(cfg).train()
    wall = time.perf_counter() - t0
    curve = [(int(it), float(s)) for it, s in summary["eval_curve"]]
    start = curve[0][1]
    run = {
        "method": method, "seed": seed, "curve": curve,
        "eval_success_start": start, "eval_success_final": curve[-1][1], "gain": curve[-1][1] - start,
        "iterations_to_threshold": iterations_to(curve, args.threshold),
        "iterations_to": {str(t): iterations_to(curve, t) for t in args.extra_thresholds}, "wall_s": round(wall, 1),
        "train_success_last": summary.get("train_success_last"),
    }
    print(f"run {method} seed={seed}: " + json.dumps(run), file=sys.stderr, flush=True)
    return run


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0}


def aggregate(runs: list[dict]) -> dict:
    reached = [r["iterations_to_threshold"] for r in runs]
    hit = [r for r in reached if r is not None]
    # the mean curve over seeds at the iterations every seed evaluated
    common = sorted(set.intersection(*(set(it for it, _ in r["curve"]) for r in runs)))
    mean_curve = [(it, statistics.fmean(dict(r["curve"])[it] for r in runs)) for it in common]
    return {
        "eval_success_start": mean_std([r["eval_success_start"] for r in runs]),
        "eval_success_final": mean_std([r["eval_success_final"] for r in runs]),
        "gain": mean_std([r["gain"] for r in runs]),
        "iterations_to_threshold": reached,
        "reached_threshold": f"{len(hit)}/{len(runs)}",
        "iterations_to": {t: [r["iterations_to"][t] for r in runs] for t in runs[0]["iterations_to"]},
        "iterations_to_threshold_mean_of_reached": statistics.fmean(hit) if hit else None,
        "mean_curve": mean_curve,
        "wall_s": mean_std([r["wall_s"] for r in runs]),
        "per_seed": runs,
    }


def plot(results: dict, path: str, threshold: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for method, res in results.items():
        its = [it for it, _ in res["mean_curve"]]
        mean = [s for _, s in res["mean_curve"]]
        line, = ax.plot(its, mean, marker="o", label=f"{method} (mean of {len(res['per_seed'])} seeds)")
        for run in res["per_seed"]:
            ax.plot(*zip(*run["curve"]), color=line.get_color(), alpha=0.25, linewidth=0.8)
    ax.axhline(threshold, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("RL iteration (0: after the warm start)")
    ax.set_ylabel("held-out success")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("NumberLine, tiny model: GiGPO vs GRPO")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-4, help="RL learning rate (the quick start's: 2e-5)")
    parser.add_argument("--warm-steps", type=int, default=60)
    parser.add_argument("--warm-episodes", type=int, default=64, help="expert episodes of the warm start")
    parser.add_argument("--eval-episodes", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--extra-thresholds", type=float, nargs="*", default=[0.8, 0.9],
                        help="also report iterations to reach these")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (processes)")
    parser.add_argument("--plot", default=None, help="write a PNG of the mean curves here")
    parser.add_argument("--quick", action="store_true", help="smoke variant: 1 seed, 1 iteration, small panel")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.iterations, args.eval_episodes, args.warm_steps = args.seeds[:1], 1, 8, 10
        args.warm_episodes = 16
    positive = (args.iterations, args.eval_every, args.eval_episodes, args.jobs, args.warm_episodes)
    if min(positive) < 1 or args.warm_steps < 0:
        parser.error("--iterations, --eval-every, --eval-episodes, --jobs and --warm-episodes must be >= 1, "
                     "--warm-steps >= 0")
    t0 = time.perf_counter()
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory(prefix="gigpo_vs_grpo_") as root:
        # runs are independent processes; --jobs of them at a time (the machine's cores are few)
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
            models = dict(zip(args.seeds, pool.map(warm_start_model, args.seeds, [args] * len(args.seeds),
                                                   [root] * len(args.seeds))))
            futures = [pool.submit(run_one, method, seed, models[seed], args, root)
                       for seed in args.seeds for method in METHODS]
            for future in futures:
                run = future.result()
                runs[run["method"]].append(run)
    results = {m: aggregate(r) for m, r in runs.items()}
    if args.plot:
        plot(results, args.plot, args.threshold)
    out = {
        "benchmark": "gigpo_vs_grpo", "env": "numberline", "model": "tiny",
        "seeds": args.seeds, "iterations": args.iterations, "lr": args.lr,
        "jobs": args.jobs, "threads": args.threads, "warm_start_steps": args.warm_steps,
        "warm_start_episodes": args.warm_episodes,
        "eval_episodes": args.eval_episodes, "eval_every": args.eval_every, "threshold": args.threshold,
        "quick": args.quick,
        "final_success_gigpo_minus_grpo": (results["gigpo"]["eval_success_final"]["mean"]
                                           - results["grpo"]["eval_success_final"]["mean"]),
        "methods": results, "plot": args.plot, "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()

"""FSDP2 training smoke and throughput: a few collect -> advantage -> clipped-loss iterations.

Launched by ``benchmarks/gpu_smoke.sh`` (``torchrun --standalone --nproc_per_node N``; plain
``python benchmarks/gpu_smoke.py`` runs it as one process without a process group). Per iteration:

- rank 0 collects a batch of episodes with the transformers engine on its own rollout copy of the
  model (bf16 on CUDA) and computes GRPO advantages; the rows are broadcast to every rank;
- every rank recomputes the old log-probs (no grad) with the FSDP2-sharded training model, then
  takes clipped-loss AdamW steps on its share of each mini-batch (``shard_indices``; loss scaled by
  ``distributed_loss_scale``: gradients equal the single-process ones);
- the full weights are gathered on rank 0 (``full_state_dict``) and loaded into the rollout copy
  (weight sync, as for a vLLM engine).

Measured (iterations after the first, the warm-up, when there are several):

- ``gen_tokens_per_s``: generated tokens / time inside the engine's ``generate``;
  ``collect_tokens_per_s``: the same over the whole collection (environments and prompts included);
- ``train_tokens_per_s``: tokens (prompt + response, no padding) through the clipped-loss
  forward+backward, summed over ranks / update time (old log-prob recompute included in the time);
- ``mfu``: ``(6 * P * train_tokens + 2 * P * recompute_tokens) / update_time / (world * peak)``, ``P``
  the parameter count (tied embeddings counted once; attention-score FLOPs left out, so a lower
  bound). ``peak`` = ``--peak-tflops`` (default on CUDA: 989 TFLOP/s, an H100/H200 SXM's dense
  bf16 peak); on CPU ``mfu`` is null unless ``--peak-tflops`` is given.

Prints one line per iteration (rank 0), then one JSON object as the LAST line::

    torchrun --standalone --nproc_per_node 1 benchmarks/gpu_smoke.py --model smollm2-135m --iterations 4
    python benchmarks/gpu_smoke.py --cpu            # tiny sizes, for a check without a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tensordict import TensorDict  # noqa: E402

from torchrl_agent.collectors import StepCollector  # noqa: E402
from torchrl_agent.models import model_path  # noqa: E402
from torchrl_agent.modules import ResponseLogProbs, TransformersPolicy  # noqa: E402
from torchrl_agent.objectives import ClipPolicyLoss  # noqa: E402
from torchrl_agent.trainers.config import TrainConfig  # noqa: E402
from torchrl_agent.trainers.distributed import (  # noqa: E402
    broadcast_object,
    cleanup,
    clip_grad_norm,
    distributed_loss_scale,
    full_state_dict,
    init_distributed,
    is_distributed,
    is_main_process,
    reduce_mean,
    shard_indices,
    shard_model,
)
from torchrl_agent.trainers.trainer import build_advantage, build_env  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0


class TimedPolicy(TransformersPolicy):
    """The transformers engine with its tensors made on ``device`` and the time in ``generate`` counted."""

    def __init__(self, *args, device: torch.device, **kwargs):
        super().__init__(*args, **kwargs)
        self.device, self.seconds, self.tokens = device, 0.0, 0

    def generate(self, prompts):
        _sync(self.device)
        t0 = time.perf_counter()
        with torch.device(self.device):
            out = super().generate(prompts)
        _sync(self.device)
        self.seconds += time.perf_counter() - t0
        self.tokens += sum(len(g.response_ids) for g in out)
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pad(values: list[torch.Tensor], width: int, device) -> torch.Tensor:
    out = torch.zeros(len(values), width, device=device)
    for i, v in enumerate(values):
        out[i, : len(v)] = v[:width]
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="force CPU (gloo); default: CUDA when available")
    p.add_argument("--model", default="tiny", help="tiny | smollm2-135m | a local Hugging Face folder")
    p.add_argument("--env", default="numberline")
    p.add_argument("--iterations", type=int, default=None, help="default: 4 on CUDA, 2 on CPU")
    p.add_argument("--groups", type=int, default=None, help="groups per batch (default: 16 CUDA, 2 CPU)")
    p.add_argument("--group-size", type=int, default=None, help="default: 8 CUDA, 2 CPU")
    p.add_argument("--max-steps", type=int, default=None, help="episode length cap (default: 6 CUDA, 2 CPU)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 64 CUDA, 8 CPU")
    p.add_argument("--minibatch-size", type=int, default=None, help="rows per step (default: 64 CUDA, 4 CPU)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--dtype", default=None, help="compute dtype: bfloat16 (CUDA default) | float32 (CPU default)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help=f"peak FLOP/s per device for MFU, in TFLOP/s (CUDA default {H200_BF16_DENSE_TFLOPS})")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("iterations", "groups", "group_size", "max_steps", "max_new_tokens", "minibatch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, world, device = init_distributed("cpu" if args.cpu else None)
    cuda = device.type == "cuda"
    big = cuda  # GPU sizes vs tiny CPU sizes

    def pick(value, gpu, cpu):
        return value if value is not None else (gpu if big else cpu)

    iterations = pick(args.iterations, 4, 2)
    dtype = getattr(torch, pick(args.dtype, "bfloat16", "float32"), None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"--dtype: unknown dtype {args.dtype!r}")
    peak = args.peak_tflops if args.peak_tflops is not None else (H200_BF16_DENSE_TFLOPS if cuda else None)
    torch.manual_seed(args.seed)

    cfg = TrainConfig()
    cfg.seed = args.seed
    cfg.env.name = args.env
    cfg.env.num_groups = pick(args.groups, 16, 2)
    cfg.env.group_size = pick(args.group_size, 8, 2)
    cfg.env.max_steps = pick(args.max_steps, 6, 2)
    cfg.rollout.max_new_tokens = pick(args.max_new_tokens, 64, 8)
    cfg.algorithm.minibatch_size = pick(args.minibatch_size, 64, 4)
    cfg.algorithm.lr = args.lr
    cfg.algorithm.kl_coef = 0.0
    if os.path.isdir(args.model):
        cfg.model.path = args.model
    else:
        cfg.model.name = args.model
    a = cfg.algorithm

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(cfg.model) if is_main_process() else None
    path = broadcast_object(path)  # rank 0 builds the tiny model once; the others read its folder
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    # the training model: fp32 master weights, sharded; bf16 compute on CUDA
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).train()
    n_params = sum(p.numel() for p in model.parameters())  # shared (tied) parameters counted once
    mp_policy = None
    if dtype != torch.float32:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    model = shard_model(model, mp_policy=mp_policy)
    sharded = is_distributed()
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    actor = ResponseLogProbs(model, tokenizer.pad_token_id, temperature=cfg.rollout.temperature)
    loss_module = ClipPolicyLoss(eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip,
                                 aggregation=a.aggregation, kl_coef=0.0, entropy_coef=a.entropy_coef)
    autocast = (torch.autocast("cuda", dtype=dtype) if cuda and dtype != torch.float32 and not sharded
                else contextlib.nullcontext())  # without FSDP2 (plain python launch), autocast does bf16

    # the rollout engine: rank 0's own copy (as a vLLM engine would be), synced after each update
    collector = advantage = policy = None
    if is_main_process():
        rollout_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        policy = TimedPolicy(rollout_model, tokenizer, max_new_tokens=cfg.rollout.max_new_tokens,
                             temperature=cfg.rollout.temperature, batch_size=cfg.rollout.batch_size, device=device)
        collector = StepCollector(build_env(cfg, tokenizer), policy, seed=cfg.seed, progress=False)
        advantage = build_advantage(cfg)

    records = []
    for it in range(iterations):
        # ---- collect (rank 0), share the rows
        t0 = time.perf_counter()
        gen_s0, gen_tok0 = (policy.seconds, policy.tokens) if policy is not None else (0.0, 0)
        rows = advantage(collector.collect()) if is_main_process() else None
        collect_s = time.perf_counter() - t0
        rows = broadcast_object(rows)
        n = rows.batch_size[0]

        # ---- update (every rank)
        _sync(device)
        t1 = time.perf_counter()
        with torch.no_grad(), torch.device(device), autocast:
            old = []
            for start in range(0, n, a.minibatch_size):
                part = actor(rows[start:start + a.minibatch_size])
                old += [lp[: int(m)] for lp, m in zip(part["log_prob"], part["mask"].sum(-1))]
        lengths = (rows["prompt_tokens"].reshape(-1) + rows["response_tokens"].reshape(-1)).tolist()
        adv = rows["advantage"].reshape(-1).float()
        order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed * 7919 + it))
        trained_tokens, losses_seen, norms = 0, [], []
        for start in range(0, n, a.minibatch_size):
            local, active = shard_indices(order[start:start + a.minibatch_size])
            with torch.device(device), autocast:
                mb = actor(rows[local])
                width = mb["log_prob"].shape[-1]
                mask = mb["mask"] & active
                batch = TensorDict({"log_prob": mb["log_prob"], "entropy": mb["entropy"], "mask": mask,
                                    "old_log_prob": _pad([old[i] for i in local], width, device),
                                    "advantage": adv[local].to(device)}, batch_size=[len(local)])
                losses = loss_module(batch)
                total = sum(v for k, v in losses.items() if k.startswith("loss_"))
                scale = distributed_loss_scale(mask, a.aggregation)
            optimizer.zero_grad(set_to_none=True)
            (scale * total).backward()
            norms.append(float(clip_grad_norm(model.parameters(), a.grad_clip)))
            optimizer.step()
            losses_seen.append(reduce_mean(scale * total.detach()))
            trained_tokens += sum(lengths[i] for i in local) if active else 0
        _sync(device)
        update_s = time.perf_counter() - t1
        trained_tokens = round(reduce_mean(trained_tokens) * world)
        recompute_tokens = sum(lengths)

        # ---- weight sync into the rollout copy
        t2 = time.perf_counter()
        state = full_state_dict(model)
        if is_main_process():
            policy.model.load_state_dict(state)
        _sync(device)
        sync_s = time.perf_counter() - t2

        flops = 6 * n_params * trained_tokens + 2 * n_params * recompute_tokens
        rec = {"iteration": it, "rows": n, "loss": sum(losses_seen) / len(losses_seen),
               "grad_norm": sum(norms) / len(norms), "collect_s": collect_s, "update_s": update_s,
               "sync_s": sync_s, "generated_tokens": (policy.tokens - gen_tok0) if policy else 0,
               "generate_s": (policy.seconds - gen_s0) if policy else 0.0,
               "trained_tokens": trained_tokens, "recompute_tokens": recompute_tokens, "flops": flops}
        records.append(rec)
        if is_main_process():
            print("iteration " + json.dumps({k: (float(f"{v:.4g}") if isinstance(v, float) else v)
                                             for k, v in rec.items()}), flush=True)

    steady = records[1:] if len(records) > 1 else records

    def total(key):
        return sum(r[key] for r in steady)

    update_s = total("update_s")
    summary = {
        "benchmark": "gpu_smoke", "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "world_size": world, "fsdp2": sharded, "model": args.model, "params": n_params,
        "dtype": str(dtype).replace("torch.", ""), "env": args.env, "iterations": iterations,
        "measured_iterations": len(steady), "rows_per_iteration": total("rows") / len(steady),
        "gen_tokens_per_s": total("generated_tokens") / max(total("generate_s"), 1e-9),
        "collect_tokens_per_s": total("generated_tokens") / max(total("collect_s"), 1e-9),
        "train_tokens_per_s": total("trained_tokens") / max(update_s, 1e-9),
        "update_s_per_iteration": update_s / len(steady),
        "weight_sync_s": total("sync_s") / len(steady),
        "peak_tflops": peak,
        "mfu": (total("flops") / update_s / (world * peak * 1e12)) if peak else None,
        "loss_last": records[-1]["loss"], "grad_norm_last": records[-1]["grad_norm"],
        "max_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30) if cuda else None,
    }
    if is_main_process():
        print(json.dumps(summary), flush=True)
    cleanup()
    return summary


if __name__ == "__main__":
    main()

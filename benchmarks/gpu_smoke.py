"""Training smoke and throughput of the shipped training step: a few collect -> advantage -> update
iterations of :class:`~torchrl_agent.trainers.Trainer`, in bf16 on a GPU.

Launched by ``benchmarks/gpu_smoke.sh`` (``torchrun --standalone --nproc_per_node N``, so even one
process trains through FSDP2; plain ``python benchmarks/gpu_smoke.py`` runs it without a process
group, with autocast). The update is ``Trainer.update`` as shipped: float32 master weights and
optimizer state, compute in ``--dtype`` (FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``), token-budget micro-batches (``--micro-batch-tokens``), log-probs from the LM
head at response positions only, ``--chunk-tokens`` at a time, the KL reference (``--kl-coef``)
sharded like the policy, and the rollout engine (rank 0's transformers engine) on a bf16 copy synced
after every update.

Models: ``qwen2-0.5b`` (the CUDA default): Qwen2.5-0.5B's architecture (24 layers, hidden 896,
151,936-token vocabulary, tied embeddings, 494M parameters) built offline from its config with random
weights and the bundled tokenizer, so no download is needed (throughput does not depend on the
weights; rewards are meaningless); ``tiny`` (the CPU default), ``smollm2-135m``, or a local Hugging
Face folder (real weights).

Measured (iterations after the first, the warm-up, when there are several):

- ``gen_tokens_per_s``: generated tokens / time inside the engine's ``generate``;
  ``collect_tokens_per_s``: the same over the whole collection (environments and prompts included);
- ``train_tokens_per_s``: tokens (prompt + response, no padding) trained on (all epochs), summed over
  ranks / update time (old and reference log-prob recomputation included in the time);
- ``mfu``: ``(6 * P * train_tokens + 2 * P * recompute_tokens) / update_time / (world * peak)``, ``P``
  the parameter count (tied embeddings counted once; attention-score FLOPs and the LM head's
  recomputation in the backward left out, so a lower bound), ``recompute_tokens`` the tokens of the
  old (and reference) log-prob passes. ``peak`` = ``--peak-tflops`` (default on CUDA: 989 TFLOP/s, an
  H100/H200 SXM's dense bf16 peak); on CPU ``mfu`` is null unless ``--peak-tflops`` is given.

Prints one line per iteration (rank 0), then one JSON object as the LAST line::

    benchmarks/gpu_smoke.sh                                  # CUDA: qwen2-0.5b in bf16
    benchmarks/gpu_smoke.sh --cpu --dtype bfloat16           # the same path on CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torchrl_agent.trainers.config import TrainConfig  # noqa: E402
from torchrl_agent.trainers.distributed import (  # noqa: E402
    broadcast_object,
    cleanup,
    init_distributed,
    is_distributed,
    is_main_process,
)

H200_BF16_DENSE_TFLOPS = 989.0
#: Qwen2.5-0.5B's architecture (config.json of Qwen/Qwen2.5-0.5B-Instruct)
QWEN25_0P5B = dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                   rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def build_qwen2_0p5b() -> Path:
    """A Qwen2.5-0.5B-architecture model with random weights and the bundled tokenizer (cached)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from torchrl_agent.models import build_tiny_model, cache_dir
    from torchrl_agent.models.tiny import save_model_folder

    folder = cache_dir() / "models" / "qwen2-0.5b-config"
    if (folder / "model.safetensors").exists():
        return folder
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_0P5B)).to(torch.bfloat16)
    return save_model_folder(model, AutoTokenizer.from_pretrained(build_tiny_model()), folder)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="force CPU (gloo); default: CUDA when available")
    p.add_argument("--model", default=None,
                   help="qwen2-0.5b (CUDA default) | tiny (CPU default) | smollm2-135m | a local Hugging Face folder")
    p.add_argument("--env", default="numberline")
    p.add_argument("--iterations", type=int, default=None, help="default: 4 on CUDA, 2 on CPU")
    p.add_argument("--groups", type=int, default=None, help="groups per batch (default: 16 CUDA, 2 CPU)")
    p.add_argument("--group-size", type=int, default=None, help="default: 8 CUDA, 2 CPU")
    p.add_argument("--max-steps", type=int, default=None, help="episode length cap (default: 6 CUDA, 2 CPU)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 256 CUDA, 8 CPU")
    p.add_argument("--minibatch-size", type=int, default=None, help="rows per step (default: 256 CUDA, 4 CPU)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="default: 16384 CUDA, 256 CPU")
    p.add_argument("--chunk-tokens", type=int, default=None, help="LM-head chunk (default: 1024 CUDA, 16 CPU)")
    p.add_argument("--kl-coef", type=float, default=0.01, help="> 0: a KL reference, sharded like the policy")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--dtype", default=None, help="compute dtype: bfloat16 (CUDA default) | float32 (CPU default)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help=f"peak FLOP/s per device for MFU, in TFLOP/s (CUDA default {H200_BF16_DENSE_TFLOPS})")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("iterations", "groups", "group_size", "max_steps", "max_new_tokens", "minibatch_size",
                 "micro_batch_tokens", "chunk_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, world, device = init_distributed("cpu" if args.cpu else None)
    cuda = device.type == "cuda"

    def pick(value, gpu, cpu):
        return value if value is not None else (gpu if cuda else cpu)

    iterations = pick(args.iterations, 4, 2)
    peak = args.peak_tflops if args.peak_tflops is not None else (H200_BF16_DENSE_TFLOPS if cuda else None)
    model = pick(args.model, "qwen2-0.5b", "tiny")

    cfg = TrainConfig()
    cfg.seed = args.seed
    cfg.device = "cpu" if args.cpu else None
    cfg.progress = False
    cfg.run_dir = f"runs/gpu_smoke-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg.env.name = args.env
    cfg.env.num_groups = pick(args.groups, 16, 2)
    cfg.env.group_size = pick(args.group_size, 8, 2)
    cfg.env.max_steps = pick(args.max_steps, 6, 2)
    cfg.rollout.max_new_tokens = pick(args.max_new_tokens, 256, 8)
    cfg.rollout.batch_size = 256 if cuda else 64
    cfg.rollout.logprob_warn_threshold = 1.0  # bf16 engine vs trainer: reported, not warned about
    a = cfg.algorithm
    a.minibatch_size = pick(args.minibatch_size, 256, 4)
    a.micro_batch_tokens = pick(args.micro_batch_tokens, 16384, 256)
    a.logprob_chunk_tokens = pick(args.chunk_tokens, 1024, 16)
    a.lr, a.kl_coef = args.lr, args.kl_coef
    cfg.model.dtype = pick(args.dtype, "bfloat16", "float32")
    if model == "qwen2-0.5b":
        model_dir = str(build_qwen2_0p5b()) if is_main_process() else None
        cfg.model.name, cfg.model.path = "hf", broadcast_object(model_dir)  # rank 0 builds it once
    elif os.path.isdir(model):
        cfg.model.name, cfg.model.path = "hf", model
    else:
        cfg.model.name = model

    from torchrl_agent.trainers import Trainer

    trainer = Trainer(cfg)
    # tied embeddings counted once; a DTensor shard's numel() is the full parameter's
    n_params = sum(p.numel() for p in trainer.model.parameters())
    gen = {"s": 0.0, "tokens": 0}
    if trainer.policy is not None:  # rank 0: time the engine's generate
        generate = trainer.policy.generate

        def timed_generate(prompts):
            _sync(device)
            t0 = time.perf_counter()
            out = generate(prompts)
            _sync(device)
            gen["s"] += time.perf_counter() - t0
            gen["tokens"] += sum(len(g.response_ids) for g in out)
            return out

        trainer.policy.generate = timed_generate

    records = []
    for it in range(iterations):
        trainer.iteration = it
        t0 = time.perf_counter()
        gen_s0, gen_tok0 = gen["s"], gen["tokens"]
        rows = trainer.advantage(trainer.collector.collect()) if is_main_process() else None
        collect_s = time.perf_counter() - t0
        rows = broadcast_object(rows)
        n = rows.batch_size[0]
        lengths = [len(p) + len(r) for p, r in zip(rows.get(("tokens", "prompt"), as_list=True),
                                                   rows.get(("tokens", "response"), as_list=True))]
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t1 = time.perf_counter()
        metrics = trainer.update(rows)  # recompute, micro-batched steps, weight sync into the engine
        _sync(device)
        update_s = time.perf_counter() - t1
        trained_tokens = a.epochs * sum(lengths)
        recompute_tokens = sum(lengths) * (2 if a.kl_coef > 0 else 1)
        flops = 6 * n_params * trained_tokens + 2 * n_params * recompute_tokens
        rec = {"iteration": it, "rows": n, "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"),
               "skipped_steps": metrics["skipped_steps"], "logprob_diff_max": metrics["logprob_diff_max"],
               "collect_s": collect_s, "update_s": update_s,
               "generated_tokens": gen["tokens"] - gen_tok0, "generate_s": gen["s"] - gen_s0,
               "trained_tokens": trained_tokens, "recompute_tokens": recompute_tokens, "flops": flops,
               "max_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30) if cuda else None}
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
        "world_size": world, "fsdp2": is_distributed(), "model": model, "params": n_params,
        "dtype": cfg.model.dtype, "master_dtype": str(next(trainer.model.parameters()).dtype).replace("torch.", ""),
        "env": args.env, "iterations": iterations, "measured_iterations": len(steady),
        "rows_per_iteration": total("rows") / len(steady),
        "micro_batch_tokens": a.micro_batch_tokens, "logprob_chunk_tokens": a.logprob_chunk_tokens,
        "kl_coef": a.kl_coef,
        "gen_tokens_per_s": total("generated_tokens") / max(total("generate_s"), 1e-9),
        "collect_tokens_per_s": total("generated_tokens") / max(total("collect_s"), 1e-9),
        "train_tokens_per_s": total("trained_tokens") / max(update_s, 1e-9),
        "update_s_per_iteration": update_s / len(steady),
        "peak_tflops": peak,
        "mfu": (total("flops") / update_s / (world * peak * 1e12)) if peak else None,
        "loss_last": records[-1]["loss"], "grad_norm_last": records[-1]["grad_norm"],
        "skipped_steps": sum(r["skipped_steps"] for r in records),
        "logprob_diff_max_last": records[-1]["logprob_diff_max"],
        "max_memory_gib": max((r["max_memory_gib"] or 0.0) for r in records) if cuda else None,
    }
    if is_main_process():
        print(json.dumps(summary), flush=True)
    cleanup()
    return summary


if __name__ == "__main__":
    main()

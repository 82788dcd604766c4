"""GPU smoke and throughput at the ALFWorld recipe's shape: generation with the transformers engine,
then the shipped training update, on a random-weight Qwen2.5-1.5B-architecture model.

Launched by ``benchmarks/gpu_smoke.sh`` (``torchrun --standalone --nproc_per_node N``, so even one
process trains through FSDP2). Needs no network and no vLLM: the model is built from Qwen2.5-1.5B's
config with random weights (throughput and memory do not depend on the weights), the tokenizer is the
bundled tiny model's (prompts are random token ids of the model's vocabulary).

One iteration (rank 0 generates, every rank trains):

1. ``--rows`` prompts of about ``--prompt-tokens`` tokens (+-10%), ``--new-tokens`` sampled per row
   by :class:`~torchrl_agent.modules.TransformersPolicy` (KV cache, one step's scores at a time) in
   chunks of ``--gen-batch`` rows, on rank 0's bf16 engine copy;
2. ``Trainer.update`` on those rows as one mini-batch (``algorithm.minibatch_size = rows``): old and
   KL-reference log-prob recomputation, token-budget micro-batches (``--micro-batch-tokens``), one
   AdamW step over float32 master weights (bf16 compute: FSDP2's ``MixedPrecisionPolicy``), then the
   weight sync into the engine copy (timed alone).

The ALFWorld recipe's shape is the default on CUDA: prompts of about 1,500 tokens (its
``memory.max_prompt_tokens`` is 2,048), responses of up to 512 tokens (random weights almost never
sample the end token: every row runs all 512), a mini-batch of 256 rows. Measured (the iterations
after the first, the warm-up, when there are several):

- ``gen_tokens_per_s``: generated tokens / time inside the engine;
- ``train_tokens_per_s``: tokens (prompt + response) trained on, summed over ranks / update time (the
  recomputation included, the weight sync not);
- ``mfu``: ``(6 P train_tokens + 2 P recompute_tokens) / update_time / (world x peak)`` with ``P``
  the parameter count (attention-score FLOPs left out: a lower bound); ``peak`` = ``--peak-tflops``
  (CUDA default 989 TFLOP/s, an H100/H200 SXM's dense bf16 peak; null on CPU);
- ``peak_memory_gib``: ``torch.cuda.max_memory_allocated`` over generation and over the update
  (CUDA), or the process's peak resident set (CPU);
- ``weight_sync_s``: gathering the full weights and loading them into the engine.

The VL shape (``--vl``): the tiny VLM (``model=tiny-vl``, a Qwen2.5-VL-architecture model of 230k
parameters) trained by the Trainer's own loop on Sokoban's image observations
(``experiment=sokoban_vl_tiny``'s settings, GiGPO): each iteration collects ``--rows`` env rows a step
for ``--steps`` steps with :class:`~torchrl_agent.modules.VisionPolicy` (the frames at the
reference's pixel bounds on CUDA, 81 image tokens a prompt; 9 with ``--tiny``), scores them with
:class:`~torchrl_agent.modules.VisionResponseLogProbs` from the rows' frames, and updates (FSDP2, the
compute dtype over float32 master weights) as one mini-batch. The same JSON, with
``gen_tokens_per_s`` the collection's (generation and env steps) and ``image_tokens_per_prompt``;
``mfu`` counts the language model's FLOPs as for text (the vision tower's left out). A check of the
VLM path on a GPU (bf16 compute under FSDP2), not a throughput figure for Qwen2.5-VL-3B.

Prints one line per iteration (rank 0), then one JSON object as the LAST line::

    benchmarks/gpu_smoke.sh                  # CUDA: Qwen2.5-1.5B architecture, ALFWorld shape (< 8 min on one H200)
    benchmarks/gpu_smoke.sh --tiny           # CPU: the tiny model at a tiny shape (the test's run)
    benchmarks/gpu_smoke.sh --vl             # CUDA: the tiny VLM on Sokoban frames (bf16, 81 image tokens)
    benchmarks/gpu_smoke.sh --vl --tiny      # CPU: the same at a tiny shape (float32, 9 image tokens)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
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
#: Qwen2.5-1.5B-Instruct's architecture (its config.json)
QWEN25_1P5B = dict(vocab_size=151_936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                   rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
#: Qwen2.5-0.5B-Instruct's architecture
QWEN25_0P5B = dict(QWEN25_1P5B, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                   num_attention_heads=14)
ARCHITECTURES = {"qwen2.5-1.5b": QWEN25_1P5B, "qwen2.5-0.5b": QWEN25_0P5B}


def build_random_model(name: str, device: torch.device) -> Path:
    """A ``name``-architecture model with random weights (bf16) and the bundled tokenizer (cached)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from torchrl_agent.models import build_tiny_model, cache_dir
    from torchrl_agent.models.tiny import save_model_folder

    folder = cache_dir() / "models" / f"{name}-random"
    if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
        return folder
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it is fast (the GPU when there is one)
        model = Qwen2ForCausalLM(Qwen2Config(**ARCHITECTURES[name])).to(torch.bfloat16)
    return save_model_folder(model.cpu(), AutoTokenizer.from_pretrained(build_tiny_model()), folder)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", default=os.environ.get("GPU_SMOKE_TINY") == "1",
                   help="CPU, the tiny model, a tiny shape (also GPU_SMOKE_TINY=1): checks the script runs")
    p.add_argument("--cpu", action="store_true", help="force CPU (gloo)")
    p.add_argument("--vl", action="store_true", default=os.environ.get("GPU_SMOKE_VL") == "1",
                   help="the VL shape: the tiny VLM trained on Sokoban's image observations (also GPU_SMOKE_VL=1)")
    p.add_argument("--steps", type=int, default=None, help="--vl: env steps per episode (default 2)")
    p.add_argument("--model", default=None,
                   help="qwen2.5-1.5b (default) | qwen2.5-0.5b | tiny | a local Hugging Face folder")
    p.add_argument("--iterations", type=int, default=None, help="default 2 (the first warms up)")
    p.add_argument("--rows", type=int, default=None, help="prompts per iteration = the mini-batch (default 256)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="mean prompt length (default 1500)")
    p.add_argument("--new-tokens", type=int, default=None, help="response tokens per row (default 512)")
    p.add_argument("--gen-batch", type=int, default=None, help="rows per generate call (default 128)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="default 16384")
    p.add_argument("--chunk-tokens", type=int, default=None, help="LM-head chunk (default 1024)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="model.gradient_checkpointing=true")
    p.add_argument("--kl-coef", type=float, default=0.01, help="> 0: a KL reference, sharded like the policy")
    p.add_argument("--dtype", default=None, help="compute dtype (default bfloat16; float32 with --tiny)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help=f"peak FLOP/s per device for MFU, in TFLOP/s (CUDA default {H200_BF16_DENSE_TFLOPS})")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tiny = dict(model="tiny", iterations=2, rows=4, prompt_tokens=24, new_tokens=8, gen_batch=4,
                micro_batch_tokens=64, chunk_tokens=16, dtype="float32")
    full = dict(model="qwen2.5-1.5b", iterations=2, rows=256, prompt_tokens=1500, new_tokens=512, gen_batch=128,
                micro_batch_tokens=16384, chunk_tokens=1024, dtype="bfloat16")
    if args.vl:  # --rows: env rows a step (groups x 4); --prompt-tokens: not used (the env writes the prompts)
        tiny = dict(tiny, model="tiny-vl", steps=2, micro_batch_tokens=2048)
        full = dict(model="tiny-vl", iterations=2, rows=64, prompt_tokens=1, steps=2, new_tokens=64, gen_batch=64,
                    micro_batch_tokens=16384, chunk_tokens=1024, dtype="bfloat16")
    for key, value in (tiny if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        if isinstance(value, int) and getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    args.cpu = args.cpu or args.tiny
    return args


def make_prompts(n: int, mean: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random token ids in ``[3, vocab)``, ``mean`` +- 10% tokens long."""
    g = torch.Generator().manual_seed(seed)
    spread = max(1, mean // 10)
    lengths = torch.randint(max(1, mean - spread), mean + spread + 1, (n,), generator=g)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in lengths]


def vl_config(args):
    """The VL shape's config: ``experiment=sokoban_vl_tiny`` at ``args``' sizes, one mini-batch an iteration."""
    from torchrl_agent.trainers.cli import compose_config

    group_size = 4 if args.rows % 4 == 0 else 1
    return compose_config([
        "experiment=sokoban_vl_tiny", f"seed={args.seed}", "progress=false", "eval_every=0", "checkpoint_every=0",
        f"iterations={args.iterations}", f"env.num_groups={args.rows // group_size}", f"env.group_size={group_size}",
        f"env.max_steps={args.steps}", f"rollout.max_new_tokens={args.new_tokens}", f"rollout.batch_size={args.gen_batch}",
        "rollout.logprob_warn_threshold=1.0", f"model.dtype={args.dtype}",
        f"model.min_pixels={0 if args.tiny else 256 * 256}",  # CUDA: the reference's bound, 81 image tokens a frame
        f"model.gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
        f"algorithm.minibatch_size={args.rows * args.steps}", f"algorithm.micro_batch_tokens={args.micro_batch_tokens}",
        f"algorithm.logprob_chunk_tokens={args.chunk_tokens}", f"algorithm.kl_coef={args.kl_coef}", "algorithm.epochs=1",
        f"device={'cpu' if args.cpu else 'cuda'}"])


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, world, device = init_distributed("cpu" if args.cpu else None)
    cuda = device.type == "cuda"
    peak = args.peak_tflops if args.peak_tflops is not None else (H200_BF16_DENSE_TFLOPS if cuda else None)
    if args.vl:
        return main_vl(args, world, device, peak)
    from tensordict import TensorDict, lazy_stack

    from torchrl_agent.trainers import Trainer

    cfg = TrainConfig()
    cfg.seed, cfg.progress, cfg.device = args.seed, False, "cpu" if args.cpu else None
    cfg.run_dir = broadcast_object(tempfile.mkdtemp(prefix="gpu_smoke-") if is_main_process() else None)
    cfg.env.num_groups, cfg.env.group_size, cfg.eval_every = 1, 1, 0  # the environment is not used
    cfg.memory.max_prompt_tokens = 2048  # the ALFWorld recipe's prompt budget
    cfg.rollout.max_new_tokens, cfg.rollout.batch_size = args.new_tokens, args.gen_batch
    cfg.rollout.logprob_warn_threshold = 1.0  # bf16 engine vs trainer: reported, not warned about
    a = cfg.algorithm
    a.minibatch_size, a.micro_batch_tokens, a.logprob_chunk_tokens = args.rows, args.micro_batch_tokens, args.chunk_tokens
    a.lr, a.kl_coef, a.epochs = 1e-6, args.kl_coef, 1
    cfg.model.dtype, cfg.model.gradient_checkpointing = args.dtype, args.gradient_checkpointing
    if args.model in ARCHITECTURES:
        folder = str(build_random_model(args.model, device)) if is_main_process() else None
        cfg.model.name, cfg.model.path = "hf", broadcast_object(folder)  # rank 0 builds it once
    elif os.path.isdir(args.model):
        cfg.model.name, cfg.model.path = "hf", args.model
    else:
        cfg.model.name = args.model

    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    setup_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in trainer.model.parameters())  # tied embeddings once; DTensor: full size
    vocab = trainer.model.config.vocab_size
    sync = timed_weight_sync(trainer, device)

    records = []
    for it in range(args.iterations):
        trainer.iteration = it
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        gen_s, rows = 0.0, None
        if is_main_process():
            prompts = make_prompts(args.rows, args.prompt_tokens, vocab, args.seed + it)
            responses = []
            torch.manual_seed(args.seed + it)
            for start in range(0, len(prompts), args.gen_batch):
                _sync(device)
                t = time.perf_counter()
                responses += trainer.policy._generate_batch(prompts[start:start + args.gen_batch])
                _sync(device)
                gen_s += time.perf_counter() - t
            g = torch.Generator().manual_seed(args.seed + it)
            rows = lazy_stack([TensorDict({
                "tokens": {"prompt": torch.tensor(p), "response": torch.tensor(ids)},
                "log_probs": {"response": torch.tensor(lps, dtype=torch.float32)},
                "advantage": torch.randn(1, generator=g),
            }) for p, (ids, lps) in zip(prompts, responses)])
        gen_peak = _peak_gib(device)
        rows = broadcast_object(rows)
        generated = sum(len(r) for r in rows.get(("tokens", "response"), as_list=True))
        lengths = [len(p) + len(r) for p, r in zip(rows.get(("tokens", "prompt"), as_list=True),
                                                   rows.get(("tokens", "response"), as_list=True))]
        metrics, update_s = timed_update(trainer, rows, device, sync)
        trained = a.epochs * sum(lengths)
        recomputed = sum(lengths) * (2 if a.kl_coef > 0 else 1)
        rec = {"iteration": it, "rows": len(lengths), "generated_tokens": generated, "generate_s": gen_s,
               "trained_tokens": trained, "recompute_tokens": recomputed, "update_s": update_s,
               "weight_sync_s": sync["s"], "flops": 6 * n_params * trained + 2 * n_params * recomputed,
               "gen_peak_memory_gib": gen_peak, "update_peak_memory_gib": _peak_gib(device),
               "loss": metrics.get("loss"), "logprob_diff_max": metrics["logprob_diff_max"]}
        records.append(rec)
        if is_main_process():
            print("iteration " + json.dumps({k: (float(f"{v:.4g}") if isinstance(v, float) else v)
                                             for k, v in rec.items()}), flush=True)

    summary = {
        "benchmark": "gpu_smoke", "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "world_size": world, "fsdp2": is_distributed(), "model": args.model, "params": n_params,
        "dtype": cfg.model.dtype, "gradient_checkpointing": args.gradient_checkpointing,
        "rows": args.rows, "prompt_tokens_mean": args.prompt_tokens, "max_new_tokens": args.new_tokens,
        "micro_batch_tokens": a.micro_batch_tokens, "iterations": args.iterations, "setup_s": setup_s,
        **steady_figures(records, world, peak, cuda),
    }
    if is_main_process():
        print(json.dumps(summary), flush=True)
    cleanup()
    return summary


def timed_update(trainer, rows, device: torch.device, sync: dict[str, float]) -> tuple[dict, float]:
    """``trainer.update(rows)`` with the peak-memory counter reset first: ``(metrics, seconds)``, the
    weight sync inside it (``sync``, :func:`timed_weight_sync`) left out of the seconds."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync["s"] = 0.0
    _sync(device)
    t = time.perf_counter()
    metrics = trainer.update(rows)
    _sync(device)
    return metrics, time.perf_counter() - t - sync["s"]


def steady_figures(records: list[dict], world: int, peak: float | None, cuda: bool) -> dict:
    """The summary's rates over the iterations after the first (the warm-up; all of them when there is
    one), its peaks over all of them, and the last iteration's loss and log-prob difference."""
    steady = records[1:] if len(records) > 1 else records

    def total(key):
        return sum(r[key] for r in steady)

    return {
        "measured_iterations": len(steady),
        "gen_tokens_per_s": total("generated_tokens") / max(total("generate_s"), 1e-9),
        "train_tokens_per_s": total("trained_tokens") / max(total("update_s"), 1e-9),
        "update_s": total("update_s") / len(steady), "peak_tflops": peak,
        "mfu": total("flops") / total("update_s") / (world * peak * 1e12) if peak else None,
        "peak_memory_gib": {"generate": max(r["gen_peak_memory_gib"] for r in records),
                            "update": max(r["update_peak_memory_gib"] for r in records),
                            "kind": "cuda_max_allocated" if cuda else "process_max_rss"},
        "weight_sync_s": total("weight_sync_s") / len(steady),
        "loss_last": records[-1]["loss"], "logprob_diff_max_last": records[-1]["logprob_diff_max"],
    }


def timed_weight_sync(trainer, device: torch.device) -> dict[str, float]:
    """Wraps ``trainer.sync_weights`` so that each call adds its time (device-synchronised) to the
    returned dict's ``"s"``, which the caller resets per iteration."""
    sync = {"s": 0.0}
    sync_weights = trainer.sync_weights

    def timed_sync():
        _sync(device)
        t = time.perf_counter()
        sync_weights()
        _sync(device)
        sync["s"] += time.perf_counter() - t

    trainer.sync_weights = timed_sync
    return sync


def main_vl(args, world: int, device: torch.device, peak: float | None) -> dict:
    """The VL shape (module docstring): the Trainer's collection and update, timed, then the JSON."""
    from torchrl_agent.trainers import Trainer

    cuda = device.type == "cuda"
    cfg = vl_config(args)
    cfg.run_dir = broadcast_object(tempfile.mkdtemp(prefix="gpu_smoke-vl-") if is_main_process() else None)
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    setup_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in trainer.model.parameters())
    sync = timed_weight_sync(trainer, device)
    records = []
    for it in range(args.iterations):
        trainer.iteration = it
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        rows, collected = trainer.collect_rows()  # generation, env steps, the old and reference log-probs
        stats = trainer.collector.stats
        gen_peak = _peak_gib(device)
        lengths = [len(p) + len(r) for p, r in zip(rows.get(("tokens", "prompt"), as_list=True),
                                                   rows.get(("tokens", "response"), as_list=True))]
        metrics, update_s = timed_update(trainer, rows, device, sync)
        image_tokens = rows["image_tokens"].reshape(-1)
        rec = {"iteration": it, "rows": len(lengths), "generated_tokens": stats["generated_tokens"],
               "generate_s": stats["generated_tokens"] / max(stats["tokens_per_s"], 1e-9),
               "trained_tokens": sum(lengths), "update_s": update_s, "weight_sync_s": sync["s"],
               "flops": 6 * n_params * sum(lengths), "image_tokens": int(image_tokens.max()),
               "gen_peak_memory_gib": gen_peak, "update_peak_memory_gib": _peak_gib(device),
               "loss": metrics.get("loss"), "logprob_diff_max": metrics["logprob_diff_max"],
               "episode_reward": collected.get("episode_reward")}
        records.append(rec)
        if is_main_process():
            print("iteration " + json.dumps({k: (float(f"{v:.4g}") if isinstance(v, float) else v)
                                             for k, v in rec.items()}), flush=True)
    summary = {
        "benchmark": "gpu_smoke", "shape": "vl", "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "world_size": world, "fsdp2": is_distributed(), "model": args.model, "params": n_params,
        "dtype": cfg.model.dtype, "gradient_checkpointing": args.gradient_checkpointing, "env": "sokoban (image)",
        "rows": records[-1]["rows"], "image_tokens_per_prompt": records[-1]["image_tokens"],
        "max_new_tokens": args.new_tokens, "micro_batch_tokens": args.micro_batch_tokens,
        "iterations": args.iterations, "setup_s": setup_s, **steady_figures(records, world, peak, cuda),
    }
    if is_main_process():
        print(json.dumps(summary), flush=True)
    trainer.close()
    cleanup()
    return summary


if __name__ == "__main__":
    main()

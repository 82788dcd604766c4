"""The constants of the GPU memory plan, measured on CPU, and the plan they give per recipe.

Measured (each activation figure in a fresh subprocess):

- ``state_bytes_per_param``: the bytes of every tensor training keeps per parameter after an AdamW
  step with float32 master weights (weights + gradients + AdamW's two moments), counted over the
  tensors themselves (``numel x element_size``) of a Qwen2-architecture model;
- ``activation_bytes_per_token_layer``: the memory one forward + backward of
  :class:`~torchrl_agent.modules.ResponseLogProbs` adds per token and per decoder layer, in bf16
  (the compute dtype of the GPU recipes: FSDP2's ``MixedPrecisionPolicy`` computes in bf16), without
  and with ``model.gradient_checkpointing``. The peak resident set (``VmHWM`` reset just before,
  ``MALLOC_MMAP_THRESHOLD_=65536``) minus the resident set before it (after a one-row warm-up that
  allocates the gradients), over three runs ``P(layers, rows)``: the bytes per token and layer are
  ``(P(4, 2) - P(2, 2)) / (2 x 2 x 128)``, the bytes per token outside the layers the slope in rows
  at 2 layers, ``(P(2, 4) - P(2, 2)) / (2 x 128)``, less 2 layers' share. The probe model has
  Qwen2.5-1.5B's proportions (head size 128, intermediate = 5.83 x hidden) at hidden 256; the
  figures are then scaled by ``hidden / 256`` (a layer's activations are linear in its width at a
  fixed shape; 7B's intermediate ratio, 5.29, is smaller, so its estimate is an upper bound).
  Sequences of 128 tokens (96 prompt + 32 response), sdpa attention.

The plan (JSON ``plans``; ``recipe_plans`` for the recipes of ``RECIPE_SHAPES``, another prompt budget,
batch or model): per recipe (Qwen2.5-1.5B / 7B, 1 or 8 GPUs of 80 or 141 GB), the bytes per
GPU of each part, with ``N`` GPUs (FSDP2 shards over all of them), ``P`` parameters, ``L`` layers,
``M`` = ``algorithm.micro_batch_tokens``, ``a`` the activation bytes per token and layer and ``c`` the
bytes per token outside the layers (with checkpointing: ``a_ckpt``, the kept layer input, and
``c_ckpt``, which also holds the one layer recomputed at a time), all scaled by ``hidden / 256``::

    trainer state      = s P / N                    (s = state_bytes_per_param, measured: 16)
    KL reference       = 2 P / N                    (bf16, sharded like the policy)
    FSDP2 gathering    = 2 x 2 P / L                (bf16 layers gathered: the current one and the next)
    activations        = M (L a + c)                (no checkpointing)
                       = M (L a_ckpt + c_ckpt)      (gradient checkpointing)
    LM-head chunk      = 3 x C V 4                  (C = algorithm.logprob_chunk_tokens, float32 logits,
                                                     their log-softmax and its gradient)
    vLLM engine        = u G                        (u = rollout.gpu_memory_utilization of the GPU's G bytes:
                                                     bf16 weights 2 P, CUDA graphs, the rest KV cache)
    collection peak    = state + reference + engine
    update peak        = state + reference + gathering + activations + head (+ engine without sleep mode)

``u`` is chosen so that the engine holds its weights, 2 GiB of work space and the KV cache of every
sequence of its share of the batch (``rows / N`` sequences of ``prompt + response`` tokens at once).

The vision-language recipes (``engine: transformers`` in :data:`RECIPE_SHAPES`; vLLM takes no images
here yet) count the vision tower and the image tokens: ``P`` is the whole VLM's (vision tower
``P_v`` included, trained as in the reference), the ``prompt`` budget includes each prompt's image
tokens, and::

    FSDP2 gathering    = 2 x 2 (P - P_v) / L + 2 P_v        (the vision tower sits in the root's group: gathered whole)
    activations       += M / (prompt + response) x 4 T x L_v a_v
                                                     (one image a row, T image tokens = 4 T patches before the
                                                     2x2 merge, through the L_v vision blocks; a_v: a scaled
                                                     by hidden_v / 256, a_ckpt likewise with checkpointing)
    transformers engine = 2 P + 2 GiB + min(B, rows / N) x (prompt + response) x KV bytes per token
                                                     (every rank's bf16 copy of the weights, and the KV cache of
                                                     one generate call of B = rollout.batch_size rows, freed
                                                     before the update: the update counts the copy only)

with no sleep mode (the transformers engine has none) among the settings tried.
For each recipe the first of these settings whose peaks fit in 90% of the GPU is reported:
no checkpointing without sleep mode, then checkpointing, then checkpointing and sleep mode, then
smaller micro-batches (8,192, 4,096, 2,048 tokens)::

    python benchmarks/memory_plan.py            # 7 subprocesses, a few minutes on 2 idle CPU cores
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBE_HIDDEN = 256
#: the probe: Qwen2.5-1.5B's proportions at hidden 256 (head size 128, intermediate 5.83x hidden)
PROBE = dict(hidden_size=PROBE_HIDDEN, intermediate_size=1493, num_attention_heads=2, num_key_value_heads=1,
             head_dim=128, vocab_size=4096, max_position_embeddings=4096, tie_word_embeddings=True)
#: (layers, rows) of the runs: two depths at ROWS[0] give the bytes per layer, two batch sizes at
#: LAYERS[0] the bytes per token; every row is SEQUENCE tokens
LAYERS = (2, 4)
ROWS = (2, 4)
RUNS = ((LAYERS[0], ROWS[0]), (LAYERS[1], ROWS[0]), (LAYERS[0], ROWS[1]))
SEQUENCE = (96, 32)  # prompt, response
GIB = 2**30

#: the recipes' models (their config.json): parameters, layers, hidden, vocabulary, KV bytes per token (bf16)
MODELS = {
    "qwen2.5-1.5b": dict(params=1_543_714_304, layers=28, hidden=1536, vocab=151_936, kv_heads=2, head_dim=128),
    "qwen2.5-7b": dict(params=7_615_616_512, layers=28, hidden=3584, vocab=152_064, kv_heads=4, head_dim=128),
    "qwen2.5-3b": dict(params=3_085_938_688, layers=36, hidden=2048, vocab=151_936, kv_heads=2, head_dim=128),
    # Qwen2.5-VL-3B-Instruct: Qwen2.5-3B's language model (3,085,938,688) + the vision tower (668,684,288: 32
    # blocks of width 1280, MLP 3420, 14-px patches, the 2x2 merger to 2048), counted on a meta-device model
    # built from its config.json; 3,754,622,976 in all (the published 3.75B)
    "qwen2.5-vl-3b": dict(params=3_754_622_976, layers=36, hidden=2048, vocab=151_936, kv_heads=2, head_dim=128,
                          vision_params=668_684_288, vision_layers=32, vision_hidden=1280),
}
#: the ALFWorld recipes' shape: 16 groups x 8 rollouts, prompt budget 2,048, responses up to 512
RECIPE = dict(rows=128, prompt_tokens=2048, response_tokens=512, micro_batch_tokens=16384, chunk_tokens=1024)
#: recipes of another shape or model (JSON ``recipe_plans``): rows = groups x rollouts, the prompt budget
#: (memory.max_prompt_tokens), rollout.max_new_tokens
RECIPE_SHAPES = {
    "alfworld_hgpo": dict(model="qwen2.5-1.5b", rows=128, prompt_tokens=4096, response_tokens=512),
    "webshop_hgpo": dict(model="qwen2.5-1.5b", rows=128, prompt_tokens=4096, response_tokens=512),
    "alfworld_graphgpo": dict(model="qwen2.5-1.5b", rows=128, prompt_tokens=2048, response_tokens=512),
    "webshop_graphgpo": dict(model="qwen2.5-1.5b", rows=128, prompt_tokens=5120, response_tokens=512),
    "sokoban_graphgpo": dict(model="qwen2.5-3b", rows=256, prompt_tokens=1024, response_tokens=512),
    # the VLM recipes: one image a prompt of image_tokens (81: a 96x96 frame, 121: a 300x300 table, at the
    # reference's [256^2, 2048^2] pixel bounds), inside the prompt budget; the transformers engine with
    # rollout.batch_size=64 rows a generate call; 2 GPUs too (the reference's layout: 2 GPUs, TP 2)
    "sokoban_vl_gigpo": dict(model="qwen2.5-vl-3b", rows=256, prompt_tokens=1024, response_tokens=512,
                             image_tokens=81, engine="transformers", gen_batch=64, gpus=(1, 2, 8)),
    "ezpoints_vl_gigpo": dict(model="qwen2.5-vl-3b", rows=128, prompt_tokens=1024, response_tokens=512,
                              image_tokens=121, engine="transformers", gen_batch=64, gpus=(1, 2, 8)),
}
#: the constants as last measured (docs/training_at_scale.md, "Memory plan"), for ``--plan-only``
MEASURED = {"state_bytes_per_param": 16.0,
            "activation_bytes_per_token_layer": {"no_checkpointing": 18_208, "checkpointing": 320},
            "other_bytes_per_token": {"no_checkpointing": 1_856, "checkpointing": 21_936}}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _probe_model(layers: int, checkpointing: bool, dtype):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from torchrl_agent.models import enable_gradient_checkpointing

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**PROBE, num_hidden_layers=layers)).to(dtype)
    if checkpointing:
        enable_gradient_checkpointing(model)
    return model.train()


def _rows(n: int, vocab: int):
    import torch
    from tensordict import TensorDict, lazy_stack

    g = torch.Generator().manual_seed(0)
    prompt, response = SEQUENCE
    return lazy_stack([TensorDict({"tokens": {"prompt": torch.randint(3, vocab, (prompt,), generator=g),
                                              "response": torch.randint(3, vocab, (response,), generator=g)}})
                       for _ in range(n)])


def child_activations(layers: int, rows: int, checkpointing: bool) -> dict:
    """Peak memory one bf16 forward + backward adds (gradients already allocated)."""
    import torch

    from torchrl_agent.modules import ResponseLogProbs

    model = _probe_model(layers, checkpointing, torch.bfloat16)
    # a small head chunk: its [chunk, vocabulary] logits are the same size in every run (the plan
    # counts the recipe's chunk apart), so the slopes hold only what grows with tokens and layers
    actor = ResponseLogProbs(model, 0, chunk_tokens=32)
    batch = _rows(rows, PROBE["vocab_size"])

    def step():
        out = actor(batch.copy())
        loss = -(out["log_prob"] * out["mask"]).sum() / out["mask"].sum() - 0.01 * out["entropy"].mean()
        loss.backward()

    out = actor(_rows(1, PROBE["vocab_size"]))  # warm-up on one row: kernels, and the gradients allocated
    (out["log_prob"].sum() + out["entropy"].sum()).backward()
    model.zero_grad(set_to_none=False)  # the gradients exist from here on (zeroed, kept)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kib("VmRSS")
    step()
    return {"layers": layers, "rows": rows, "tokens": rows * sum(SEQUENCE), "checkpointing": checkpointing,
            "peak_bytes": (_status_kib("VmHWM") - base) * 1024}


def child_state() -> dict:
    """Bytes kept per parameter by float32 master weights, their gradients and AdamW's state."""
    import torch

    model = _probe_model(2, False, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    out = model(input_ids=torch.randint(3, 100, (2, 16))).logits.float().mean()
    out.backward()
    optimizer.step()
    params = list(model.parameters())

    def nbytes(t):
        return t.numel() * t.element_size()

    weights = sum(nbytes(p) for p in params)
    grads = sum(nbytes(p.grad) for p in params if p.grad is not None)
    state = sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    n = sum(p.numel() for p in params)
    return {"params": n, "weights_bytes_per_param": weights / n, "grad_bytes_per_param": grads / n,
            "adamw_bytes_per_param": state / n, "state_bytes_per_param": (weights + grads + state) / n}


def run_child(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print("measured " + json.dumps(result), flush=True)
    return result


def fit(runs: list[dict]) -> tuple[float, float]:
    """(bytes per token and layer, bytes per token outside the layers) from the three :data:`RUNS`."""
    p = {(r["layers"], r["rows"]): r["peak_bytes"] for r in runs}
    (l1, l2), (r1, r2), tokens = LAYERS, ROWS, sum(SEQUENCE)
    per_layer = (p[l2, r1] - p[l1, r1]) / ((l2 - l1) * r1 * tokens)
    per_token_l1 = (p[l1, r2] - p[l1, r1]) / ((r2 - r1) * tokens)
    return per_layer, per_token_l1 - l1 * per_layer


def plan(constants: dict, shape: dict = RECIPE, models=("qwen2.5-1.5b", "qwen2.5-7b")) -> dict:
    """Bytes per GPU of each part for every model and GPU count/size at ``shape``, and the settings that fit."""
    shape = {**RECIPE, **shape}
    s = constants["state_bytes_per_param"]
    vllm = shape.get("engine", "vllm") == "vllm"
    sequence = shape["prompt_tokens"] + shape["response_tokens"]
    out = {}
    for name in models:
        m = MODELS[name]
        scale = m["hidden"] / PROBE_HIDDEN
        a = constants["activation_bytes_per_token_layer"]["no_checkpointing"] * scale
        a_ckpt = constants["activation_bytes_per_token_layer"]["checkpointing"] * scale
        c = constants["other_bytes_per_token"]["no_checkpointing"] * scale
        c_ckpt = constants["other_bytes_per_token"]["checkpointing"] * scale
        kv_per_token = m["layers"] * 2 * m["kv_heads"] * m["head_dim"] * 2
        P_v, L_v = m.get("vision_params", 0), m.get("vision_layers", 0)
        scale_v = m.get("vision_hidden", 0) / PROBE_HIDDEN
        patches_per_token = 4 * shape.get("image_tokens", 0) / sequence  # vision-tower positions per LM token
        for gpus in shape.get("gpus", (1, 8)):
            for gib in (80, 141):
                G = gib * GIB
                P, L = m["params"], m["layers"]
                seqs = shape["rows"] / gpus  # each rank's engine collects its share
                if vllm:
                    engine = 2 * P + 2 * GIB + seqs * sequence * kv_per_token
                    u = min(0.95, -(-engine / G * 100 // 1) / 100)  # rounded up to a percent
                    engine, kept = u * G, u * G  # kept through the update without sleep mode
                else:  # every rank's bf16 copy of the weights; the KV cache of one generate call, freed after it
                    u, kept = None, 2 * P
                    engine = 2 * P + 2 * GIB + min(shape["gen_batch"], seqs) * sequence * kv_per_token
                fixed = {"trainer_state": s * P / gpus, "kl_reference": 2 * P / gpus,
                         "fsdp2_gather": 2 * 2 * (P - P_v) / L + 2 * P_v,
                         "lm_head_chunk": 3 * shape["chunk_tokens"] * m["vocab"] * 4}
                chosen = None
                for ckpt, sleep, M in ((False, False, 16384), (True, False, 16384), (True, True, 16384),
                                       (True, True, 8192), (True, True, 4096), (True, True, 2048)):
                    sleep = sleep and vllm  # the transformers engine has no sleep mode
                    act = M * (L * a_ckpt + c_ckpt) if ckpt else M * (L * a + c)
                    act += M * patches_per_token * L_v * (a_ckpt if ckpt else a) * scale_v / scale
                    collection = fixed["trainer_state"] + fixed["kl_reference"] + engine
                    update = sum(fixed.values()) + act + (0 if sleep else kept)
                    if max(collection, update) <= 0.9 * G:
                        chosen = dict(gradient_checkpointing=ckpt, sleep_mode=sleep, micro_batch_tokens=M,
                                      activations_gib=act / GIB, collection_peak_gib=collection / GIB,
                                      update_peak_gib=update / GIB)
                        break
                vision = patches_per_token * L_v * scale_v / scale  # vision-tower layer positions per LM token, in LM widths
                out[f"{name}/{gpus}x{gib}GB"] = {
                    **{k + "_gib": v / GIB for k, v in fixed.items()},
                    "engine": "vllm" if vllm else "transformers",
                    "vllm_gpu_memory_utilization": u, "engine_gib": engine / GIB,
                    "activations_no_ckpt_gib": 16384 * (L * a + c + vision * a) / GIB,
                    "activations_ckpt_gib": 16384 * (L * a_ckpt + c_ckpt + vision * a_ckpt) / GIB,
                    **({"vision_activations_no_ckpt_gib": 16384 * vision * a / GIB} if P_v else {}),
                    "fits_with": chosen,
                }
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--plan-only", action="store_true",
                   help="no measurement: the plans from the constants last measured (MEASURED)")
    args = p.parse_args(argv)
    if args.plan_only:
        summary = {"benchmark": "memory_plan", "constants": "MEASURED", **MEASURED, "plans": plan(MEASURED),
                   "recipe_plans": {name: plan(MEASURED, shape, (shape["model"],))
                                    for name, shape in RECIPE_SHAPES.items()}}
        print(json.dumps(summary), flush=True)
        return summary
    if args.child is not None:
        with contextlib.suppress(OSError):
            Path("/proc/self/oom_score_adj").write_text("1000")
        if args.child == ["state"]:
            print(json.dumps(child_state()))
        else:
            layers, rows, ckpt = args.child
            print(json.dumps(child_activations(int(layers), int(rows), ckpt == "1")))
        return {}
    state = run_child("state")
    activations = {}
    for ckpt in (False, True):
        runs = [run_child(str(layers), str(rows), "1" if ckpt else "0") for layers, rows in RUNS]
        activations[ckpt] = fit(runs)
    constants = {
        "state_bytes_per_param": state["state_bytes_per_param"], "state": state,
        "activation_bytes_per_token_layer": {"no_checkpointing": activations[False][0],
                                             "checkpointing": activations[True][0]},
        # per token, outside the L layers' share: embeddings, final norm, the head's inputs; with
        # checkpointing also the one layer recomputed at a time in the backward
        "other_bytes_per_token": {"no_checkpointing": activations[False][1], "checkpointing": activations[True][1]},
        "probe": {**PROBE, "sequence": sum(SEQUENCE), "dtype": "bfloat16", "layers": LAYERS, "rows": ROWS},
    }
    summary = {"benchmark": "memory_plan", "device": "cpu", "recipe_shape": RECIPE, **constants,
               "plans": plan(constants),
               "recipe_plans": {name: plan(constants, shape, (shape["model"],)) for name, shape in RECIPE_SHAPES.items()}}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()

"""Prototype: one vLLM engine per torchrun rank (external launcher), every rank collecting its groups.

    torchrun --standalone --nproc_per_node 2 prototypes/colocated_vllm.py
"""
import json
import os
import sys
import time

import torch

from torchrl_agent.collectors.distributed import DistributedStepCollector
from torchrl_agent.collectors.shards import TextEnvFactory
from torchrl_agent.models.tiny import build_tiny_model
from torchrl_agent.modules import ResponseLogProbs
from torchrl_agent.modules.vllm_policy import VLLMPolicy
from torchrl_agent.trainers.distributed import (
    all_gather_object,
    full_weights,
    init_distributed,
    shard_model,
    split_over_ranks,
)

torch.set_num_threads(1)
rank, world, _ = init_distributed("cpu")
path = build_tiny_model()
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

tok = AutoTokenizer.from_pretrained(path)
t0 = time.perf_counter()
policy = VLLMPolicy(path, tok, dtype="float32", seed=0, max_new_tokens=8, max_num_seqs=8)
print(rank, "engine built", round(time.perf_counter() - t0, 1), flush=True)
groups, _ = DistributedStepCollector.groups_of(4)
env = TextEnvFactory("numberline", str(path), group_size=2, env_kwargs={"max_steps": 3})(groups)
collector = DistributedStepCollector(env, policy, num_groups=4, seed=0)
rows = collector.collect()
print(rank, "rows", rows.batch_size, collector.owner(rows).tolist(), flush=True)
model = shard_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
t0 = time.perf_counter()
state = full_weights(model)
policy.update_weights(state)
print(rank, "sync", round(time.perf_counter() - t0, 3), flush=True)
actor = ResponseLogProbs(model, tok.pad_token_id, with_entropy=False)


def compute(idx):
    out = actor(rows[idx])
    return [lp[: int(n)] for lp, n in zip(out["log_prob"], out["mask"].sum(-1))]


lengths = [len(p) + len(r) for p, r in zip(rows.get(("tokens", "prompt"), as_list=True),
                                            rows.get(("tokens", "response"), as_list=True))]
with torch.no_grad():
    lps, share = split_over_ranks(compute, lengths, lambda s: [s[i:i + 3] for i in range(0, len(s), 3)])
sampled = rows.get(("log_probs", "response"), as_list=True)
diff = max(float((a - b).abs().max()) for a, b in zip(lps, sampled) if len(a))
shares = all_gather_object(share)
print(rank, json.dumps({"n": len(lengths), "shares": shares, "diff": diff}), flush=True)
if len(sys.argv) > 1:
    json.dump({"rank": rank, "diff": diff}, open(os.path.join(sys.argv[1], f"r{rank}.json"), "w"))

"""Sending a batch of rows between processes: pickled row TensorDicts vs the packed message.

A shard of a sharded collector (``MultiProcessStepCollector``, ``RayStepCollector``) sends the
rows of its batch to the main process. Both ways are timed side by side on one real batch: real
ALFWorld games (``--num-groups`` x ``--group-size``, ``--max-steps`` each) collected by the
single-process ``StepCollector`` with the tiny model (transformers, temperature 1), then

- ``rows``: ``pickle.dumps(rows)`` in the sender, ``pickle.loads`` and ``unbind(0)`` in the
  receiver (what the shards did before);
- ``packed``: ``pickle.dumps(pack_rows(rows))`` in the sender, ``unpack_rows(pickle.loads(...))``
  in the receiver (what they do now);

each ``--repeats`` times, the best time kept, reported in ms per row with the message size. Both
are checked to give back the same rows (every key, dtype, shape and value). The last printed line
is one JSON object.

    python benchmarks/row_transfer.py [--num-groups 4] [--group-size 4] [--max-steps 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from tensordict import is_leaf_nontensor  # noqa: E402

from torchrl_agent.collectors import StepCollector  # noqa: E402
from torchrl_agent.collectors.shards import pack_rows, unpack_rows  # noqa: E402


def same(rows, back) -> bool:
    keys = list(rows.tensordicts[0].keys(True, True, is_leaf=is_leaf_nontensor))
    for a, b in zip(rows.tensordicts, back):
        for key in keys:
            x, y = a[key], b[key]
            if isinstance(x, torch.Tensor):
                if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                    return False
            elif type(x) is not type(y) or x != y:
                return False
    return len(back) == rows.batch_size[0]


def best_of(repeats: int, send, receive) -> tuple[float, float, int, list]:
    send_s, receive_s = float("inf"), float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        message = send()
        t1 = time.perf_counter()
        back = receive(message)
        t2 = time.perf_counter()
        send_s, receive_s = min(send_s, t1 - t0), min(receive_s, t2 - t1)
    return send_s, receive_s, len(message), back


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    for name in ("num_groups", "group_size", "max_steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    from collector_throughput import alfworld_env
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchrl_agent.models import build_tiny_model
    from torchrl_agent.modules import TransformersPolicy

    path = build_tiny_model()
    policy = TransformersPolicy(AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path),
                                max_new_tokens=32, temperature=1.0)
    env = alfworld_env(str(path), args.max_steps, args.num_groups, group_size=args.group_size)
    try:
        rows = StepCollector(env, policy, seed=0).collect()
    finally:
        env.close()
    n = rows.batch_size[0]
    out = {"benchmark": "row_transfer", "num_rows": n, "repeats": args.repeats, "statistic": "best of repeats"}
    for name, send, receive in (
        ("rows", lambda: pickle.dumps(rows), lambda m: list(pickle.loads(m).unbind(0))),
        ("packed", lambda: pickle.dumps(pack_rows(rows)), lambda m: unpack_rows(pickle.loads(m))),
    ):
        send_s, receive_s, size, back = best_of(args.repeats, send, receive)
        out[name] = {"send_ms_per_row": round(1000 * send_s / n, 3), "receive_ms_per_row": round(1000 * receive_s / n, 3),
                     "bytes_per_row": size // n, "same_rows": same(rows, back)}
    total = {k: out[k]["send_ms_per_row"] + out[k]["receive_ms_per_row"] for k in ("rows", "packed")}
    out["speedup"] = round(total["rows"] / total["packed"], 2)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()

"""Per-token GAE: ``token_gae`` (TorchRL's ``vec_generalized_advantage_estimate``) against the
discount-matrix form it replaced, on PPO-sized batches of ragged responses.

CPU time (``process_time``), one thread, best of interleaved runs; the results are checked equal.
Last line: one JSON object.

    .venv/bin/python benchmarks/gae_speed.py
"""

from __future__ import annotations

import json
import time

import torch

from torchrl_agent.objectives import token_gae
from torchrl_agent.objectives.ppo import _compact, _discount_matrix, _token_rewards


def matrix_gae(values, mask, scores, gamma, lmbda, token_rewards=None):
    """The previous ``token_gae`` (before it used TorchRL's GAE): TD errors of each left-aligned
    response times a [T, T] discount matrix. Also the reference of
    ``tests/test_objectives.py::test_token_gae_through_torchrl_equals_the_matrix_form``."""
    n, t = mask.shape
    r, length, back = _token_rewards(mask, scores, token_rewards, values.dtype)
    v, _, _ = _compact(values, mask)
    idx = torch.arange(t)[None, :]
    v_next = torch.where(idx + 1 < length[:, None], torch.cat([v[:, 1:], torch.zeros(n, 1, dtype=v.dtype)], -1), 0.0)
    delta = torch.where(idx < length[:, None], r + gamma * v_next - v, 0.0)
    adv = delta @ _discount_matrix(t, gamma * lmbda, values.dtype, values.device)
    return back(adv), back(adv + v)


def best_time(fn, rounds):
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def run(n, t, gamma, lmbda, rounds=5):
    g = torch.Generator().manual_seed(0)
    mask = torch.arange(t)[None, :] < torch.randint(1, t + 1, (n,), generator=g)[:, None]
    values = torch.randn(n, t, generator=g) * mask
    scores = torch.randn(n, generator=g)
    ours = token_gae(values, mask, scores, gamma=gamma, lmbda=lmbda, whiten=False)
    ref = matrix_gae(values, mask, scores, gamma, lmbda)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    times = {"torchrl": float("inf"), "matrix": float("inf")}
    for _ in range(rounds):  # interleaved
        times["torchrl"] = min(times["torchrl"], best_time(
            lambda: token_gae(values, mask, scores, gamma=gamma, lmbda=lmbda, whiten=False), 1))
        times["matrix"] = min(times["matrix"], best_time(lambda: matrix_gae(values, mask, scores, gamma, lmbda), 1))
    return {"rows": n, "tokens": t, "gamma": gamma, "lmbda": lmbda, "torchrl_s": round(times["torchrl"], 4),
            "matrix_s": round(times["matrix"], 4), "torchrl_over_matrix": round(times["torchrl"] / times["matrix"], 2)}


def main() -> None:
    torch.set_num_threads(1)
    cases = [run(n, t, gamma, lmbda) for n, t in [(64, 512), (256, 1500)] for gamma, lmbda in [(1.0, 1.0), (1.0, 0.95)]]
    for case in cases:
        print(case)
    print(json.dumps({"benchmark": "gae_speed", "timer": "process_time (CPU), one thread, best of 5 interleaved",
                      "results_equal": True, "cases": cases}))


if __name__ == "__main__":
    main()

"""GiGPO advantage speed: vectorised tensor ops vs a plain Python-loop (dict) implementation.

Batches of G groups x 8 trajectories x 50 steps (G = 16, the paper's setup, and G = 160).
Both implementations compute the same semantics (docs/algorithms.md) and are checked equal.
The last printed line is one JSON object (``speedup_vs_loop`` is the larger size's figure).

    python benchmarks/advantage_speed.py
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict

import torch

from torchrl_agent.objectives.functional import gigpo_advantage

GAMMA, OMEGA, PENALTY, EPS = 0.95, 1.0, 0.1, 1e-6


def make_batch(groups: int, trajs: int = 8, steps: int = 50, seed: int = 0):
    """Rows in collection order (step-major, like a batched collector), ALFWorld-like rewards."""
    g = torch.Generator().manual_seed(seed)
    n_traj = groups * trajs
    traj_group = torch.arange(n_traj) // trajs
    won = torch.rand(n_traj, generator=g) < 0.4
    step = torch.arange(steps).repeat_interleave(n_traj)  # step-major order
    traj = torch.arange(n_traj).repeat(steps)
    group = traj_group[traj]
    reward = torch.where((step == steps - 1) & won[traj], 10.0, 0.0).double()
    # anchors: 64-bit state hashes from a small per-group state space (12 states a group), so that
    # anchor groups repeat across trajectories and steps
    state_hash = torch.randint(-(2**62), 2**62, (groups, 12), generator=g)
    anchor = state_hash[group, torch.randint(0, 12, (reward.numel(),), generator=g)]
    valid = torch.rand(reward.numel(), generator=g) > 0.1
    return reward, group, traj, step, anchor, valid


def loop_gigpo(reward, group, traj, step, anchor, valid, norm="mean_std"):
    """Plain Python: dicts keyed by ids, one pass per quantity (the reference's structure)."""
    reward, group, traj, step, anchor, valid = (x.tolist() for x in (reward, group, traj, step, anchor, valid))
    n = len(reward)
    episode = defaultdict(float)
    rows_of_traj = defaultdict(list)
    for i in range(n):
        episode[traj[i]] += reward[i]
        rows_of_traj[traj[i]].append(i)
    score = [episode[traj[i]] - PENALTY * (not valid[i]) for i in range(n)]
    ret = [0.0] * n
    for rows in rows_of_traj.values():
        running = 0.0
        for i in sorted(rows, key=step.__getitem__, reverse=True):
            running = reward[i] + GAMMA * running
            ret[i] = running - PENALTY * (not valid[i])

    def normalise(values, keys, singleton_zero):
        sets = defaultdict(list)
        for i in range(n):
            sets[keys[i]].append(values[i])
        stats = {}
        for key, xs in sets.items():
            if len(xs) == 1:
                stats[key] = None
            elif max(xs) - min(xs) <= 4 * 2.220446049250313e-16 * max(abs(max(xs)), abs(min(xs))):
                stats[key] = "equal"
            else:
                m = sum(xs) / len(xs)
                stats[key] = (m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)))
        out = []
        for i in range(n):
            st = stats[keys[i]]
            if st is None:
                out.append(0.0 if singleton_zero else (values[i] if norm == "mean" else values[i] / (1 + EPS)))
            elif st == "equal":
                out.append(0.0)
            else:
                out.append(values[i] - st[0] if norm == "mean" else (values[i] - st[0]) / (st[1] + EPS))
        return out

    a_e = normalise(score, group, False)
    a_s = normalise(ret, list(zip(group, anchor)), True)
    return torch.tensor([e + OMEGA * s for e, s in zip(a_e, a_s)], dtype=torch.float64)


def interleaved_best(fn_vec, fn_loop, rounds: int, vec_per_round: int, timer) -> tuple[float, float]:
    """Best time of each, measured alternately so that both see the same machine load."""
    best_vec = best_loop = math.inf
    for _ in range(rounds):
        for _ in range(vec_per_round):
            t0 = timer()
            fn_vec()
            best_vec = min(best_vec, timer() - t0)
        t0 = timer()
        fn_loop()
        best_loop = min(best_loop, timer() - t0)
    return best_vec, best_loop


def run_size(groups: int, rounds: int, vec_per_round: int) -> dict:
    batch = make_batch(groups)
    n = batch[0].numel()
    vec = gigpo_advantage(*batch, gamma=GAMMA, omega=OMEGA, invalid_penalty=PENALTY)
    ref = loop_gigpo(*batch)
    torch.testing.assert_close(vec, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(
        gigpo_advantage(*batch, gamma=GAMMA, omega=OMEGA, invalid_penalty=PENALTY, norm="mean"),
        loop_gigpo(*batch, norm="mean"),
        rtol=1e-9,
        atol=1e-9,
    )
    fns = (lambda: gigpo_advantage(*batch, gamma=GAMMA, omega=OMEGA, invalid_penalty=PENALTY),
           lambda: loop_gigpo(*batch))
    # CPU time of this process (robust to other processes sharing the machine) and wall-clock time
    t_vec, t_loop = interleaved_best(*fns, rounds, vec_per_round, time.process_time)
    w_vec, w_loop = interleaved_best(*fns, max(2, rounds // 2), vec_per_round, time.perf_counter)
    res = {
        "groups": groups,
        "rows": n,
        "vectorised_cpu_s": round(t_vec, 6),
        "loop_cpu_s": round(t_loop, 6),
        "speedup_vs_loop": round(t_loop / t_vec, 1),
        "speedup_vs_loop_wall": round(w_loop / w_vec, 1),
        "rows_per_s_vectorised": round(n / t_vec),
        "rows_per_s_loop": round(n / t_loop),
    }
    print(f"{groups:4d} groups, {n:6d} rows: vectorised {t_vec * 1e3:8.2f} ms, loop {t_loop * 1e3:8.1f} ms "
          f"(CPU time), speedup {res['speedup_vs_loop']}x (wall clock: {res['speedup_vs_loop_wall']}x)")
    return res


def main() -> None:
    # one core for both sides: the loop is single-threaded, and the CI machine is shared
    torch.set_num_threads(1)
    gigpo_advantage(*make_batch(2))  # warm-up
    small = run_size(16, rounds=15, vec_per_round=10)
    large = run_size(160, rounds=8, vec_per_round=5)
    print(json.dumps({
        "benchmark": "gigpo_advantage_speed",
        "speedup_vs_loop": large["speedup_vs_loop"],
        "speedup_vs_loop_16_groups": small["speedup_vs_loop"],
        "speedup_vs_loop_160_groups": large["speedup_vs_loop"],
        "speedup_vs_loop_wall_16_groups": small["speedup_vs_loop_wall"],
        "speedup_vs_loop_wall_160_groups": large["speedup_vs_loop_wall"],
        "timer": "process_time (CPU), best of interleaved runs",
        "rows_per_s_vectorised_16_groups": small["rows_per_s_vectorised"],
        "rows_per_s_loop_16_groups": small["rows_per_s_loop"],
        "rows_per_s_vectorised_160_groups": large["rows_per_s_vectorised"],
        "rows_per_s_loop_160_groups": large["rows_per_s_loop"],
        "rows_16_groups": small["rows"],
        "rows_160_groups": large["rows"],
        "torch_threads": torch.get_num_threads(),
        "results_equal": True,
    }))


if __name__ == "__main__":
    main()

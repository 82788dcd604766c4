"""GiGPO, HGPO and GraphGPO advantage speed: vectorised tensor ops vs plain Python-loop (dict) implementations.

Batches of G groups x 8 trajectories x 50 steps (G = 16, the paper's setup, and G = 160: 64,000 rows).
Each loop implementation restates the reference's algorithm (dicts keyed by ids, walked row by row:
verl-agent's core_gigpo.py, recipe/hgpo/core_hgpo.py ``hgpo_advantage_estimate`` with K = 2, and
recipe/GraphGPO/core_graph.py's graph, reverse Dijkstra and step/episode norms) with the semantics
of docs/algorithms.md; each pair is checked equal. HGPO and GraphGPO run on the 160-group batch,
timed in the same interleaved rounds as GiGPO. The last printed line is one JSON object
(``speedup_vs_loop`` is GiGPO's larger size's figure; ``hgpo_vs_gigpo`` / ``graphgpo_vs_gigpo`` the
time ratios to GiGPO's vectorised time).

    python benchmarks/advantage_speed.py [--new-only]
"""

from __future__ import annotations

import heapq
import json
import math
import time
from collections import defaultdict

import torch

from torchrl_agent.objectives.functional import gigpo_advantage, graphgpo_advantage, hgpo_advantage

GAMMA, OMEGA, PENALTY, EPS = 0.95, 1.0, 0.1, 1e-6
K_HISTORY, ALPHA, GRAPH_GAMMA = 2, 1.0, 0.1  # HGPO's K and alpha, GraphGPO's ALFWorld gamma
_ULP = 4 * 2.220446049250313e-16


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


def next_anchors(traj, step, anchor, seed: int = 1):
    """The anchor of the state each row led to: the next row's, a random state of the group's for the last."""
    g = torch.Generator().manual_seed(seed)
    following = {(t, s): a for t, s, a in zip(traj.tolist(), step.tolist(), anchor.tolist())}
    pool = anchor[torch.randint(0, anchor.numel(), (anchor.numel(),), generator=g)].tolist()
    return torch.tensor([following.get((t, s + 1), pool[i]) for i, (t, s) in enumerate(zip(traj.tolist(),
                                                                                           step.tolist()))])


def _stats(xs, unbiased, mags=()):
    """(mean, std) of a list, or None when all equal up to rounding (the all-equal rule of
    docs/algorithms.md; ``mags``: the magnitudes of the terms the values were computed from)."""
    if max(xs) - min(xs) <= _ULP * max(abs(max(xs)), abs(min(xs)), *mags):
        return None
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - unbiased))


def loop_hgpo(reward, group, traj, step, anchor, valid):
    """Plain Python, the reference's structure: per group, per trajectory the anchor history; a dict of
    clusters ``(k, anchors)``; per cluster the population statistics; per row its items, aggregated."""
    reward, group, traj, step, anchor, valid = (x.tolist() for x in (reward, group, traj, step, anchor, valid))
    n = len(reward)
    rows_of_traj = defaultdict(list)
    for i in range(n):
        rows_of_traj[traj[i]].append(i)
    ret, mag, hist = [0.0] * n, [0.0] * n, [None] * n
    for rows in rows_of_traj.values():
        rows.sort(key=step.__getitem__)
        running = running_abs = 0.0
        for i in reversed(rows):
            running = reward[i] + GAMMA * running
            running_abs = abs(reward[i]) + GAMMA * running_abs
            ret[i] = running - PENALTY * (not valid[i])
            mag[i] = running_abs + PENALTY * (not valid[i])
        for s, i in enumerate(rows):
            hist[i] = [anchor[j] for j in rows[max(0, s - K_HISTORY):s + 1]]
    clusters = defaultdict(list)
    for i in range(n):
        for k in range(1, len(hist[i]) + 1):
            clusters[(group[i], k, tuple(hist[i][-k:]))].append(i)
    items = defaultdict(list)
    for (_, k, _), rows in clusters.items():
        if len(rows) < 2:
            continue
        xs = [ret[i] for i in rows]
        st = _stats(xs, unbiased=False, mags=[mag[i] for i in rows])
        if st is None:
            continue
        tol = len(rows) * _ULP * max(abs(max(xs)), abs(min(xs)), *(mag[i] for i in rows))
        for i in rows:
            d = ret[i] - st[0]
            if abs(d) > tol:
                items[i].append((k, d / (st[1] + EPS)))
    out = []
    for i in range(n):
        w = [(k + 1) ** ALPHA for k, _ in items[i]]
        out.append(sum(wi * a for wi, (_, a) in zip(w, items[i])) / (sum(w) + EPS) if w else 0.0)
    return torch.tensor(out, dtype=torch.float64)


def loop_graphgpo(reward, group, traj, step, anchor, valid, next_anchor):
    """Plain Python, the reference's structure: per group a dict graph ``u -> {v: [edges]}`` from every
    row (a won trajectory's last row -> ``"success"``), reverse Dijkstra from the sink with a heap,
    ``10 gamma^d(next)``, then GiGPO's anchor-group and episode normalisations with dicts."""
    reward, group, traj, step, anchor, valid, next_anchor = (
        x.tolist() for x in (reward, group, traj, step, anchor, valid, next_anchor))
    n = len(reward)
    episode, last = defaultdict(float), {}
    for i in range(n):
        episode[traj[i]] += reward[i]
        if traj[i] not in last or step[i] > step[last[traj[i]]]:
            last[traj[i]] = i
    nxt = ["success" if last[traj[i]] == i and episode[traj[i]] > 0 else next_anchor[i] for i in range(n)]
    graphs = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i in range(n):
        graphs[group[i]][anchor[i]][nxt[i]].append(1.0)
    dist = {}
    for gid, graph in graphs.items():
        reverse, nodes = defaultdict(list), set()
        for u, targets in graph.items():
            nodes.add(u)
            for v, edges in targets.items():
                nodes.add(v)
                reverse[v] += [(u, w) for w in edges]
        d = {x: math.inf for x in nodes}
        d["success"] = 0
        heap = [(0, "success")]
        while heap:
            cost, v = heapq.heappop(heap)
            if cost > d[v]:
                continue
            for u, w in reverse[v]:
                if cost + w < d[u]:
                    d[u] = cost + w
                    heapq.heappush(heap, (cost + w, u))
        far = max([x for x in d.values() if x != math.inf], default=0)
        for x, v in d.items():
            dist[(gid, x)] = far + 1 if v == math.inf else v
    raw = [10 * GRAPH_GAMMA ** dist[(group[i], nxt[i])] for i in range(n)]
    ret = [raw[i] - PENALTY * (not valid[i]) for i in range(n)]
    score = [episode[traj[i]] - PENALTY * (not valid[i]) for i in range(n)]

    def normalise(values, keys, singleton_zero, mags=None):
        sets, set_mags = defaultdict(list), defaultdict(list)
        for i in range(n):
            sets[keys[i]].append(values[i])
            if mags is not None:
                set_mags[keys[i]].append(mags[i])
        stats = {key: (None if len(xs) == 1 else _stats(xs, unbiased=True, mags=set_mags[key]))
                 for key, xs in sets.items()}
        out = []
        for i in range(n):
            xs, st = sets[keys[i]], stats[keys[i]]
            if len(xs) == 1:
                out.append(0.0 if singleton_zero else values[i] / (1 + EPS))
            else:
                out.append(0.0 if st is None else (values[i] - st[0]) / (st[1] + EPS))
        return out

    a_s = normalise(ret, list(zip(group, anchor)), True, [raw[i] + PENALTY * (not valid[i]) for i in range(n)])
    a_e = normalise(score, group, False)
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


def run_new_estimators(groups: int, rounds: int, vec_per_round: int) -> dict:
    """HGPO and GraphGPO on the same batch as GiGPO, all three timed in the same interleaved rounds."""
    batch = make_batch(groups)
    nxt = next_anchors(batch[2], batch[3], batch[4])
    fns = {
        "gigpo": (lambda: gigpo_advantage(*batch, gamma=GAMMA, omega=OMEGA, invalid_penalty=PENALTY),
                  lambda: loop_gigpo(*batch)),
        "hgpo": (lambda: hgpo_advantage(*batch, history_length=K_HISTORY, gamma=GAMMA, alpha=ALPHA,
                                        invalid_penalty=PENALTY),
                 lambda: loop_hgpo(*batch)),
        "graphgpo": (lambda: graphgpo_advantage(*batch, next_anchor=nxt, gamma=GRAPH_GAMMA, step_weight=OMEGA,
                                                invalid_penalty=PENALTY),
                     lambda: loop_graphgpo(*batch, nxt)),
    }
    for name in ("hgpo", "graphgpo"):
        torch.testing.assert_close(fns[name][0](), fns[name][1](), rtol=1e-9, atol=1e-9)
    best = {name: [math.inf, math.inf] for name in fns}
    for _ in range(rounds):
        for name, (vec, loop) in fns.items():
            for _ in range(vec_per_round):
                t0 = time.process_time()
                vec()
                best[name][0] = min(best[name][0], time.process_time() - t0)
            t0 = time.process_time()
            loop()
            best[name][1] = min(best[name][1], time.process_time() - t0)
    n = batch[0].numel()
    res = {"rows": n}
    for name, (t_vec, t_loop) in best.items():
        res[f"{name}_vectorised_cpu_s"] = round(t_vec, 6)
        res[f"{name}_loop_cpu_s"] = round(t_loop, 6)
        res[f"{name}_speedup_vs_loop"] = round(t_loop / t_vec, 1)
        print(f"{name:9s} {n:6d} rows: vectorised {t_vec * 1e3:8.2f} ms, loop {t_loop * 1e3:8.1f} ms (CPU time), "
              f"speedup {t_loop / t_vec:.1f}x, {t_vec / best['gigpo'][0]:.2f}x GiGPO's time")
    res["hgpo_vs_gigpo"] = round(best["hgpo"][0] / best["gigpo"][0], 2)
    res["graphgpo_vs_gigpo"] = round(best["graphgpo"][0] / best["gigpo"][0], 2)
    return res


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-only", action="store_true",
                        help="only the HGPO / GraphGPO / GiGPO comparison at 160 groups (its JSON line)")
    args = parser.parse_args()
    # one core for both sides: the loop is single-threaded, and the CI machine is shared
    torch.set_num_threads(1)
    gigpo_advantage(*make_batch(2))  # warm-up
    if args.new_only:
        print(json.dumps({"benchmark": "hgpo_graphgpo_advantage_speed", "hgpo_k": K_HISTORY,
                          "graphgpo_gamma": GRAPH_GAMMA, **run_new_estimators(160, rounds=3, vec_per_round=5),
                          "timer": "process_time (CPU), best of interleaved runs", "results_equal": True}))
        return
    small = run_size(16, rounds=15, vec_per_round=10)
    large = run_size(160, rounds=8, vec_per_round=5)
    new = run_new_estimators(160, rounds=5, vec_per_round=5)
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
        "hgpo_k": K_HISTORY,
        "graphgpo_gamma": GRAPH_GAMMA,
        **{k: v for k, v in new.items() if k != "rows"},
        "torch_threads": torch.get_num_threads(),
        "results_equal": True,
    }))


if __name__ == "__main__":
    main()

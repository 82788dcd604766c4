"""HGPOAdvantage / hgpo_advantage: the worked example, a loop restatement of the reference
(verl-agent recipe/hgpo/core_hgpo.py, hgpo_advantage_estimate) on 200 random batches, and the module."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from fractions import Fraction

import pytest
import torch
from tensordict import TensorDict

from torchrl_agent.objectives import GiGPOAdvantage, HGPOAdvantage, grpo_advantage, hgpo_advantage

EPS = 1e-6


def loop_hgpo(rows, *, K, gamma, alpha, base, c, norm, eps=EPS):
    """The reference's semantics restated over a list of row dicts, in exact arithmetic (``Fraction`` s of
    the decimal values): returns, means and "is this item 0" are exact; only the std and the division
    are floats.

    Per group, each trajectory's rows in step order; a row at rank s joins the cluster
    ``(k, anchors s-k+1..s)`` for k = 1..min(K+1, s+1); a cluster of n >= 2 rows gives each member
    ``(R - mean) / (population std + eps)`` (``mean``: ``R - mean``); with ``base``, ``(0, A_E)`` first
    (A_E: episode score normalised over the group's rows, unbiased std, a one-row group: mean 0, std 1).
    Items equal to 0 are dropped; ``A = sum w a / (sum w + eps)``, ``w = (k + 1) ** alpha``."""
    g, c = Fraction(str(gamma)), Fraction(str(c))
    episode = defaultdict(Fraction)
    by_traj = defaultdict(list)
    for i, r in enumerate(rows):
        episode[r["traj"]] += Fraction(str(r["reward"]))
        by_traj[r["traj"]].append(i)
    ret, hist = {}, {}
    for members in by_traj.values():
        members.sort(key=lambda i: rows[i]["step"])
        running = Fraction(0)
        for i in reversed(members):
            running = Fraction(str(rows[i]["reward"])) + g * running
            ret[i] = running - c * (not rows[i]["valid"])
        for s, i in enumerate(members):
            hist[i] = tuple(rows[j]["anchor"] for j in members[: s + 1])

    def normed(values, unbiased):
        n = len(values)
        m = sum(values, Fraction(0)) / n
        sd = math.sqrt(float(sum((v - m) ** 2 for v in values)) / (n - 1 if unbiased else n))
        return [0.0 if v == m else float(v - m) if norm == "mean" else float(v - m) / (sd + eps) for v in values]

    items = defaultdict(list)
    if base:
        by_group = defaultdict(list)
        for i, r in enumerate(rows):
            by_group[r["group"]].append(i)
        for members in by_group.values():
            scores = [episode[rows[i]["traj"]] - c * (not rows[i]["valid"]) for i in members]
            if len(members) == 1:
                a0 = [float(scores[0]) if norm == "mean" else float(scores[0]) / (1 + eps)]
            else:
                a0 = normed(scores, unbiased=True)
            for i, a in zip(members, a0):
                items[i].append((0, a))
    for k in range(1, K + 2):
        clusters = defaultdict(list)
        for i, r in enumerate(rows):
            if len(hist[i]) >= k:
                clusters[(r["group"], hist[i][-k:])].append(i)
        for members in clusters.values():
            if len(members) >= 2:
                for i, a in zip(members, normed([ret[i] for i in members], unbiased=False)):
                    items[i].append((k, a))
    out = []
    for i in range(len(rows)):
        kept = [(k, a) for k, a in items[i] if a != 0]
        w = [(k + 1) ** alpha for k, _ in kept]
        out.append(sum(wi * a for wi, (_, a) in zip(w, kept)) / (sum(w) + eps) if kept else 0.0)
    return torch.tensor(out, dtype=torch.float64)


def random_rows(rng: random.Random):
    """Ragged trajectories in shuffled order: singleton groups, groups without success (all-equal
    returns), invalid actions, intermediate rewards, anchors shared across groups."""
    rows, tid = [], 0
    for group in range(rng.randint(1, 4)):
        states = rng.sample(range(8), rng.randint(1, 5))
        p_win = rng.choice([0.0, 0.5, 1.0])
        for _ in range(rng.choice([1, 1, 2, 4, 6])):
            length, won = rng.randint(1, 7), rng.random() < p_win
            for step in range(length):
                reward = 10.0 if won and step == length - 1 else rng.choice([0.0] * 8 + [1.0, -0.5])
                rows.append(dict(group=group, traj=tid, step=step, anchor=rng.choice(states), reward=reward,
                                 valid=rng.random() > 0.15))
            tid += 1
    rng.shuffle(rows)
    return rows


def as_tensors(rows, dtype=torch.float64):
    col = lambda k, dt=torch.int64: torch.tensor([r[k] for r in rows], dtype=dt)  # noqa: E731
    return (col("reward", dtype), col("group"), col("traj"), col("step"), col("anchor"), col("valid", torch.bool))


def worked_example():
    """docs/algorithms.md: one group, anchors T1 = A,B,C (wins, 10 at the end); T2 = A,B,C; T3 = A,C,C."""
    a, b, c = 11, 22, 33
    anchor = torch.tensor([a, b, c, a, b, c, a, c, c])
    traj, step = torch.arange(3).repeat_interleave(3), torch.arange(3).repeat(3)
    reward = torch.tensor([0, 0, 10.0, 0, 0, 0, 0, 0, 0], dtype=torch.float64)
    return reward, torch.zeros(9, dtype=torch.int64), traj, step, anchor


def test_worked_example():
    out = hgpo_advantage(*worked_example(), history_length=1, gamma=0.95)
    expected = torch.tensor([[1.4142, 1.0, 1.2928], [-0.7071, -1.0, -0.8309], [-0.7071, -0.5773, -0.5773]],
                            dtype=torch.float64)
    torch.testing.assert_close(out.view(3, 3), expected, atol=1e-4, rtol=0)
    # T1's last step by hand: C at k=1 (returns 10, 0, 0, 0) -> sqrt(3); (B, C) at k=2 (10, 0) -> 1
    assert out[2].item() == pytest.approx((2 * math.sqrt(3) / (1 + EPS * math.sqrt(3 / 16) * 4) + 3 * 1) / 5, abs=1e-5)


def test_matches_the_loop_restatement_on_200_random_batches():
    rng = random.Random(0)
    worst = 0.0
    for _ in range(200):
        rows = random_rows(rng)
        K, alpha, base = rng.choice([0, 1, 2, 4]), rng.choice([1.0, 0.5, 2.0]), rng.random() < 0.5
        norm, gamma = rng.choice(["mean_std", "mean"]), rng.choice([0.95, 0.5, 0.1])
        out = hgpo_advantage(*as_tensors(rows), history_length=K, gamma=gamma, alpha=alpha, base_group=base, norm=norm)
        expected = loop_hgpo(rows, K=K, gamma=gamma, alpha=alpha, base=base, c=0.1, norm=norm)
        worst = max(worst, (out - expected).abs().max().item())
    assert worst < 1e-9, worst


def test_permutation_equivariant_and_history_zero_is_exact_anchor_groups():
    rows = random_rows(random.Random(3))
    reward, group, traj, step, anchor, valid = as_tensors(rows)
    out = hgpo_advantage(reward, group, traj, step, anchor, valid, history_length=2)
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))
    out_p = hgpo_advantage(reward[perm], group[perm], traj[perm], step[perm], anchor[perm], valid[perm],
                           history_length=2)
    torch.testing.assert_close(out_p, out[perm], rtol=0, atol=1e-12)
    # K = 0 with one item per row: the GiGPO step term with the population std, all-equal/at-mean rows 0
    k0 = hgpo_advantage(reward, group, traj, step, anchor, valid, history_length=0, norm="mean")
    gigpo_step = GiGPOAdvantage(norm="mean", omega=1.0)
    td = TensorDict(dict(reward=reward, group_id=group, traj_id=traj, step_count=step, anchor=anchor,
                         action_valid=valid), batch_size=[len(rows)])
    a_step = gigpo_step(td)["advantage"].squeeze(-1) - grpo_advantage(reward, group, traj, valid, norm="mean")
    torch.testing.assert_close(k0, a_step / (2 + EPS) * 2, rtol=0, atol=1e-9)  # one item: 2a / (2 + eps)


@pytest.mark.parametrize("value, n", [(9.025, 7), (0.9, 3), (1.4, 7)])
def test_all_equal_groups_give_no_item_in_float32(value, n):
    # the reference computes a group's (r - mean) / (std + 1e-6) in float32: for n equal values
    # the rounded mean differs from them and the item is not 0 (it is kept and weighted)
    x = torch.full((n,), value, dtype=torch.float32)
    assert ((x - x.mean()) / (x.std(unbiased=False) + EPS)).abs().max() > 1e-2
    # here: one group of n one-step trajectories, same anchor, same return -> no item, A = 0
    reward = torch.full((n,), value, dtype=torch.float32)
    z = torch.zeros(n, dtype=torch.int64)
    out = hgpo_advantage(reward, z, torch.arange(n), z, z, history_length=2)
    assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(n))
    # a row exactly at its group's mean is dropped as well: only the base item is left
    reward = torch.tensor([0.0, 10.0, 5.0], dtype=torch.float64)
    out = hgpo_advantage(reward, torch.zeros(3, dtype=torch.int64), torch.arange(3), torch.zeros(3, dtype=torch.int64),
                         torch.zeros(3, dtype=torch.int64), base_group=True, norm="mean")
    assert out[2].item() == 0.0  # episode score 5 is the group mean too
    assert out[0].item() == pytest.approx((-5 + 2 * -5) / (3 + EPS))


def test_cancelling_returns_are_equal():
    # gamma 0.1: 10 * 0.1**2 - 0.1 (an invalid step two steps before a win) is 1.4e-17 in float64, the
    # same state's return in a failed trajectory is 0: equal up to rounding, so no item (as the
    # reference's recursion, which gives exactly 0)
    reward = torch.tensor([0, 0, 10.0, 0, 0, 0], dtype=torch.float64)
    traj, step = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 1, 2, 0, 1, 2])
    anchor = torch.tensor([1, 2, 3, 1, 4, 5])
    valid = torch.tensor([False, True, True, True, True, True])
    out = hgpo_advantage(reward, torch.zeros(6, dtype=torch.int64), traj, step, anchor, valid, gamma=0.1,
                         history_length=0)
    assert out[0].item() == 0.0 and out[3].item() == 0.0


def test_module_keys_shapes_and_errors():
    reward, group, traj, step, anchor = worked_example()
    td = TensorDict({("next", "reward"): reward[:, None, None], "gid": group, "traj_id": traj,
                     "step_count": step[:, None], "anchor": anchor}, batch_size=[9])
    module = HGPOAdvantage(history_length=1)
    module.set_keys(reward=("next", "reward"), group_id="gid")
    out = module(td)["advantage"]
    assert out.shape == (9, 1) and out.dtype == torch.float64
    torch.testing.assert_close(out.squeeze(-1), hgpo_advantage(reward, group, traj, step, anchor, history_length=1))
    # [B, T] batches are read as rows
    td2 = TensorDict(dict(reward=reward.view(3, 3), group_id=group.view(3, 3), traj_id=traj.view(3, 3),
                          step_count=step.view(3, 3), anchor=anchor.view(3, 3)), batch_size=[3, 3])
    torch.testing.assert_close(HGPOAdvantage(history_length=1)(td2)["advantage"].reshape(-1), out.reshape(-1))
    with pytest.raises(ValueError, match="history_length"):
        HGPOAdvantage(history_length=-1)
    with pytest.raises(ValueError, match="norm"):
        HGPOAdvantage(norm="std")
    with pytest.raises(KeyError, match="anchor"):
        module(td.exclude("anchor"))

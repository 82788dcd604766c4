"""Tests for torchrl_agent.objectives: hand-computed estimators, properties, losses, PPO GAE, DAPO."""

from __future__ import annotations

import importlib.util
import math
import os
from collections import defaultdict
from difflib import SequenceMatcher

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.objectives.llm import GRPOLoss

from torchrl_agent.objectives import (
    AdaptiveKLController,
    ClipPolicyLoss,
    DynamicSamplingAccumulator,
    DynamicSamplingFilter,
    FixedKLController,
    GiGPOAdvantage,
    GRPOAdvantage,
    GRPOPassKAdvantage,
    PPOLoss,
    ReinforcePlusPlusAdvantage,
    ReinforcePlusPlusBaselineAdvantage,
    ReMaxAdvantage,
    RLOOAdvantage,
    aggregate,
    discounted_step_returns,
    episode_scores,
    gigpo_advantage,
    grpo_advantage,
    grpo_passk_advantage,
    informative_group_mask,
    kl_estimate,
    kl_in_reward,
    reinforce_pp_baseline_advantage,
    remax_advantage,
    rloo_advantage,
    similarity_anchor_ids,
    token_gae,
    token_reinforce_pp,
)

EPS = 1e-6


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def ids(x):
    return torch.tensor(x, dtype=torch.int64)


def mean_std(xs):
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return m, s


# --------------------------------------------------------------------------- a loop reference
def loop_gigpo(reward, group, traj, step, anchor, valid, gamma, omega, c, norm, eps=EPS):
    """Dict-based re-statement of docs/algorithms.md (rows walked one by one), for property tests."""
    reward, group, traj, step, anchor, valid = (x.tolist() for x in (reward, group, traj, step, anchor, valid))
    n = len(reward)
    ep = defaultdict(float)
    for i in range(n):
        ep[traj[i]] += reward[i]
    score = [ep[traj[i]] - c * (1 - valid[i]) for i in range(n)]
    rows_of_traj = defaultdict(list)
    for i in range(n):
        rows_of_traj[traj[i]].append(i)
    ret = [0.0] * n
    for rows in rows_of_traj.values():
        running = 0.0
        for i in sorted(rows, key=lambda j: step[j], reverse=True):
            running = reward[i] + gamma * running
            ret[i] = running
    ret = [ret[i] - c * (1 - valid[i]) for i in range(n)]

    def normed(values, keys, singleton_zero):
        sets = defaultdict(list)
        for i in range(n):
            sets[keys[i]].append(values[i])
        out = []
        for i in range(n):
            xs = sets[keys[i]]
            if len(xs) == 1:
                out.append(0.0 if singleton_zero else values[i])
                continue
            if max(xs) == min(xs):
                out.append(0.0)
                continue
            m, s = mean_std(xs)
            out.append(values[i] - m if norm == "mean" else (values[i] - m) / (s + eps))
        return out

    a_e = normed(score, group, False)
    a_s = normed(ret, list(zip(group, anchor)), True)
    return torch.tensor([a + omega * b for a, b in zip(a_e, a_s)], dtype=torch.float64)


def random_rows(seed, groups=3, trajs=3, max_len=6, n_anchor=4):
    g = torch.Generator().manual_seed(seed)
    reward, group, traj, step, anchor, valid = [], [], [], [], [], []
    tid = 0
    for gi in range(groups):
        for _ in range(trajs):
            length = int(torch.randint(1, max_len + 1, (1,), generator=g))
            for s in range(length):
                reward.append(float(torch.randint(0, 3, (1,), generator=g)) * 0.5)
                group.append(gi)
                traj.append(tid)
                step.append(s)
                anchor.append(int(torch.randint(0, n_anchor, (1,), generator=g)))
                valid.append(bool(torch.rand(1, generator=g) > 0.2))
            tid += 1
    perm = torch.randperm(len(reward), generator=g)  # rows in any order
    return (t(reward)[perm], ids(group)[perm], ids(traj)[perm], ids(step)[perm], ids(anchor)[perm],
            torch.tensor(valid)[perm])


# --------------------------------------------------------------------------- GRPO / RLOO / REINFORCE++
def test_grpo_by_hand_rows_not_trajectories_and_invalid_penalty():
    # group 0: traj 0 has 2 rows (episode reward 1), traj 1 has 1 row (0); row 1 is invalid
    reward, group, traj = t([0.0, 1.0, 0.0]), ids([0, 0, 0]), ids([0, 0, 1])
    valid = torch.tensor([True, False, True])
    s = [1.0, 0.9, 0.0]  # scores: episode reward - 0.1 for the invalid row
    m, sd = mean_std(s)
    expected = t([(x - m) / (sd + EPS) for x in s])
    torch.testing.assert_close(grpo_advantage(reward, group, traj, valid), expected)
    torch.testing.assert_close(grpo_advantage(reward, group, traj, valid, norm="mean"), t([x - m for x in s]))
    # all valid: statistics over the 3 rows [1, 1, 0]: mean 2/3, std sqrt(1/3)
    expected = t([1 / 3, 1 / 3, -2 / 3]) / (math.sqrt(1 / 3) + EPS)
    torch.testing.assert_close(grpo_advantage(reward, group, traj, None), expected)


def test_singleton_group_is_raw_score():
    # group 7 has one row: mean 0, std 1 -> the raw score (minus the invalid penalty)
    reward, group, traj = t([3.0, 1.0, 2.0]), ids([7, 1, 1]), ids([0, 1, 2])
    valid = torch.tensor([False, True, True])
    out = grpo_advantage(reward, group, traj, valid)
    assert out[0].item() == pytest.approx(2.9)
    assert rloo_advantage(reward, group, traj, valid)[0].item() == pytest.approx(2.9)
    assert grpo_advantage(reward, group, traj, valid, norm="mean")[0].item() == pytest.approx(2.9)


def test_rloo_by_hand():
    # group of 3 rows, scores [3, 0, 0]: (S - 1) * 3/2
    out = rloo_advantage(t([3.0, 0.0, 0.0]), ids([0, 0, 0]), ids([0, 1, 2]))
    torch.testing.assert_close(out, t([3.0, -1.5, -1.5]))


def test_reinforce_pp_baseline_by_hand():
    # groups {0: [2, 0]}, {1: [5, 5]} -> centred [1, -1, 0, 0] -> whitened over the batch
    out = reinforce_pp_baseline_advantage(t([2.0, 0.0, 5.0, 5.0]), ids([0, 0, 1, 1]), ids([0, 1, 2, 3]))
    var = 2 / 3  # the reference: (x - mean) * rsqrt(var + 1e-8)
    torch.testing.assert_close(out, t([1 / math.sqrt(var + 1e-8), -1 / math.sqrt(var + 1e-8), 0.0, 0.0]))


@pytest.mark.parametrize("value", [1.4, -0.1, 8.9, 0.7])
def test_all_equal_float32_gives_exact_zero(value):
    n = 7
    reward = torch.full((n,), value, dtype=torch.float32)
    group, traj = torch.zeros(n, dtype=torch.int64), torch.arange(n)
    # the reference's float32 statistics are not zero on such values (known defect)
    x = torch.tensor([value] * n, dtype=torch.float32)
    naive = (x - x.mean()) / (x.std() + EPS)
    if value != 0.7:
        assert naive.abs().max() > 1e-3
    for fn in (grpo_advantage, rloo_advantage, reinforce_pp_baseline_advantage):
        out = fn(reward, group, traj)
        assert out.dtype == torch.float32
        assert torch.equal(out, torch.zeros(n)), fn.__name__
    step, anchor = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    out = gigpo_advantage(reward, group, traj, step, anchor, torch.ones(n, dtype=torch.bool))
    assert torch.equal(out, torch.zeros(n))
    # all-equal episode rewards built from different per-step rewards
    reward = torch.tensor([0.1, 0.2, 0.3, 0.3, 0.2, 0.1, 0.6], dtype=torch.float32)
    group, traj = torch.zeros(7, dtype=torch.int64), ids([0, 0, 0, 1, 1, 1, 2])
    assert torch.equal(grpo_advantage(reward, group, traj), torch.zeros(7))


# --------------------------------------------------------------------------- GiGPO
def test_discounted_returns_by_hand_any_order():
    reward, traj, step = t([1.0, 0.0, 0.0, 2.0, 1.0]), ids([0, 0, 0, 1, 1]), ids([2, 0, 1, 1, 0])
    # traj 0 in step order: rewards [0, 0, 1] -> returns [0.25, 0.5, 1]; traj 1: [1, 2] -> [2, 2]
    torch.testing.assert_close(discounted_step_returns(reward, traj, step, gamma=0.5), t([1.0, 0.25, 0.5, 2.0, 2.0]))


def test_discounted_returns_use_rank_with_gaps_and_negative_steps():
    # steps with gaps / offsets: the rank inside the trajectory is the time index (reference walks rows in order)
    reward, traj, step = t([1.0, 0.0, 0.0, 2.0, 1.0]), ids([0, 0, 0, 1, 1]), ids([70, 3, 9, -4, -5])
    torch.testing.assert_close(discounted_step_returns(reward, traj, step, gamma=0.5), t([1.0, 0.25, 0.5, 2.0, 2.0]))


def test_gigpo_with_64bit_hash_anchors_matches_loop():
    reward, group, traj, step, anchor, valid = random_rows(6, groups=4, trajs=4, max_len=8)
    hashes = torch.randint(-(2**62), 2**62, (4, 4), generator=torch.Generator().manual_seed(1))
    anchor = hashes[group, anchor]  # one hash per (group, state): no anchor value shared by two groups
    out = gigpo_advantage(reward, group, traj, step, anchor, valid)
    torch.testing.assert_close(out, loop_gigpo(reward, group, traj, step, anchor, valid, 0.95, 1.0, 0.1, "mean_std"))
    shared = hashes[0][anchor.remainder(4)]  # now the same hash values appear in every group
    out = gigpo_advantage(reward, group, traj, step, shared, valid, norm="mean")
    torch.testing.assert_close(out, loop_gigpo(reward, group, traj, step, shared, valid, 0.95, 1.0, 0.1, "mean"))


def test_discounted_returns_long_trajectory_is_stable():
    n = 50
    reward = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = discounted_step_returns(reward, torch.zeros(n, dtype=torch.int64), torch.arange(n), gamma=0.3)
    running, expected = 0.0, [0.0] * n
    for i in reversed(range(n)):
        running = reward[i].item() + 0.3 * running
        expected[i] = running
    torch.testing.assert_close(out, t(expected), rtol=1e-12, atol=1e-12)


def _gigpo_case():
    # group 0: traj 0 rewards [0, 0, 1] valid [1, 0, 1], anchors [10, 20, 30];
    #          traj 1 rewards [0, 1], anchors [10, 30]; group 1: one row, reward 3 (singleton)
    reward = t([0.0, 0.0, 1.0, 0.0, 1.0, 3.0])
    group = ids([0, 0, 0, 0, 0, 1])
    traj = ids([0, 0, 0, 1, 1, 2])
    step = ids([0, 1, 2, 0, 1, 0])
    anchor = ids([10, 20, 30, 10, 30, 10])
    valid = torch.tensor([True, False, True, True, True, True])
    return reward, group, traj, step, anchor, valid


def test_gigpo_by_hand_mean():
    reward, group, traj, step, anchor, valid = _gigpo_case()
    # returns (gamma 0.5): traj 0 [0.25, 0.5 - 0.1 (penalty after discounting), 1]; traj 1 [0.5, 1]
    # episode term: scores [1, 0.9, 1, 1, 1] mean 0.98; singleton group 1 -> raw 3
    a_e = [0.02, -0.08, 0.02, 0.02, 0.02, 3.0]
    # step term: anchor 10 {0.25, 0.5} -> -+0.125; anchor 20 alone -> 0; anchor 30 {1, 1} -> 0;
    # group 1's anchor 10 is a different anchor group (singleton) -> 0
    a_s = [-0.125, 0.0, 0.0, 0.125, 0.0, 0.0]
    out = gigpo_advantage(reward, group, traj, step, anchor, valid, gamma=0.5, omega=2.0, norm="mean")
    torch.testing.assert_close(out, t([e + 2.0 * s for e, s in zip(a_e, a_s)]))


def test_gigpo_by_hand_mean_std():
    reward, group, traj, step, anchor, valid = _gigpo_case()
    m, sd = mean_std([1, 0.9, 1, 1, 1])
    a_e = [(x - m) / (sd + EPS) for x in [1, 0.9, 1, 1, 1]] + [3.0 / (1 + EPS)]  # singleton: std 1
    s10 = 0.125 / (math.sqrt(2 * 0.125**2) + EPS)
    a_s = [-s10, 0.0, 0.0, s10, 0.0, 0.0]
    out = gigpo_advantage(reward, group, traj, step, anchor, valid, gamma=0.5)
    torch.testing.assert_close(out, t([e + s for e, s in zip(a_e, a_s)]))
    assert out.dtype == torch.float64


@pytest.mark.parametrize("norm", ["mean_std", "mean"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gigpo_matches_loop_reference_and_is_permutation_equivariant(norm, seed):
    reward, group, traj, step, anchor, valid = random_rows(seed)
    out = gigpo_advantage(reward, group, traj, step, anchor, valid, gamma=0.9, omega=0.7, norm=norm)
    expected = loop_gigpo(reward, group, traj, step, anchor, valid, 0.9, 0.7, 0.1, norm)
    torch.testing.assert_close(out, expected)
    perm = torch.randperm(reward.numel(), generator=torch.Generator().manual_seed(seed + 10))
    out_p = gigpo_advantage(reward[perm], group[perm], traj[perm], step[perm], anchor[perm], valid[perm],
                            gamma=0.9, omega=0.7, norm=norm)
    torch.testing.assert_close(out_p, out[perm])


def test_gigpo_without_repeated_anchors_equals_grpo():
    reward, group, traj, step, _, valid = random_rows(3)
    anchor = torch.arange(reward.numel())  # every anchor group is a singleton -> no step term
    for norm in ("mean_std", "mean"):
        torch.testing.assert_close(
            gigpo_advantage(reward, group, traj, step, anchor, valid, norm=norm),
            grpo_advantage(reward, group, traj, valid, norm=norm),
        )


def test_dtypes_and_shapes():
    reward, group, traj, step, anchor, valid = random_rows(4)
    assert gigpo_advantage(reward, group, traj, step, anchor, valid).dtype == torch.float64
    out32 = gigpo_advantage(reward.float()[:, None], group[:, None], traj, step[:, None], anchor, valid[:, None])
    assert out32.dtype == torch.float32 and out32.shape == reward.shape
    with pytest.raises(ValueError, match="norm"):
        grpo_advantage(reward, group, traj, valid, norm="std")
    with pytest.raises(ValueError, match="group_id"):
        grpo_advantage(reward, group[:-1], traj, valid)
    with pytest.raises(TypeError, match="reward"):
        grpo_advantage(group, group, traj, valid)
    with pytest.raises(TypeError, match="anchor"):
        gigpo_advantage(reward, group, traj, step, reward, valid)


def _reference_clusters(texts, groups, threshold):
    out, clusters, next_id = [], defaultdict(list), 0
    for text, gid in zip(texts, groups):
        for rep, cid in clusters[gid]:
            if SequenceMatcher(None, text, rep).ratio() >= threshold:
                out.append(cid)
                break
        else:
            clusters[gid].append((text, next_id))
            out.append(next_id)
            next_id += 1
    return out


def test_similarity_anchor_ids():
    texts = ["you are in the kitchen", "you are in the kitchen.", "a completely different text",
             "you are in the kitchen!", "you are in the kitchen"]
    out = similarity_anchor_ids(texts, ids([0, 0, 0, 0, 1]), threshold=0.9)
    assert out.dtype == torch.int64
    assert out.tolist() == [0, 0, 1, 0, 2]  # group 1 gets its own cluster
    g = torch.Generator().manual_seed(0)
    words = ["apple", "box", "open", "the", "drawer", "red", "go", "to"]
    texts = [" ".join(words[int(i)] for i in torch.randint(0, 8, (6,), generator=g)) for _ in range(60)]
    texts += texts[:20]  # exact repeats
    groups = torch.randint(0, 3, (80,), generator=g)
    for thr in (0.9, 0.6):
        assert similarity_anchor_ids(texts, groups, threshold=thr).tolist() == _reference_clusters(
            texts, groups.tolist(), thr)
    with pytest.raises(ValueError, match="group_id"):
        similarity_anchor_ids(["a", "b"], ids([0]))


# --------------------------------------------------------------------------- TensorDict modules
def _rows_td(dtype=torch.float32):
    reward, group, traj, step, anchor, valid = random_rows(5)
    return TensorDict(
        reward=reward.to(dtype)[:, None], group_id=group, traj_id=traj, step_count=step[:, None],
        anchor=anchor, action_valid=valid[:, None], batch_size=[reward.numel()],
    )


def test_advantage_modules_match_functional():
    rows = _rows_td(torch.float64)
    r, g, tr = rows["reward"], rows["group_id"], rows["traj_id"]
    s, a, v = rows["step_count"], rows["anchor"], rows["action_valid"]
    cases = [
        (GiGPOAdvantage(gamma=0.9, norm="mean"), gigpo_advantage(r, g, tr, s, a, v, gamma=0.9, norm="mean")),
        (GRPOAdvantage(), grpo_advantage(r, g, tr, v)),
        (RLOOAdvantage(invalid_penalty=0.5), rloo_advantage(r, g, tr, v, invalid_penalty=0.5)),
        (ReinforcePlusPlusBaselineAdvantage(), reinforce_pp_baseline_advantage(r, g, tr, v)),
        (GRPOPassKAdvantage(), grpo_passk_advantage(r, g, tr, v)),
    ]
    for module, expected in cases:
        out = module(rows.clone())
        assert out["advantage"].shape == (rows.numel(), 1) and out["advantage"].dtype == torch.float64
        torch.testing.assert_close(out["advantage"].squeeze(-1), expected)


def test_advantage_module_set_keys_and_errors():
    rows = _rows_td()
    rows.rename_key_("reward", ("next", "reward"))
    adv = GRPOAdvantage()
    with pytest.raises(KeyError, match="reward"):
        adv(rows.clone())
    adv.set_keys(reward=("next", "reward"), advantage="adv")
    out = adv(rows.clone())
    assert out["adv"].dtype == torch.float32 and out["adv"].shape == (rows.numel(), 1)
    with pytest.raises(ValueError, match="not an accepted"):
        adv.set_keys(rewards="x")


def test_advantage_module_as_replay_buffer_transform():
    rows = _rows_td()
    expected = GiGPOAdvantage()(rows.clone())["advantage"]
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100), transform=GiGPOAdvantage(write_only=True),
                                batch_size=4)
    rb.extend(rows)
    sample = rb.sample()
    # the stored advantage was computed on the whole written batch, sampling does not recompute it
    torch.testing.assert_close(sample["advantage"], expected[sample["index"]])


# --------------------------------------------------------------------------- ClipPolicyLoss
def _loss_td(log_ratio, adv, mask=None, **extra):
    log_ratio = t(log_ratio, torch.float32)
    mask = torch.ones_like(log_ratio, dtype=torch.bool) if mask is None else torch.tensor(mask)
    old = torch.full_like(log_ratio, -1.0)
    lp = (old + log_ratio).requires_grad_()
    td = TensorDict(log_prob=lp, old_log_prob=old, mask=mask, advantage=t(adv, torch.float32),
                    batch_size=[log_ratio.shape[0]])
    td.update(extra)
    return td, lp


def test_approx_kl_per_token_and_response_kl_per_response():
    """approx_kl is k3 = (r - 1) - log r averaged over the response tokens; response_kl is k1 of whole
    responses, -sum_t log r_t averaged over the rows (a row without tokens left out)."""
    k3 = lambda r: (r - 1) - math.log(r)  # noqa: E731
    log_ratio = [[math.log(0.5), 0.0, math.log(2.0)], [math.log(0.8), 9.0, 9.0], [9.0, 9.0, 9.0]]
    mask = [[True, True, True], [True, False, False], [False, False, False]]
    out = ClipPolicyLoss(kl_coef=0.0, entropy_coef=0.0)(_loss_td(log_ratio, [1.0, 1.0, 1.0], mask)[0])
    assert out["approx_kl"].item() == pytest.approx((k3(0.5) + k3(2.0) + k3(0.8)) / 4, rel=1e-5)
    assert out["response_kl"].item() == pytest.approx(-(math.log(0.5 * 2.0) + math.log(0.8)) / 2, rel=1e-5)


def test_clip_and_clip_higher():
    loss = ClipPolicyLoss(kl_coef=0.0, entropy_coef=0.0)
    out = loss(_loss_td([[math.log(1.5)]], [1.0])[0])  # ratio 1.5, A > 0 -> clipped at 1.2
    assert out["loss_objective"].item() == pytest.approx(-1.2)
    assert out["clip_fraction"].item() == 1.0 and set(out.keys()) == {"loss_objective", "clip_fraction",
                                                                       "ratio_mean", "kl", "approx_kl",
                                                                       "response_kl"}
    assert out["approx_kl"].item() == pytest.approx(0.5 - math.log(1.5), rel=1e-5)  # (r - 1) - log r, r = 1.5
    out = loss(_loss_td([[math.log(0.5)]], [-1.0])[0])  # ratio 0.5, A < 0 -> clipped at 0.8
    assert out["loss_objective"].item() == pytest.approx(0.8)
    out = loss(_loss_td([[math.log(1.1)]], [1.0])[0])  # inside the trust region
    assert out["loss_objective"].item() == pytest.approx(-1.1) and out["clip_fraction"].item() == 0.0
    high = ClipPolicyLoss(eps_high=0.28, kl_coef=0.0)
    assert high(_loss_td([[math.log(1.25)]], [1.0])[0])["loss_objective"].item() == pytest.approx(-1.25)
    assert loss(_loss_td([[math.log(1.25)]], [1.0])[0])["loss_objective"].item() == pytest.approx(-1.2)


def test_dual_clip():
    td = _loss_td([[math.log(5.0)]], [-1.0])[0]  # ratio 5, A = -1: PPO loss 5, dual clip caps at 3
    assert ClipPolicyLoss(kl_coef=0)(td)["loss_objective"].item() == pytest.approx(3.0)
    assert ClipPolicyLoss(kl_coef=0, dual_clip=None)(td)["loss_objective"].item() == pytest.approx(5.0)
    td = _loss_td([[math.log(5.0)]], [1.0])[0]  # A > 0: dual clip does not apply
    assert ClipPolicyLoss(kl_coef=0)(td)["loss_objective"].item() == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="dual_clip"):
        ClipPolicyLoss(dual_clip=0.5)


def test_aggregation_modes_by_hand():
    # ratio 1 everywhere -> per-token loss = -A; row 0 has 2 tokens (A=1), row 1 has 4 (A=2)
    mask = [[True, True, False, False], [True, True, True, True]]
    td = _loss_td([[0.0] * 4, [0.0] * 4], [[1.0], [2.0]], mask)[0]
    expected = {"token-mean": -10 / 6, "seq-mean-token-sum": -5.0, "seq-mean-token-mean": -1.5}
    for mode, value in expected.items():
        out = ClipPolicyLoss(aggregation=mode, kl_coef=0)(td.clone())
        assert out["loss_objective"].item() == pytest.approx(value), mode
    # padding may hold anything (even inf): it is selected away
    td["log_prob"] = torch.where(td["mask"], td["log_prob"], torch.inf)
    assert ClipPolicyLoss(kl_coef=0)(td)["loss_objective"].item() == pytest.approx(-10 / 6)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), "mean")


def test_kl_k3_and_entropy():
    d = math.log(2.0)  # ref - logp
    td, lp = _loss_td([[0.0, 0.0]], [1.0], [[True, False]])
    td["ref_log_prob"] = td["log_prob"].detach() + t([[d, 5.0]], torch.float32)
    td["entropy"] = t([[0.7, 100.0]], torch.float32)
    out = ClipPolicyLoss(kl_coef=0.01, entropy_coef=0.001)(td)
    k3 = math.exp(d) - d - 1
    assert out["kl_ref"].item() == pytest.approx(k3, rel=1e-5)
    assert out["loss_kl"].item() == pytest.approx(0.01 * k3, rel=1e-5)
    assert out["loss_entropy"].item() == pytest.approx(-0.001 * 0.7, rel=1e-5)
    # clamp to [-10, 10]: exp(5) - 5 - 1 = 142.4 -> 10
    td, _ = _loss_td([[0.0]], [1.0])
    td["ref_log_prob"] = td["log_prob"].detach() + 5.0
    assert ClipPolicyLoss(kl_coef=1.0)(td)["loss_kl"].item() == pytest.approx(10.0)
    # KL enabled but no reference log-probs -> clear error
    with pytest.raises(KeyError, match="ref_log_prob"):
        ClipPolicyLoss(kl_coef=0.01)(_loss_td([[0.0]], [1.0])[0])


def test_gspo_sequence_ratio():
    loss = ClipPolicyLoss(ratio="sequence", eps_low=3e-4, eps_high=4e-4, aggregation="seq-mean-token-mean",
                          kl_coef=0)
    # token log-ratios [0.1, 0.3] -> sequence ratio exp(0.2) = 1.22 -> clipped at 1 + 4e-4
    td, _ = _loss_td([[0.1, 0.3, 9.0]], [1.0], [[True, True, False]])
    out = loss(td)
    assert out["loss_objective"].item() == pytest.approx(-(1 + 4e-4))
    assert out["ratio_mean"].item() == pytest.approx(math.exp(0.2), rel=1e-5)
    # a dual clip is never applied in sequence mode: A = -1, ratio exp(2) -> loss exp(2)
    td, _ = _loss_td([[2.0, 2.0]], [-1.0])
    assert loss(td)["loss_objective"].item() == pytest.approx(math.exp(2.0), rel=1e-5)
    # unclipped: ratio 1, d loss / d logp_t = -A * ratio / n_tokens
    td, lp = _loss_td([[1e-5, -1e-5]], [1.0])
    loss(td)["loss_objective"].backward()
    torch.testing.assert_close(lp.grad, torch.full((1, 2), -0.5), rtol=1e-4, atol=1e-4)


def test_actor_network_and_gradient():
    n, tt = 3, 4
    base = torch.nn.Parameter(torch.zeros(n, tt))
    actor = TensorDictModule(lambda x: x + base, in_keys=["old_log_prob"], out_keys=["log_prob"])
    td = TensorDict(old_log_prob=-torch.ones(n, tt), mask=torch.ones(n, tt, dtype=torch.bool),
                    advantage=t([1.0, -1.0, 2.0], torch.float32)[:, None], batch_size=[n])
    out = ClipPolicyLoss(actor, kl_coef=0)(td)
    out["loss_objective"].backward()
    # token-mean of -A * ratio: d/dlogp = -A / 12 (ratio 1)
    torch.testing.assert_close(base.grad, -t([1.0, -1.0, 2.0], torch.float32)[:, None].expand(n, tt) / 12)
    with pytest.raises(KeyError, match="log_prob"):
        ClipPolicyLoss(kl_coef=0)(TensorDict(old_log_prob=torch.zeros(1, 1), mask=torch.ones(1, 1, dtype=torch.bool),
                                             advantage=torch.zeros(1), batch_size=[1]))
    with pytest.raises(ValueError, match="advantage"):
        ClipPolicyLoss(kl_coef=0)(_loss_td([[0.0]], [[1.0, 2.0, 3.0]])[0])


class _FixedDist:
    def __init__(self, log_prob, mask):
        self._log_prob, self.mask = log_prob, mask

    def log_prob(self, action):
        return self._log_prob


class _FixedLogProbActor(torch.nn.Module):
    """Trivial actor for TorchRL's GRPOLoss: a fixed tensor of per-token log-probs (a parameter)."""

    def __init__(self, log_prob, mask):
        super().__init__()
        self.log_prob = torch.nn.Parameter(log_prob.clone())
        self.mask = mask

    def get_dist(self, tensordict, logits_key=None, **kwargs):
        return _FixedDist(self.log_prob, self.mask)


@pytest.mark.parametrize("ours,theirs", [("token-mean", "token_mean"), ("seq-mean-token-mean", "prompt_mean")])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_matches_torchrl_grpo_loss(ours, theirs, dual_clip):
    g = torch.Generator().manual_seed(0)
    n, tt = 6, 7
    lengths = torch.tensor([3, 7, 1, 5, 6, 2])
    mask = torch.arange(tt)[None, :] < lengths[:, None]
    old = -torch.rand(n, tt, generator=g) * 3
    log_prob = old + torch.randn(n, tt, generator=g) * 0.4
    adv = torch.randn(n, generator=g)
    actor = _FixedLogProbActor(log_prob, mask)
    torchrl_loss = GRPOLoss(actor, clip_epsilon=(0.2, 0.28), entropy_bonus=False, aggregation=theirs)
    td_theirs = TensorDict({("tokens", "full"): torch.zeros(n, tt, dtype=torch.long), ("log_probs", "full"): old,
                            "advantage": adv[:, None, None].expand(n, tt, 1)}, [n])
    ref = torchrl_loss(td_theirs).loss_objective.squeeze()
    ref_grad = torch.autograd.grad(ref, actor.log_prob)[0]

    lp = log_prob.clone().requires_grad_()
    out = ClipPolicyLoss(eps_low=0.2, eps_high=0.28, dual_clip=dual_clip, kl_coef=0.0, entropy_coef=0.0,
                         aggregation=ours)(TensorDict(log_prob=lp, old_log_prob=old, mask=mask, advantage=adv,
                                                      batch_size=[n]))
    assert 0 < out["clip_fraction"] < 1  # the batch exercises both branches
    torch.testing.assert_close(out["loss_objective"], ref)
    torch.testing.assert_close(torch.autograd.grad(out["loss_objective"], lp)[0], ref_grad)


# --------------------------------------------------------------------------- PPO
def test_token_gae_by_hand():
    values = t([[0.5, 0.2, 0.1, 9.0], [7.0, 0.4, 0.3, 0.0]])
    mask = torch.tensor([[True, True, True, False], [False, True, True, False]])  # row 1 left-padded
    scores = t([1.0, -1.0])
    adv, ret = token_gae(values, mask, scores, whiten=False)
    # gamma = lambda = 1: A_t = score - V_t, returns = score on every response token
    torch.testing.assert_close(adv, t([[0.5, 0.8, 0.9, 0.0], [0.0, -1.4, -1.3, 0.0]]))
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0, 0.0], [0.0, -1.0, -1.0, 0.0]]))
    # gamma 0.5: deltas [-0.4, -0.15, 0.9] -> A = [-0.25, 0.3, 0.9]
    adv, _ = token_gae(values[:1], mask[:1], scores[:1], gamma=0.5, lmbda=1.0, whiten=False)
    torch.testing.assert_close(adv, t([[-0.25, 0.3, 0.9, 0.0]]))
    adv, _ = token_gae(values, mask, scores)  # whitened over the 5 response tokens
    vals = adv[mask]
    assert vals.mean().abs() < 1e-9 and (vals.std() - 1).abs() < 1e-4 and (adv[~mask] == 0).all()


def test_ppo_loss_value_clip():
    n, tt = 1, 2
    mask = torch.tensor([[True, False]])
    value = t([[1.0, 5.0]], torch.float32).requires_grad_()
    td = TensorDict(log_prob=torch.zeros(n, tt), old_log_prob=torch.zeros(n, tt), mask=mask,
                    state_value=value, old_state_value=torch.zeros(n, tt), score=t([0.2], torch.float32),
                    batch_size=[n])
    out = PPOLoss(entropy_coef=0)(td)
    # returns = 0.2; unclipped (1 - 0.2)^2 = 0.64, clipped (0.5 - 0.2)^2 = 0.09 -> max 0.64
    assert out["loss_critic"].item() == pytest.approx(0.64)
    assert out["value_clip_fraction"].item() == 0.0
    td["state_value"] = t([[-1.0, 0.0]], torch.float32)  # clipped -0.5: (-0.7)^2 > (-1.2)^2? no -> 1.44
    assert PPOLoss()(td.exclude("value_target"))["loss_critic"].item() == pytest.approx(1.44)
    td["state_value"] = t([[0.6, 0.0]], torch.float32)  # unclipped 0.16, clipped 0.5 -> 0.09: keep 0.16
    assert PPOLoss()(td.exclude("value_target"))["loss_critic"].item() == pytest.approx(0.16)
    assert PPOLoss(value_clip=None)(td.exclude("value_target"))["loss_critic"].item() == pytest.approx(0.16)
    assert PPOLoss(critic_coef=2.0)(td.exclude("value_target"))["loss_critic"].item() == pytest.approx(0.32)
    # critic_coef=None (a critic trained apart, as the trainer's): the policy terms only
    policy_only = PPOLoss(critic_coef=None)(td.set("advantage", torch.ones(n, tt)))
    assert "loss_critic" not in policy_only.keys() and "loss_objective" in policy_only.keys()


def test_ppo_compute_advantage_writes_keys():
    td = TensorDict(old_state_value=t([[0.5, 0.2], [0.1, 0.0]], torch.float32),
                    mask=torch.tensor([[True, True], [True, False]]), score=t([[1.0], [0.0]], torch.float32),
                    batch_size=[2])
    PPOLoss().compute_advantage(td)
    assert td["advantage"].shape == (2, 2) and td["value_target"].shape == (2, 2)
    torch.testing.assert_close(td["value_target"], t([[1.0, 1.0], [0.0, 0.0]], torch.float32))
    # a per-token reward (KL in the reward) enters GAE as token_gae's token_rewards
    kl_reward = t([[-0.1, -0.2], [-0.3, 0.0]], torch.float32)
    PPOLoss(gamma=0.9, lmbda=0.8).compute_advantage(td.set("token_reward", kl_reward))
    adv, ret = token_gae(td["old_state_value"], td["mask"], td["score"], gamma=0.9, lmbda=0.8, token_rewards=kl_reward)
    torch.testing.assert_close(td["advantage"], adv)
    torch.testing.assert_close(td["value_target"], ret)
    _, ret_without = token_gae(td["old_state_value"], td["mask"], td["score"], gamma=0.9, lmbda=0.8)
    assert not torch.allclose(ret, ret_without)


# --------------------------------------------------------------------------- DAPO
def _dapo_rows(group, traj, reward):
    return TensorDict(reward=t(reward, torch.float32)[:, None], group_id=ids(group), traj_id=ids(traj),
                      batch_size=[len(reward)])


def test_dapo_filter():
    # group 0: episode rewards [1, 1] (one trajectory has 2 rows summing to 1) -> dropped
    # group 1: [0, 1] -> kept; group 2: one trajectory -> dropped
    rows = _dapo_rows([0, 0, 0, 1, 1, 2], [0, 0, 1, 2, 3, 4], [0.5, 0.5, 1.0, 0.0, 1.0, 4.0])
    mask = informative_group_mask(rows["reward"], rows["group_id"], rows["traj_id"])
    assert mask.tolist() == [False, False, False, True, True, False]
    kept = DynamicSamplingFilter()(rows)
    assert kept["group_id"].tolist() == [1, 1]


def test_dapo_accumulator():
    informative = _dapo_rows([0, 0, 1, 1], [0, 1, 2, 3], [0.0, 1.0, 1.0, 0.0])  # 2 informative groups
    flat = _dapo_rows([0, 0, 1, 1], [0, 1, 2, 3], [1.0, 1.0, 0.0, 0.0])  # none informative
    acc = DynamicSamplingAccumulator(target_groups=3, max_tries=4)
    assert not acc.add(flat) and acc.num_groups == 0
    assert not acc.add(informative) and acc.num_groups == 2
    assert acc.add(informative)  # one more group needed: the first one of this try, whole
    batch = acc.pop()
    assert batch["group_id"].tolist() == [0, 0, 1, 1, 2, 2]  # relabelled: no merge across tries
    assert batch["traj_id"].tolist() == [0, 1, 2, 3, 4, 5]
    assert acc.tries == 0 and not acc.ready
    # the last try keeps everything
    acc = DynamicSamplingAccumulator(target_groups=2, max_tries=2)
    assert not acc.add(flat)
    assert acc.add(flat) and acc.num_groups == 2 and acc.pop().numel() == 4
    with pytest.raises(ValueError, match="target_groups"):
        DynamicSamplingAccumulator(target_groups=0)


def test_readme_example():
    """The README's usage snippet (kept in sync by hand)."""
    n, tt = 12, 5
    rows = TensorDict(
        reward=torch.tensor([0, 0, 10, 0, 0, 0, 0, 0, 1, 0, 0, 1.0]).unsqueeze(-1),
        group_id=torch.arange(2).repeat_interleave(6),
        traj_id=torch.arange(4).repeat_interleave(3),
        step_count=torch.arange(3).repeat(4).unsqueeze(-1),
        anchor=torch.tensor([7, 8, 9, 7, 5, 6, 1, 2, 3, 1, 2, 4]),
        action_valid=torch.ones(n, 1, dtype=torch.bool),
        batch_size=[n],
    )
    GiGPOAdvantage(gamma=0.95, norm="mean_std")(rows)
    assert rows["advantage"].shape == (n, 1)
    assert (rows["advantage"][6:] == 0).all()  # group 1: equal episode rewards and equal step returns
    rows["mask"] = torch.ones(n, tt, dtype=torch.bool)
    rows["old_log_prob"] = -torch.rand(n, tt)
    rows["ref_log_prob"] = rows["old_log_prob"].clone()
    log_prob = (rows["old_log_prob"] + 0.05 * torch.randn(n, tt)).requires_grad_()
    rows["log_prob"] = log_prob
    out = ClipPolicyLoss(eps_low=0.2, eps_high=0.28, kl_coef=0.01, aggregation="token-mean")(rows)
    loss = sum(v for k, v in out.items() if k.startswith("loss_"))
    loss.backward()
    assert set(out.keys()) >= {"loss_objective", "loss_kl", "clip_fraction", "kl", "ratio_mean"}
    assert log_prob.grad.shape == (n, tt) and log_prob.grad[:6].abs().sum() > 0


# --------------------------------------------------------------------------- reference loops
# Each function below restates one formula of the reference (verl-agent's core_algos.py /
# core_gigpo.py) as a plain loop over rows and tokens, on padded [N, T] tensors whose response
# tokens sit at the left of each row, as the reference lays them out.
def ref_masked_whiten(x, mask):
    m = mask.to(x.dtype)
    mean = (x * m).sum() / (m.sum() + 1e-8)
    var = (((x - mean) ** 2) * m).sum() / (m.sum() + 1e-8) * (m.sum() / (m.sum() - 1))
    return (x - mean) * torch.rsqrt(var + 1e-8)


def ref_scores(reward, traj, valid, c):
    episode = defaultdict(float)
    for r, tr in zip(reward.tolist(), traj.tolist()):
        episode[tr] += r
    return t([episode[tr] - c * (1 - int(v)) for tr, v in zip(traj.tolist(), valid.tolist())])


def ref_token_rewards(scores, lengths, width):
    out = torch.zeros(len(scores), width, dtype=torch.float64)
    for i, (s, n) in enumerate(zip(scores.tolist(), lengths.tolist())):
        if n:
            out[i, n - 1] = s
    return out


def _token_case(seed, n_groups=4, per_group=5, width=7):
    g = torch.Generator().manual_seed(seed)
    group = torch.arange(n_groups).repeat_interleave(per_group)
    n = len(group)
    traj = group * 10 + torch.randint(0, 3, (n,), generator=g)  # several rows per trajectory
    reward = torch.randint(-2, 5, (n,), generator=g).double() * 0.5
    valid = torch.rand(n, generator=g) > 0.2
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return reward, group, traj, valid, lengths, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_pp_baseline_whitens_over_tokens_like_the_reference(seed):
    reward, group, traj, valid, lengths, mask = _token_case(seed)
    scores = ref_scores(reward, traj, valid, 0.1)
    by_group = defaultdict(list)
    for s_, gid in zip(scores.tolist(), group.tolist()):
        by_group[gid].append(s_)
    centred = t([s_ - (sum(by_group[gid]) / len(by_group[gid]) if len(by_group[gid]) > 1 else 0.0)
                 for s_, gid in zip(scores.tolist(), group.tolist())])
    expected = ref_masked_whiten(centred[:, None].expand(mask.shape) * mask, mask)
    out = reinforce_pp_baseline_advantage(reward, group, traj, valid, lengths)
    torch.testing.assert_close((out[:, None] * mask), expected * mask, atol=1e-6, rtol=1e-6)
    # rows whitening (the former behaviour) differs whenever the lengths differ
    assert not torch.allclose(out, reinforce_pp_baseline_advantage(reward, group, traj, valid), atol=1e-3)
    td = TensorDict(reward=reward[:, None], group_id=group, traj_id=traj, action_valid=valid[:, None],
                    response_tokens=lengths[:, None], batch_size=[len(group)])
    torch.testing.assert_close(ReinforcePlusPlusBaselineAdvantage()(td)["advantage"].squeeze(-1), out)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_token_reinforce_pp_matches_reference_loop(gamma):
    reward, group, traj, valid, lengths, mask = _token_case(3)
    scores = ref_scores(reward, traj, valid, 0.1)
    rewards = ref_token_rewards(scores, lengths, mask.shape[1])
    kl_reward = -0.01 * torch.rand(mask.shape, generator=torch.Generator().manual_seed(9)).double() * mask
    rewards = rewards + kl_reward
    returns = torch.zeros_like(rewards)
    running = torch.zeros(len(rewards), dtype=torch.float64)
    for k in reversed(range(rewards.shape[1])):
        running = rewards[:, k] + gamma * running
        returns[:, k] = running
        running = running * mask[:, k]
    expected = ref_masked_whiten(returns, mask) * mask
    adv, ret = token_reinforce_pp(scores, mask, gamma=gamma, token_rewards=kl_reward)
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ret, returns * mask)
    td = TensorDict(reward=reward[:, None], group_id=group, traj_id=traj, action_valid=valid[:, None],
                    response_tokens=lengths[:, None], token_reward=kl_reward, batch_size=[len(group)])
    torch.testing.assert_close(ReinforcePlusPlusAdvantage(gamma=gamma)(td)["advantage"], adv)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_grpo_passk_matches_reference_loop(seed):
    reward, group, traj, valid, _, _ = _token_case(seed)
    scores = ref_scores(reward, traj, valid, 0.1)
    expected = torch.zeros_like(scores)
    rows = defaultdict(list)
    for i, gid in enumerate(group.tolist()):
        rows[gid].append(i)
    for members in rows.values():
        vals = scores[members]
        top, idx = torch.topk(vals, 2)
        if top[0] > top[1]:  # a unique best row (a tie gives 0 whichever row topk names)
            expected[members[int(idx[0])]] = (top[0] - top[1]) / (torch.std(vals) + 1e-6)
    torch.testing.assert_close(grpo_passk_advantage(reward, group, traj, valid), expected)
    assert (grpo_passk_advantage(reward, group, traj, valid) != 0).sum() <= len(rows)


def test_remax_is_score_minus_greedy_baseline():
    reward, group, traj, valid, _, _ = _token_case(4)
    baseline = t([float(gid) for gid in group.tolist()])
    expected = ref_scores(reward, traj, valid, 0.1) - baseline
    torch.testing.assert_close(remax_advantage(reward, traj, baseline, valid), expected)
    td = TensorDict(reward=reward[:, None], group_id=group, traj_id=traj, action_valid=valid[:, None],
                    reward_baseline=baseline[:, None], kl_penalty=torch.full((len(group), 1), 0.5, dtype=torch.float64),
                    batch_size=[len(group)])
    torch.testing.assert_close(ReMaxAdvantage()(td)["advantage"].squeeze(-1), expected - 0.5)


@pytest.mark.parametrize("gamma, lmbda", [(1.0, 1.0), (0.9, 0.8)])
def test_token_gae_matches_reference_loop(gamma, lmbda):
    reward, group, traj, valid, lengths, mask = _token_case(5)
    scores = ref_scores(reward, traj, valid, 0.1)
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * mask
    rewards = ref_token_rewards(scores, lengths, mask.shape[1])
    last, rev = 0.0, []
    for k in reversed(range(rewards.shape[1])):
        nxt = values[:, k + 1] if k < rewards.shape[1] - 1 else 0.0
        delta = rewards[:, k] + gamma * nxt - values[:, k]
        last = delta + gamma * lmbda * last
        rev.append(last)
    adv = torch.stack(rev[::-1], 1)
    ret = adv + values
    ours_adv, ours_ret = token_gae(values, mask, scores, gamma=gamma, lmbda=lmbda)
    torch.testing.assert_close(ours_ret, ret * mask)
    torch.testing.assert_close(ours_adv, ref_masked_whiten(adv, mask) * mask, atol=1e-6, rtol=1e-6)


def _matrix_gae(values, mask, scores, gamma, lmbda, token_rewards):
    """The previous ``token_gae``'s discount-matrix form, from ``benchmarks/gae_speed.py`` (one copy)."""
    spec = importlib.util.spec_from_file_location(
        "gae_speed_bench", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "gae_speed.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.matrix_gae(values, mask, scores, gamma, lmbda, token_rewards)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gamma, lmbda", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.8), (0.7, 0.0)])
def test_token_gae_through_torchrl_equals_the_matrix_form(gamma, lmbda, dtype):
    """``token_gae`` runs TorchRL's ``vec_generalized_advantage_estimate`` (``td0_advantage_estimate``
    for ``lmbda = 0``); same numbers as the matrix form on ragged, non-contiguous masks with
    per-token rewards."""
    g = torch.Generator().manual_seed(3)
    n, t = 12, 40
    mask = torch.arange(t)[None, :] < torch.randint(0, t + 1, (n,), generator=g)[:, None]
    mask[2] = torch.rand(t, generator=g) > 0.5  # holes inside a response
    mask[5] = False  # an empty response
    values = (torch.randn(n, t, generator=g) * mask).to(dtype)
    scores = torch.randn(n, generator=g).to(dtype)
    token_rewards = (0.05 * torch.randn(n, t, generator=g)).to(dtype)
    adv, ret = token_gae(values, mask, scores, gamma=gamma, lmbda=lmbda, token_rewards=token_rewards, whiten=False)
    ref_adv, ref_ret = _matrix_gae(values, mask, scores, gamma, lmbda, token_rewards)
    tol = dict(atol=1e-5, rtol=1e-5)  # TorchRL drops discount factors below 1e-7
    torch.testing.assert_close(adv, ref_adv, **tol)
    torch.testing.assert_close(ret, ref_ret, **tol)
    assert adv.dtype == dtype and (adv[~mask] == 0).all() and adv[mask].abs().sum() > 0


def test_kl_estimators_match_the_reference():
    g = torch.Generator().manual_seed(0)
    logp, ref = -torch.rand(4, 6, generator=g) * 3, -torch.rand(4, 6, generator=g) * 3
    ref[0, 0] = logp[0, 0] - 30.0  # k3 clamps at 10
    d = logp - ref
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), d)
    torch.testing.assert_close(kl_estimate(logp, ref, "abs"), d.abs())
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), 0.5 * d * d)
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.clamp(torch.exp(ref - logp) - (ref - logp) - 1, -10, 10))
    assert kl_estimate(logp, ref, "k3")[0, 0] == 10.0
    with pytest.raises(ValueError, match="kl_type"):
        ClipPolicyLoss(kl_type="k4")
    mask = torch.ones(4, 6, dtype=torch.bool)
    lp = logp.clone().requires_grad_()
    td = TensorDict(log_prob=lp, old_log_prob=logp, ref_log_prob=ref, mask=mask, advantage=torch.zeros(4),
                    batch_size=[4])
    for kind in ("k1", "k2", "k3", "abs"):
        out = ClipPolicyLoss(kl_coef=0.5, kl_type=kind, entropy_coef=0)(td)
        torch.testing.assert_close(out["loss_kl"], 0.5 * kl_estimate(logp, ref, kind).mean())


def test_kl_in_reward_fixed_and_adaptive_controllers():
    g = torch.Generator().manual_seed(0)
    old, ref = -torch.rand(3, 4, generator=g), -torch.rand(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    ctrl = FixedKLController(0.1)
    token_reward, row_penalty, metrics = kl_in_reward(old, ref, mask, ctrl, "k1")
    kl = (old - ref) * mask
    torch.testing.assert_close(token_reward, -0.1 * kl)
    torch.testing.assert_close(row_penalty, 0.1 * kl.sum(-1))
    current = float((kl.sum(-1) / mask.sum(-1)).mean())
    assert metrics["reward_kl"] == pytest.approx(current) and ctrl.value == 0.1
    # adaptive: the reference's loop, value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon
    ctrl, value = AdaptiveKLController(0.1, target=0.01, horizon=100), 0.1
    for _ in range(3):
        _, _, m = kl_in_reward(old, ref, mask, ctrl, "k1")
        value *= 1 + max(-0.2, min(0.2, m["reward_kl"] / 0.01 - 1)) * 3 / 100
    assert ctrl.value == pytest.approx(value) and ctrl.value != 0.1


def test_seq_mean_token_sum_norm_aggregation():
    value = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    # rows with tokens: (6 / L + 4 / L) / 2
    assert aggregate(value, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 3 + 4 / 3) / 2)
    assert aggregate(value, mask, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(0.5)


def test_gspo_gradient_equals_the_reference_form():
    g = torch.Generator().manual_seed(0)
    n, width = 5, 6
    old = -torch.rand(n, width, generator=g)
    logp0 = old + 0.3 * torch.randn(n, width, generator=g)
    mask = torch.arange(width)[None, :] < torch.tensor([6, 3, 1, 4, 5])[:, None]
    adv = torch.randn(n, generator=g)
    # the reference: log s_t = logp - sg(logp) + sg(mean(logp - old)), clamp(max=10); no dual clip;
    # seq-mean-token-mean whatever the configured aggregation
    lp_ref = logp0.clone().requires_grad_()
    seq = ((lp_ref - old) * mask).sum(-1) / mask.sum(-1)
    log_s = torch.clamp(lp_ref - lp_ref.detach() + seq.detach()[:, None], max=10.0)
    s_ = torch.exp(log_s)
    a = adv[:, None]
    losses = torch.maximum(-a * s_, -a * torch.clamp(s_, 1 - 3e-4, 1 + 4e-4))
    ref_loss = ((losses * mask).sum(-1) / mask.sum(-1)).mean()
    ref_loss.backward()
    lp = logp0.clone().requires_grad_()
    td = TensorDict(log_prob=lp, old_log_prob=old, mask=mask, advantage=adv, batch_size=[n])
    loss = ClipPolicyLoss(eps_low=3e-4, eps_high=4e-4, ratio="sequence", max_log_ratio=10.0, kl_coef=0,
                          entropy_coef=0, dual_clip=3.0, aggregation="token-mean")(td)["loss_objective"]
    loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(lp.grad, lp_ref.grad)


def test_gigpo_similarity_threshold_uses_reference_clusters():
    texts = ["you are in the kitchen", "you are in the kitchen.", "a completely different text",
             "you are in the kitchen", "a completely different text!", "elsewhere"]
    group = ids([0, 0, 0, 0, 1, 1])
    rows = TensorDict(reward=t([0.0, 1.0, 0.0, 0.5, 1.0, 0.0])[:, None], group_id=group, traj_id=ids([0, 0, 1, 1, 2, 3]),
                      step_count=ids([0, 1, 0, 1, 0, 0])[:, None], anchor=ids([1, 2, 3, 4, 5, 6]),
                      batch_size=[6])
    rows["observation"] = texts
    out = GiGPOAdvantage(similarity_threshold=0.9)(rows.clone())["advantage"].squeeze(-1)
    anchors = ids(_reference_clusters(texts, group.tolist(), 0.9))
    expected = gigpo_advantage(rows["reward"], group, rows["traj_id"], rows["step_count"], anchors)
    torch.testing.assert_close(out, expected)
    exact = GiGPOAdvantage()(rows.clone())["advantage"].squeeze(-1)
    assert not torch.allclose(out, exact)  # the clusters merged near-identical observations


def test_dapo_accumulator_keeps_everything_without_trim_and_fills():
    informative = _dapo_rows([0, 0, 1, 1], [0, 1, 2, 3], [0.0, 1.0, 1.0, 0.0])
    flat = _dapo_rows([0, 0, 1, 1], [0, 1, 2, 3], [1.0, 1.0, 0.0, 0.0])
    tries = iter([flat, informative, informative])
    acc = DynamicSamplingAccumulator(target_groups=3, max_tries=10, trim=False)
    batch = acc.fill(lambda: next(tries))
    assert acc.last_tries == 3 and batch["group_id"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # 4 >= 3 groups, all kept
    acc = DynamicSamplingAccumulator(target_groups=3, max_tries=2, trim=False)
    batch = acc.fill(lambda: flat)  # the second (last) try keeps everything
    assert acc.last_tries == 2 and batch.numel() == 4


def test_score_penalty_enters_every_row_estimator():
    reward, group, traj, valid, _, _ = _token_case(6)
    pen = torch.rand(len(group), generator=torch.Generator().manual_seed(2)).double()
    scores = episode_scores(reward, traj, valid) - pen
    # with a penalty, GRPO equals GRPO on the penalised scores (one row per trajectory)
    one = torch.arange(len(group))
    torch.testing.assert_close(grpo_advantage(reward, group, traj, valid, score_penalty=pen),
                               grpo_advantage(scores, group, one))
    td = TensorDict(reward=reward[:, None], group_id=group, traj_id=traj, action_valid=valid[:, None],
                    kl_penalty=pen[:, None], batch_size=[len(group)])
    torch.testing.assert_close(RLOOAdvantage()(td)["advantage"].squeeze(-1), rloo_advantage(scores, group, one))


@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_and_rloo_match_reference_loops(seed):
    reward, group, traj, valid, _, _ = _token_case(seed)
    reward[group == 3] = 0.5  # one all-equal group
    valid[group == 3] = True
    scores = ref_scores(reward, traj, valid, 0.1)
    by_group = defaultdict(list)
    for s_, gid in zip(scores.tolist(), group.tolist()):
        by_group[gid].append(s_)
    grpo, rloo = [], []
    for s_, gid in zip(scores.tolist(), group.tolist()):
        vals = torch.tensor(by_group[gid], dtype=torch.float64)
        n = len(vals)
        mean, std = (vals.mean(), torch.std(vals)) if n > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        grpo.append(float((s_ - mean) / (std + 1e-6)))
        rloo.append(s_ * n / (n - 1) - float(mean) * n / (n - 1) if n > 1 else s_)
    torch.testing.assert_close(grpo_advantage(reward, group, traj, valid), t(grpo))
    torch.testing.assert_close(rloo_advantage(reward, group, traj, valid), t(rloo))

"""GraphGPOAdvantage / graphgpo_advantage: the worked example, a loop restatement of the reference
(verl-agent recipe/GraphGPO/core_graph.py: ComplexGraph.from_data, all_to_target_shortest_paths,
compute_graph_path_returns, compute_graphgpo_outcome_advantage) on 200 random batches, the
similarity canonicaliser, the rows' next_anchor and the module."""

from __future__ import annotations

import math
import random
from collections import defaultdict, deque
from difflib import SequenceMatcher
from fractions import Fraction

import pytest
import torch
from tensordict import TensorDict
from torchrl.envs import Compose, TransformedEnv

from torchrl_agent.collectors import StepCollector
from torchrl_agent.envs import make_env
from torchrl_agent.envs.base import stable_hash
from torchrl_agent.envs.transforms import ActionProjection, PromptTransform, WindowMemory
from torchrl_agent.modules import Generation, LLMPolicy
from torchrl_agent.objectives import GraphGPOAdvantage, HGPOAdvantage, graphgpo_advantage
from torchrl_agent.trainers.algorithms import get_algorithm
from torchrl_agent.trainers.cli import compose_config

EPS = 1e-6
SUCCESS = object()  # the success sink: no state equals it


def loop_graphgpo(rows, *, gamma, ws, we, normalize_distance, c, norm, threshold=None, eps=EPS):
    """The reference's semantics over row dicts (``group``, ``traj``, ``step``, ``state`` text,
    ``next`` text, ``reward``, ``valid``); returns and "all equal" in exact (decimal) arithmetic.

    Per group: walk the rows trajectory by trajectory, step by step; a won trajectory's last row
    (episode reward > 0) leads to the sink; edges ``state -> next``; with ``threshold``, a state is
    replaced by the first earlier representative with ``SequenceMatcher(None, s, rep).ratio() >=
    threshold`` (the anchor then the next state of each row, in that walk). Distance: BFS from the
    sink over reversed edges; unreachable: max finite + 1. ``R = 10 gamma^d(next)`` (or
    ``10 gamma^(d(next) - d(state) + 1)``) ``- c`` if invalid; step term: R normalised over the rows
    of the group with the same (exact) state, unbiased std, one row: 0; episode term: the score
    normalised over the group's rows (one row: mean 0, std 1)."""
    g, c = Fraction(str(gamma)), Fraction(str(c))
    episode = defaultdict(Fraction)
    for r in rows:
        episode[r["traj"]] += Fraction(str(r["reward"]))
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["traj"], rows[i]["step"]))
    last = {rows[i]["traj"]: i for i in order}
    node_of, reps = {}, defaultdict(list)

    def canon(group, state):
        if state is SUCCESS or threshold is None:
            return state
        if (group, state) not in node_of:
            hit = next((rep for rep in reps[group] if SequenceMatcher(None, state, rep).ratio() >= threshold), None)
            if hit is None:
                reps[group].append(state)
            node_of[(group, state)] = hit or state
        return node_of[(group, state)]

    edges = defaultdict(list)  # group -> [(u, v)]
    src, dst = {}, {}
    for i in order:
        r = rows[i]
        won_last = last[r["traj"]] == i and episode[r["traj"]] > 0
        src[i] = canon(r["group"], r["state"])
        dst[i] = SUCCESS if won_last else canon(r["group"], r["next"])
        edges[r["group"]].append((src[i], dst[i]))
    dist = {}
    for group, es in edges.items():
        reverse = defaultdict(list)
        for u, v in es:
            reverse[v].append(u)
        d = {SUCCESS: 0}
        queue = deque([SUCCESS])
        while queue:
            v = queue.popleft()
            for u in reverse[v]:
                if u not in d:
                    d[u] = d[v] + 1
                    queue.append(u)
        far = max(d.values())
        for u, v in es:
            for x in (u, v):
                dist[(group, x)] = d.get(x, far + 1)
    ret = {}
    for i, r in enumerate(rows):
        dn, da = dist[(r["group"], dst[i])], dist[(r["group"], src[i])]
        ret[i] = 10 * g ** (dn - da + 1 if normalize_distance else dn) - c * (not r["valid"])

    def normed(values, singleton):
        n = len(values)
        if n == 1:
            return [singleton(values[0])]
        m = sum(values, Fraction(0)) / n
        if all(v == values[0] for v in values):
            return [0.0] * n
        sd = math.sqrt(float(sum((v - m) ** 2 for v in values)) / (n - 1))
        return [float(v - m) if norm == "mean" else float(v - m) / (sd + eps) for v in values]

    step_sets, groups = defaultdict(list), defaultdict(list)
    for i, r in enumerate(rows):
        step_sets[(r["group"], r["state"])].append(i)
        groups[r["group"]].append(i)
    a_step, a_ep = {}, {}
    for members in step_sets.values():
        a_step.update(zip(members, normed([ret[i] for i in members], lambda v: 0.0)))
    for members in groups.values():
        scores = [episode[rows[i]["traj"]] - c * (not rows[i]["valid"]) for i in members]
        a_ep.update(zip(members, normed(scores, lambda v: float(v) if norm == "mean" else float(v) / (1 + eps))))
    return torch.tensor([ws * a_step[i] + we * a_ep[i] for i in range(len(rows))], dtype=torch.float64)


def random_rows(rng: random.Random, near_duplicates: bool = False):
    """Ragged trajectories in shuffled order over a small state space per group (shared states, loops,
    self-loops), won and failed ones, groups without success, singleton groups, invalid actions; the
    final state of a failed trajectory is sometimes a state never seen as an anchor."""
    rows, tid = [], 0
    for group in range(rng.randint(1, 4)):
        states = [f"room {j} of group {group}: " + "x" * rng.randint(0, 30) for j in range(rng.randint(1, 5))]
        if near_duplicates:
            states += [s[:-1] + "y" for s in states if len(s) > 30]
        p_win = rng.choice([0.0, 0.5, 1.0])
        for _ in range(rng.choice([1, 1, 2, 4, 6])):
            length, won = rng.randint(1, 7), rng.random() < p_win
            path = [rng.choice(states) for _ in range(length)]
            path.append(rng.choice(states) if rng.random() < 0.7 else f"final {tid}")
            for step in range(length):
                reward = 10.0 if won and step == length - 1 else rng.choice([0.0] * 8 + [1.0, -0.5])
                rows.append(dict(group=group, traj=tid, step=step, state=path[step], next=path[step + 1],
                                 reward=reward, valid=rng.random() > 0.15))
            tid += 1
    rng.shuffle(rows)
    return rows


def as_td(rows, with_next=True, texts=False):
    col = lambda k, dt=torch.int64: torch.tensor([r[k] for r in rows], dtype=dt)  # noqa: E731
    td = TensorDict(dict(reward=col("reward", torch.float64), group_id=col("group"), traj_id=col("traj"),
                         step_count=col("step"), anchor=torch.tensor([stable_hash(r["state"]) for r in rows]),
                         action_valid=col("valid", torch.bool)), batch_size=[len(rows)])
    if with_next:
        td["next_anchor"] = torch.tensor([stable_hash(r["next"]) for r in rows])
    if texts:  # the similarity canonicaliser's inputs
        td["observation"] = [r["state"] for r in rows]
        if with_next:
            td["next_observation"] = [r["next"] for r in rows]
    return td


def worked_example(next_anchor=True):
    """docs/algorithms.md: one group; T1 = A,B,C wins (next B,C,success); T2 = A,B,C (next B,C,C); T3 = A,C,C."""
    a, b, c = 11, 22, 33
    rows = dict(reward=torch.tensor([0, 0, 10.0, 0, 0, 0, 0, 0, 0], dtype=torch.float64),
                group_id=torch.zeros(9, dtype=torch.int64), traj_id=torch.arange(3).repeat_interleave(3),
                step=torch.arange(3).repeat(3), anchor=torch.tensor([a, b, c, a, b, c, a, c, c]))
    if next_anchor:
        rows["next_anchor"] = torch.tensor([b, c, -1, b, c, c, c, c, c])  # -1: replaced by the sink (T1 won)
    return rows


def test_worked_example():
    out = graphgpo_advantage(**worked_example(), gamma=0.1)
    expected = torch.tensor([[0.756, 1.333, 2.833], [-1.244, -0.667, -1.167], [0.488, -1.167, -1.167]],
                            dtype=torch.float64)
    torch.testing.assert_close(out.view(3, 3), expected, atol=1e-3, rtol=0)
    # T3's first step (A -> C, one hop from success) beats T1/T2's A -> B: the failed trajectory's shortcut
    step_only = graphgpo_advantage(**worked_example(), gamma=0.1, episode_weight=0.0)
    assert step_only[6].item() == pytest.approx(2 / math.sqrt(3), abs=1e-5)
    # without next_anchor the failed trajectories' last steps lead to dead ends (d = dmax + 1 = 3)
    derived = graphgpo_advantage(**worked_example(next_anchor=False), gamma=0.1)
    torch.testing.assert_close(derived[[0, 1, 3, 4, 6]], out[[0, 1, 3, 4, 6]])
    assert derived[5].item() < out[5].item()


@pytest.mark.parametrize("similarity", [False, True])
def test_matches_the_loop_restatement_on_200_random_batches(similarity):
    rng = random.Random(1 + similarity)
    worst = 0.0
    for _ in range(200 if not similarity else 60):
        rows = random_rows(rng, near_duplicates=similarity)
        gamma, nd = rng.choice([0.95, 0.5, 0.2, 0.1]), rng.random() < 0.3
        ws, we = rng.choice([(1.0, 1.0), (1.0, 0.0), (0.5, 2.0)])
        norm = rng.choice(["mean_std", "mean"])
        module = GraphGPOAdvantage(gamma=gamma, step_weight=ws, episode_weight=we, normalize_distance=nd, norm=norm,
                                   similarity_threshold=0.95 if similarity else None)
        out = module(as_td(rows, texts=similarity))["advantage"].squeeze(-1)
        expected = loop_graphgpo(rows, gamma=gamma, ws=ws, we=we, normalize_distance=nd, c=0.1, norm=norm,
                                 threshold=0.95 if similarity else None)
        worst = max(worst, (out - expected).abs().max().item())
    assert worst < 1e-9, worst


def test_next_state_derived_from_the_rows_when_final_states_are_new():
    # without next_anchor, a failed trajectory's last step leads to a node of its own: the same as the
    # reference whenever its final observation is no row's anchor in the group
    rng = random.Random(5)
    for _ in range(30):
        rows = random_rows(rng)
        following = {(r["traj"], r["step"]): r["state"] for r in rows}
        for r in rows:
            r["next"] = following.get((r["traj"], r["step"] + 1), f"final of {r['traj']}")
        expected = GraphGPOAdvantage(gamma=0.2)(as_td(rows))["advantage"]
        torch.testing.assert_close(GraphGPOAdvantage(gamma=0.2)(as_td(rows, with_next=False))["advantage"], expected)


def test_no_success_in_a_group_gives_distance_one_everywhere():
    # one group, nobody wins: every state is at distance 1, R = 10 * gamma - 0.1 * invalid
    reward = torch.zeros(4, dtype=torch.float64)
    valid = torch.tensor([True, False, True, True])
    kw = dict(group_id=torch.zeros(4, dtype=torch.int64), traj_id=torch.tensor([0, 0, 1, 1]),
              step=torch.tensor([0, 1, 0, 1]), anchor=torch.tensor([1, 2, 1, 2]), valid=valid)
    out = graphgpo_advantage(reward, **kw, gamma=0.5, episode_weight=0.0, norm="mean")
    torch.testing.assert_close(out, torch.tensor([0.0, -0.05, 0.0, 0.05], dtype=torch.float64))


def test_module_keys_dtype_and_errors():
    rows = worked_example()
    td = TensorDict({("next", "reward"): rows["reward"].float()[:, None, None], "group_id": rows["group_id"],
                     "traj_id": rows["traj_id"], "step_count": rows["step"][:, None], "anchor": rows["anchor"],
                     "nxt": rows["next_anchor"]}, batch_size=[9])
    module = GraphGPOAdvantage(gamma=0.1)
    module.set_keys(reward=("next", "reward"), next_anchor="nxt")
    out = module(td)["advantage"]
    assert out.shape == (9, 1) and out.dtype == torch.float32
    torch.testing.assert_close(out.squeeze(-1).double(), graphgpo_advantage(**rows, gamma=0.1), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="gamma"):
        GraphGPOAdvantage(gamma=0.0)
    with pytest.raises(ValueError, match="similarity_threshold"):
        GraphGPOAdvantage(similarity_threshold=1.5)


class Expert(LLMPolicy):
    """NumberLine's expert move, scripted (the env, transforms and collector are real)."""

    def generate(self, prompts):
        out = []
        for p in prompts:
            pos = int(p.split("Position: ")[-1].split(".")[0])
            target = int(p.split("Target: ")[-1].split(".")[0])
            text = f"<think>t</think><action>{'+' if target > pos else '-'}</action>"
            out.append(Generation(self.encode(p), self.encode(text), [0.0] * len(self.encode(text)), text))
        return out


def test_collected_rows_carry_the_next_anchor(tokenizer):
    env = TransformedEnv(make_env("numberline", num_groups=2, group_size=2, max_steps=4),
                         Compose(WindowMemory(2), PromptTransform(tokenizer, "numberline"), ActionProjection()))
    rows = StepCollector(env, Expert(tokenizer), seed=0).collect()
    traj, step = rows["traj_id"].reshape(-1), rows["step_count"].reshape(-1)
    anchor, next_anchor = rows["anchor"].reshape(-1), rows["next_anchor"].reshape(-1)
    following = {(int(t), int(s)): int(a) for t, s, a in zip(traj, step, anchor)}
    for t, s, a in zip(traj.tolist(), step.tolist(), next_anchor.tolist()):
        if (t, s + 1) in following:
            assert a == following[(t, s + 1)]
    out = GraphGPOAdvantage()(rows)["advantage"]
    assert out.shape == (rows.batch_size[0], 1) and torch.isfinite(out).all()


@pytest.mark.parametrize("recipe, name, gamma, norm, max_steps, prompt_tokens", [
    ("alfworld_hgpo", "hgpo", 0.95, "mean_std", 50, 4096),
    ("webshop_hgpo", "hgpo", 0.95, "mean", 30, 4096),
    ("alfworld_graphgpo", "graphgpo", 0.1, "mean_std", 50, 2048),
    ("webshop_graphgpo", "graphgpo", 0.2, "mean_std", 15, 5120),
    ("sokoban_graphgpo", "graphgpo", 0.8, "mean_std", 15, 1024),
])
def test_recipes_at_the_reference_settings(recipe, name, gamma, norm, max_steps, prompt_tokens):
    cfg = compose_config([f"experiment={recipe}"])
    a = cfg.algorithm
    assert (a.name, a.gamma, a.norm, cfg.env.max_steps, cfg.memory.max_prompt_tokens) == (
        name, gamma, norm, max_steps, prompt_tokens)
    module = get_algorithm(name).advantage(cfg)
    if name == "hgpo":  # K follows the memory: 2, and 4 with memory.k=4 (the paper's K=4 run)
        assert isinstance(module, HGPOAdvantage) and module.history_length == 2 and module.alpha == 1.0
        k4 = compose_config([f"experiment={recipe}", "memory.k=4"])
        assert get_algorithm(name).advantage(k4).history_length == 4
        assert not module.base_group
    else:
        assert isinstance(module, GraphGPOAdvantage) and module.gamma == gamma
        assert (module.step_weight, module.episode_weight, module.normalize_distance) == (1.0, 1.0, False)

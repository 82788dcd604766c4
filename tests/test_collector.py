"""The step collector: rows per the data contract, no rows for finished envs, determinism."""

from __future__ import annotations

import torch
from torchrl.envs import Compose, TransformedEnv

from torchrl_agent.collectors import StepCollector, episode_metrics
from torchrl_agent.envs import make_env
from torchrl_agent.envs.transforms import ActionProjection, PromptTransform, WindowMemory
from torchrl_agent.modules import Generation, LLMPolicy, TransformersPolicy


def make(tokenizer, num_groups=2, group_size=3, max_steps=6):
    return TransformedEnv(make_env("numberline", num_groups=num_groups, group_size=group_size, max_steps=max_steps),
                          Compose(WindowMemory(2), PromptTransform(tokenizer, "numberline"), ActionProjection()))


class ExpertOrJunk(LLMPolicy):
    """A scripted policy (``responses(prompt) -> text``); the environments, transforms and
    collector are real."""

    def __init__(self, tokenizer, responses):
        super().__init__(tokenizer)
        self.responses = responses

    def generate(self, prompts):
        out = []
        for p in prompts:
            text = self.responses(p)
            out.append(Generation(self.encode(p), self.encode(text), [0.0] * len(self.encode(text)), text))
        return out


def expert_text(prompt):
    pos = int(prompt.split("Position: ")[-1].split(".")[0])
    target = int(prompt.split("Target: ")[-1].split(".")[0])
    return f"<think>t</think><action>{'+' if target > pos else '-'}</action>"


def test_rows_follow_the_data_contract(tiny_model, tokenizer):
    collector = StepCollector(make(tokenizer), TransformersPolicy(tiny_model, tokenizer, max_new_tokens=8), seed=3)
    rows = collector.collect()
    n = rows.batch_size[0]
    for key in ("task", "observation", "admissible_actions", "anchor", "next_anchor", "memory", "step_count", "action",
                "action_valid", "reward", "done", "terminated", "truncated", "success", "group_id", "traj_id",
                ("text", "prompt"), ("text", "response"), ("tokens", "prompt"), ("tokens", "response"),
                ("log_probs", "response")):
        assert key in rows.keys(True), key
    assert rows["reward"].shape == (n, 1) and rows["action_valid"].dtype == torch.bool
    # one row per step: every trajectory has steps 0..len-1 and ends with exactly one done row
    for traj in rows["traj_id"].unique():
        mine = rows["traj_id"] == traj
        steps = rows["step_count"].reshape(-1)[mine]
        assert steps.tolist() == list(range(int(mine.sum())))
        assert rows["done"].reshape(-1)[mine].tolist() == [False] * (int(mine.sum()) - 1) + [True]
        assert len(rows["group_id"][mine].unique()) == 1
    assert rows["group_id"].unique().tolist() == [0, 1]
    assert collector.stats["env_steps"] == n
    # the next batch gets new ids
    second = collector.collect()
    assert second["group_id"].min() == 2 and second["traj_id"].min() == 6


def test_finished_environments_take_no_generation_slot(tokenizer):
    # the expert solves episodes of different lengths: the short ones finish first
    policy = ExpertOrJunk(tokenizer, expert_text)
    rows = StepCollector(make(tokenizer, 1, 4, max_steps=6), policy, seed=0).collect()
    metrics = episode_metrics(rows)
    assert metrics["success"] == 1.0 and metrics["action_valid"] == 1.0
    lock = StepCollector(make(tokenizer, 1, 4, max_steps=6), policy, seed=0, lockstep=True)
    lock_rows = lock.collect()
    free = StepCollector(make(tokenizer, 1, 4, max_steps=6), policy, seed=0)
    free_rows = free.collect()
    assert lock_rows.batch_size == free_rows.batch_size  # same rows either way
    assert free.stats["generation_slots"] == free_rows.batch_size[0]
    assert lock.stats["generation_slots"] == 4 * int(lock_rows["step_count"].max() + 1)


def test_malformed_outputs_become_invalid_actions(tokenizer):
    junk = ["", "no tags", "x" * 20_000, b"<think>\xff</think><action>\xc3\x28</action>".decode("utf-8", "replace"),
            "<think>t</think><action>" + "\x00" * 5 + "</action>"]
    state = {"i": 0}

    def responses(prompt):
        state["i"] += 1
        return junk[state["i"] % len(junk)]

    rows = StepCollector(make(tokenizer, 1, 5, max_steps=4), ExpertOrJunk(tokenizer, responses), seed=0).collect()
    assert rows.batch_size[0] == 5 * 4  # every episode ran to its step limit, nothing crashed
    assert not rows["action_valid"][:, 0].all()
    assert rows["truncated"].reshape(-1).sum() == 5


def test_collection_is_deterministic_for_a_seed(tiny_model, tokenizer):
    a = StepCollector(make(tokenizer), TransformersPolicy(tiny_model, tokenizer, max_new_tokens=6), seed=5).collect()
    b = StepCollector(make(tokenizer), TransformersPolicy(tiny_model, tokenizer, max_new_tokens=6), seed=5).collect()
    assert list(a["text", "response"]) == list(b["text", "response"])
    assert torch.equal(a["reward"], b["reward"])


def test_token_ledger_counts_every_step(tokenizer):
    from torchrl_agent.collectors import token_ledger

    rows = StepCollector(make(tokenizer, 1, 2, max_steps=4), ExpertOrJunk(tokenizer, expert_text), seed=1).collect()
    ledger = token_ledger(rows)
    prompts = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in rows["text", "prompt"]]
    assert ledger["prompt_tokens_total"] == sum(prompts)
    assert ledger["prompt_tokens_per_step"] == sum(prompts) / len(prompts)
    assert ledger["prompt_tokens_per_episode"] == sum(prompts) / 2
    assert ledger["response_tokens_total"] == sum(len(r) for r in rows["tokens", "response"].unbind(0))
    assert episode_metrics(rows)["prompt_tokens_total"] == ledger["prompt_tokens_total"]


def test_response_at_cap_is_the_share_of_responses_that_used_every_token(tokenizer):
    """Every third response is junk (no action) as long as the engine's cap, the others the expert's
    short answer: ``response_at_cap`` is the junk's share, which is the invalid answers' share here;
    without the cap the metric is absent."""
    import itertools

    junk = "<think>" + "and so on " * 12
    cap = len(tokenizer(junk, add_special_tokens=False)["input_ids"])
    calls = itertools.count()
    policy = ExpertOrJunk(tokenizer, lambda p: junk if next(calls) % 3 == 0 else expert_text(p))
    rows = StepCollector(make(tokenizer, 2, 3, max_steps=6), policy, seed=2).collect()
    lengths = rows["response_tokens"].reshape(-1)
    assert int(lengths.max()) == cap and int(lengths.min()) < cap  # the expert's answers are shorter
    metrics = episode_metrics(rows, max_new_tokens=cap)
    assert 0 < metrics["response_at_cap"] < 1
    assert metrics["response_at_cap"] == 1 - metrics["action_valid"]
    assert "response_at_cap" not in episode_metrics(rows)


def test_collector_over_worker_processes_matches_in_process(tokenizer):
    def env(workers):
        base = make_env("numberline", num_groups=2, group_size=2, max_steps=5, num_workers=workers)
        return TransformedEnv(base, Compose(WindowMemory(2), PromptTransform(tokenizer, "numberline"),
                                            ActionProjection()))

    policy = ExpertOrJunk(tokenizer, lambda p: expert_text(p) if "Position: 0" not in p else "junk")
    local = StepCollector(env(0), policy, seed=2).collect()
    remote_env = env(2)
    try:
        remote = StepCollector(remote_env, policy, seed=2).collect()
    finally:
        remote_env.close()
    assert list(local["observation"]) == list(remote["observation"])
    assert list(local["text", "prompt"]) == list(remote["text", "prompt"])
    assert torch.equal(local["reward"], remote["reward"]) and torch.equal(local["group_id"], remote["group_id"])
    assert not remote["worker_fault"].any()


def test_packed_rows_round_trip_through_pickle(tiny_model, tokenizer):
    """What a collector process sends (``pack_rows``) comes back as the same rows: every key, dtype,
    shape and value, ragged token ids and non-tensor data (a list-valued one too) included; rows
    whose keys differ travel as they are."""
    import pickle

    from tensordict import is_leaf_nontensor

    from torchrl_agent.collectors.shards import pack_rows, unpack_rows

    rows = StepCollector(make(tokenizer), TransformersPolicy(tiny_model, tokenizer, max_new_tokens=8,
                                                             temperature=1.0), seed=1).collect()
    for row, k in zip(rows.tensordicts, range(rows.batch_size[0])):
        row.set_non_tensor("tags", ["step", str(k)] if k % 2 else ["only"])
    packed = pickle.loads(pickle.dumps(pack_rows(rows)))
    assert "rows" not in packed and packed["ragged"]  # the fast path, with ragged prompt ids
    back = unpack_rows(packed)
    assert len(back) == rows.batch_size[0]
    keys = list(rows.tensordicts[0].keys(True, True, is_leaf=is_leaf_nontensor))
    assert ("text", "prompt") in keys and ("tokens", "prompt") in keys and "tags" in keys
    for original, copy in zip(rows.tensordicts, back):
        assert sorted(copy.keys(True, True, is_leaf=is_leaf_nontensor), key=str) == sorted(keys, key=str)
        for key in keys:
            a, b = original[key], copy[key]
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
            else:
                assert type(a) is type(b) and a == b, key
    rows.tensordicts[0].set("extra", torch.ones(1))  # keys differ from row to row: sent as they are
    odd = pack_rows(rows)
    assert "rows" in odd and "extra" in unpack_rows(pickle.loads(pickle.dumps(odd)))[0].keys()


def test_prepared_batch_gives_the_rows_of_a_plain_collect(tiny_model, tokenizer):
    """``prepare_next_batch`` (the reset done ahead, as a shard does between batches) changes no row,
    with sampling from the torch RNG; a reseed discards the prepared batch."""

    def run(prepare: bool):
        policy = TransformersPolicy(tiny_model, tokenizer, max_new_tokens=6, temperature=1.0)
        collector = StepCollector(make(tokenizer), policy, seed=5)
        out = []
        for _ in range(2):
            if prepare:
                collector.prepare_next_batch()
                torch.rand(3)  # the RNG moves meanwhile (another shard's work): collect restores it
            out.append(collector.collect())
        if prepare:
            collector.prepare_next_batch()
        collector.set_seed(5)  # discards the prepared third batch: batch 0 again
        out.append(collector.collect())
        return [[(int(r["traj_id"]), r["text", "prompt"], r["text", "response"]) for r in rows.unbind(0)]
                for rows in out]

    plain, prepared = run(False), run(True)
    assert plain == prepared
    assert plain[2] == plain[0] and plain[0] != plain[1]

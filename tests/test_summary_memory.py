"""SummaryMemory with the real tiny model as summariser: batched calls, summary in the prompt, replay."""

from __future__ import annotations

import json

import pytest
import torch
from torchrl.envs import Compose, TransformedEnv
from torchrl.envs.utils import check_env_specs, step_mdp

from torchrl_agent.collectors import StepCollector
from torchrl_agent.envs import make_env
from torchrl_agent.envs.transforms import ActionProjection, PromptTransform, load_memory
from torchrl_agent.envs.transforms.summary import SummaryMemory
from torchrl_agent.modules import LLMPolicy, TransformersPolicy

# a valid-format action the number line does not know: a no-op, so no episode ends early
NOOP = "<think>I wait and look.</think><action>wait</action>"


class Counting(LLMPolicy):
    """A thin wrapper around a real engine that records each ``generate`` call."""

    def __init__(self, inner: LLMPolicy):
        super().__init__(inner.tokenizer, max_new_tokens=inner.max_new_tokens)
        self.inner = inner
        self.calls: list[list[str]] = []
        self.generations = []

    def generate(self, prompts):
        self.calls.append(list(prompts))
        out = self.inner.generate(prompts)
        self.generations.append(out)
        return out


@pytest.fixture
def summarizer(tiny_model, tokenizer):
    # sampled (greedy decoding of the random tiny model is only newlines): garbage text, seeded
    return Counting(TransformersPolicy(tiny_model, tokenizer, max_new_tokens=8, temperature=1.0))


def make(tokenizer, memory, n=3, max_steps=20):
    prompt = PromptTransform(tokenizer, "numberline")
    env = TransformedEnv(make_env("numberline", num_groups=n, group_size=1, max_steps=max_steps, seed=1),
                         Compose(memory, prompt, ActionProjection()))
    return env, prompt


def rollout(env, steps, n=3):
    torch.manual_seed(0)
    td = env.reset()
    rows = []
    for _ in range(steps):
        td["text", "response"] = [NOOP] * n
        env.transform[-1](td)  # the projection, as the collector runs it
        rows.append([td[i].clone() for i in range(n)])
        td = step_mdp(env.step(td))
    return rows, td


def test_one_batched_summariser_call_per_step_and_summary_in_later_prompts(tokenizer, summarizer):
    env, prompt = make(tokenizer, SummaryMemory(k=2, summarizer=summarizer, max_summary_tokens=64))
    rows, td = rollout(env, steps=5)
    # steps 0 and 1 fill the window; from step 2 on one record leaves it per step: one call for all 3 envs
    assert [len(c) for c in summarizer.calls] == [3, 3, 3]
    assert all("New steps:\n[Step" in p for p in summarizer.calls[0])
    for i in range(3):
        records = json.loads(td["memory"][i])["records"]
        assert records[0]["through"] == 2 and "summary" in records[0]
        assert [r["step"] for r in records[1:]] == [3, 4]  # old records left the verbatim window
        text = td["text", "prompt"][i]
        assert f"Summary of steps 1-3: {records[0]['summary']}" in text
        assert "[Step 4]" in text and "[Step 5]" in text and "[Step 1]" not in text and "[Step 3]" not in text
        # the stored summary is exactly what the summariser returned, garbage included
        last = summarizer.generations[-1][i]
        assert records[0]["summary"] == tokenizer.decode(last.response_ids, skip_special_tokens=True).strip()
    assert any(json.loads(td["memory"][i])["records"][0]["summary"] for i in range(3))  # not all empty
    # the summariser saw the previous summary at the next call
    first = json.loads(rows[3][0]["memory"])["records"][0]["summary"]
    assert f"Notes so far: {first}" in summarizer.calls[1][0]


def test_replay_from_rows_alone_without_the_summariser(tokenizer, summarizer):
    env, prompt = make(tokenizer, SummaryMemory(k=1, summarizer=summarizer))
    rows, _ = rollout(env, steps=4)
    fresh = PromptTransform(tokenizer, "numberline")  # no memory transform, no summariser
    for step_rows in rows:
        for row in step_rows:
            assert fresh.render_row(row) == row["text", "prompt"]
            assert prompt.render_row(row) == row["text", "prompt"]
    memory, records = load_memory(rows[-1][0]["memory"])
    assert isinstance(memory, SummaryMemory) and memory.summarizer is None and memory.k == 1
    assert "summary" in records[0]


def test_summary_is_cut_to_max_summary_tokens(tokenizer, tiny_model):
    # sampled garbage from the random tiny model: kept as is, cut to 3 response tokens
    summarizer = Counting(TransformersPolicy(tiny_model, tokenizer, max_new_tokens=16, temperature=1.0))
    env, _ = make(tokenizer, SummaryMemory(k=0, summarizer=summarizer, max_summary_tokens=3), n=2)
    _, td = rollout(env, steps=2, n=2)
    assert [len(c) for c in summarizer.calls] == [2, 2]
    for i in range(2):
        summary = json.loads(td["memory"][i])["records"][0]["summary"]
        ids = summarizer.generations[-1][i].response_ids
        assert summary == tokenizer.decode(ids[:3], skip_special_tokens=True).strip()
        assert len(summary) <= len(tokenizer.decode(ids, skip_special_tokens=True))


def test_summarize_every_batches_several_records(tokenizer, summarizer):
    env, _ = make(tokenizer, SummaryMemory(k=1, summarizer=summarizer, summarize_every=2), n=2)
    _, td = rollout(env, steps=5, n=2)
    # window of 1 + 2 waiting records trigger a call at steps 2 and 4
    assert [len(c) for c in summarizer.calls] == [2, 2]
    assert summarizer.calls[0][0].count("[Step") == 2
    records = json.loads(td["memory"][0])["records"]
    assert records[0]["through"] == 3 and [r["step"] for r in records[1:]] == [4]


def test_check_env_specs(tokenizer, summarizer):
    env, _ = make(tokenizer, SummaryMemory(k=1, summarizer=summarizer), n=2)
    check_env_specs(env)


def test_collector_with_the_policy_as_its_own_summariser(tiny_model, tokenizer):
    # the tiny policy plays and summarises; finished environments take no summariser slot
    policy = TransformersPolicy(tiny_model, tokenizer, max_new_tokens=8)
    summarizer = Counting(policy)
    env = TransformedEnv(make_env("numberline", num_groups=2, group_size=2, max_steps=5),
                         Compose(SummaryMemory(k=1, summarizer=summarizer), PromptTransform(tokenizer, "numberline"),
                                 ActionProjection()))
    rows = StepCollector(env, policy, seed=0).collect()
    steps = rows["step_count"].reshape(-1)
    # from step 1 on (a record beyond the window of 1) each step makes one call, sized by the running envs
    running = [int((steps == t).sum()) for t in range(1, int(steps.max()) + 1)]
    assert [len(c) for c in summarizer.calls] == running
    replay = PromptTransform(tokenizer, "numberline")
    for i in range(rows.batch_size[0]):
        assert replay.render_row(rows[i]) == rows[i]["text", "prompt"]


def test_bad_arguments_and_missing_summariser_fail_clearly(tokenizer):
    with pytest.raises(ValueError, match="k must be"):
        SummaryMemory(k=-1)
    with pytest.raises(ValueError, match="max_summary_tokens"):
        SummaryMemory(max_summary_tokens=0)
    with pytest.raises(ValueError, match="summarize_every"):
        SummaryMemory(summarize_every=0)
    with pytest.raises(TypeError, match="summarizer must be an LLMPolicy"):
        SummaryMemory(summarizer="gpt")
    with pytest.raises(ValueError, match="bad template field"):
        SummaryMemory(template="{history}")
    env, _ = make(tokenizer, SummaryMemory(k=0), n=1)
    with pytest.raises(RuntimeError, match="summarizer is None"):
        rollout(env, steps=1, n=1)


def test_prompt_budget_drops_the_summary_first_and_replay_stays_exact(tokenizer, summarizer):
    env, prompt = make(tokenizer, SummaryMemory(k=1, summarizer=summarizer), n=2)
    rows, _ = rollout(env, steps=2, n=2)
    one_record = prompt.num_tokens(rows[1][0]["text", "prompt"])  # one verbatim record, no summary yet
    env, small = make(tokenizer, SummaryMemory(k=1, summarizer=summarizer), n=2)
    small.max_prompt_tokens = one_record
    rows, td = rollout(env, steps=4, n=2)
    for i in range(2):
        state = json.loads(td["memory"][i])
        assert state["dropped"] == 3  # the summaries written at steps 2, 3 and 4 did not fit
        assert [r.get("step") for r in state["records"]] == [3]
        assert "Summary of steps" not in td["text", "prompt"][i]
    assert "Notes so far: (nothing yet)" in summarizer.calls[-1][0]  # the dropped summary is gone for good
    for step_rows in rows:
        for row in step_rows:
            assert small.render_row(row) == row["text", "prompt"]
            assert not row["prompt_over_budget"].any()

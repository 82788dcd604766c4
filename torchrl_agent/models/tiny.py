"""The bundled ``tiny`` model: a Qwen2-architecture causal LM built from a config.

Its byte-level BPE tokenizer is trained locally (``tokenizers``) on the environments' own text
(prompt templates, observations of seeded episodes, the tag format), so nothing is downloaded.
The folder is a normal Hugging Face model folder (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with a ChatML chat template): transformers and vLLM
both load it. Building is deterministic for a seed and cached under
``$TORCHRL_AGENT_CACHE/models/tiny-<hash>`` (default ``~/.cache/torchrl_agent``); the hash covers
the corpus, the config and the seed, so a changed recipe never reuses a stale folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["TINY_CONFIG", "build_tiny_model", "cache_dir", "save_model_folder", "tiny_corpus"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

#: Qwen2 hyper-parameters of the tiny model (vocab_size is set from the tokenizer).
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32: the smallest vLLM's CPU attention accepts
    num_key_value_heads=1,
    max_position_embeddings=8192,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
VOCAB_SIZE = 2048
RECIPE_VERSION = 1


def cache_dir() -> Path:
    """Root of the on-disk cache (``$TORCHRL_AGENT_CACHE`` or ``~/.cache/torchrl_agent``)."""
    return Path(os.environ.get("TORCHRL_AGENT_CACHE", Path.home() / ".cache" / "torchrl_agent"))


def tiny_corpus() -> list[str]:
    """The tokenizer's training text: prompt templates, tag format and seeded episodes' text."""
    from torchrl_agent.envs import make_env
    from torchrl_agent.envs.transforms.prompt import PROMPT_TEMPLATES

    texts = list(PROMPT_TEMPLATES.values())
    texts += [
        "<think>The target is larger, so I move right.</think><action>+</action>",
        "<think>The target is smaller, so I move left.</think><action>-</action>",
        "<think>I should look around first.</think><action>look</action>",
        "Invalid action. Answer with <think>...</think> then <action>...</action>.",
    ]
    env = make_env("numberline", num_groups=8, group_size=1, seed=0)
    td = env.reset()
    for _ in range(3):
        texts += list(td["task"]) + list(td["observation"]) + list(td["admissible_actions"])
        td["action"] = list(td["expert_action"])
        td = env.step(td)["next"]
    return texts


def _recipe_hash(corpus: list[str], seed: int) -> str:
    payload = json.dumps({"corpus": corpus, "config": TINY_CONFIG, "vocab": VOCAB_SIZE, "seed": seed,
                          "version": RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _train_tokenizer(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is a token: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(seed: int = 0, *, force: bool = False) -> Path:
    """Build (once) and return the folder of the tiny model for ``seed``."""
    corpus = tiny_corpus()
    folder = cache_dir() / "models" / f"tiny-{_recipe_hash(corpus, seed)}"
    if folder.is_dir() and (folder / "model.safetensors").exists() and not force:
        return folder

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = _train_tokenizer(corpus)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_CONFIG,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True,
        temperature=1.0, top_k=0, top_p=1.0,
    )
    return save_model_folder(model, tokenizer, folder)


def save_model_folder(model, tokenizer, folder: Path) -> Path:
    """Save a model and its tokenizer as a Hugging Face folder, atomically: written beside the
    target, then renamed, so a crash never leaves a half-written model."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder

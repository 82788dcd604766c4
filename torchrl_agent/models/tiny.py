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

__all__ = ["TINY_CONFIG", "TINY_SIZES", "build_tiny_model", "cache_dir", "save_model_folder", "seeded_model",
           "tiny_corpus"]

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

#: ``tiny-large``: 1.1M parameters (4 layers, width 128, head_dim 32), the size the learning
#: benchmark and the quick start use: nine times the tiny model, still an RL iteration in seconds on
#: 2 CPU cores. Its tokenizer is trained on a
#: wider corpus (Sokoban rooms, card deals, every template) and splits grid cells and digits into
#: single tokens, so a room row ``#_P__#`` is six tokens the model can attend to one by one.
TINY_LARGE_CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,  # head_dim 32 (vLLM's CPU attention needs >= 32)
    num_key_value_heads=2,
    max_position_embeddings=8192,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
#: model name -> Qwen2 hyper-parameters; ``tiny`` is the original 140k-parameter model.
TINY_SIZES = {"tiny": TINY_CONFIG, "tiny-large": TINY_LARGE_CONFIG}


def cache_dir() -> Path:
    """Root of the on-disk cache (``$TORCHRL_AGENT_CACHE`` or ``~/.cache/torchrl_agent``)."""
    return Path(os.environ.get("TORCHRL_AGENT_CACHE", Path.home() / ".cache" / "torchrl_agent"))


def cache_setting() -> str:
    """The setting that chose :func:`cache_dir`, for messages: ``TORCHRL_AGENT_CACHE=...`` or ``HOME=...``."""
    if "TORCHRL_AGENT_CACHE" in os.environ:
        return f"TORCHRL_AGENT_CACHE={os.environ['TORCHRL_AGENT_CACHE']}"
    return f"HOME={os.environ.get('HOME', Path.home())} (the cache {cache_dir()})"


def writable_cache(folder: Path) -> Path:
    """``folder`` (under :func:`cache_dir`), created; a ``ValueError`` in one line naming the setting
    (``TORCHRL_AGENT_CACHE`` or ``HOME``) when it cannot be created or written in."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(dir=folder, prefix=".probe-"))
    except OSError as err:
        raise ValueError(f"{cache_setting()}: the cache folder {folder} cannot be written ({type(err).__name__}: "
                         f"{err.strerror or err}); set TORCHRL_AGENT_CACHE to a writable folder") from None
    return folder


#: The prompt templates of the corpora, in the recipe's order (the env packages register them: their
#: order of registration may change, this order may not).
_CORPUS_TEMPLATES = ("default", "numberline", "alfworld", "sokoban", "sokoban_grid", "numberline_short", "babyai_short",
                     "babyai_history", "ezpoints_short", "cards", "search", "webshop", "appworld")
#: Prompt templates added after the ``tiny`` recipe was fixed: in ``tiny-large``'s corpus only (a changed
#: corpus rebuilds ``tiny`` into another model, and every figure measured on it would move).
_NOT_IN_TINY = ("numberline_short", "babyai_short")
#: Templates added after ``tiny-large``'s recipe was fixed: in no corpus (byte-level BPE encodes any
#: text), so adding one rebuilds neither model and moves no measured figure.
_NOT_IN_ANY = ("babyai_history",)
#: Templates whose text changed after the recipes were fixed: the corpora keep the text they were
#: fixed with (the ``sokoban`` template now takes the env's task in ``{task}``), so editing a prompt
#: rebuilds neither model. ``tests/test_models.py`` pins both recipes' hashes.
_CORPUS_TEXTS = {
    "sokoban": (
        "You are a Sokoban solver. Push every box (X) onto a target (O) without getting stuck. Symbols: "
        "# wall, _ floor, O target, X box, \u221a box on target, P player, S player on target. First reason "
        "step by step inside <think> </think>, then give exactly one action inside <action> </action>.\n"
        "{history}\nYou have taken {step} steps. Current room:\n{observation}\nAdmissible actions: "
        "{admissible_actions}"
    ),
}


def tiny_corpus(*, all_templates: bool = False) -> list[str]:
    """The tokenizer's training text: prompt templates, tag format and seeded episodes' text
    (``all_templates``: also the templates of :data:`_NOT_IN_TINY`)."""
    from torchrl_agent.envs import make_env
    from torchrl_agent.envs.transforms import resolve_template

    texts = [_CORPUS_TEXTS.get(name) or resolve_template(name, "") for name in _CORPUS_TEMPLATES
             if name not in _NOT_IN_ANY and (all_templates or name not in _NOT_IN_TINY)]
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


def large_corpus() -> list[str]:
    """``tiny-large``'s tokenizer text: :func:`tiny_corpus` plus seeded Sokoban, EZPoints, Points24,
    BabyAI (``GoToObj``) and relative-offset NumberLine episodes (their observations and the
    expert's responses)."""
    from torchrl_agent.envs import make_env
    from torchrl_agent.envs.transforms.projection import expert_response

    texts = tiny_corpus(all_templates=True)
    for name, kwargs in (("sokoban", {}), ("ezpoints", {}), ("points24", {}),
                         ("babyai", {"level": "BabyAI-GoToObj-v0"}),
                         ("numberline", {"observation": "relative", "max_position": 9})):
        env = make_env(name, num_groups=16, group_size=1, seed=0, **kwargs)
        td = env.reset()
        for _ in range(4):
            texts += list(td["task"]) + list(td["observation"]) + list(td["admissible_actions"])
            texts += [expert_response(a) for a in td["expert_action"] if a]
            td["action"] = [a or "up" for a in td["expert_action"]]
            td = env.step(td)["next"]
    return texts


def _recipe_hash(corpus: list[str], seed: int, size: str = "tiny") -> str:
    config = {"corpus": corpus, "config": TINY_SIZES[size], "vocab": VOCAB_SIZE, "seed": seed,
              "version": RECIPE_VERSION}
    if size != "tiny":  # the original model's hash (and cached folder) is unchanged
        config["size"], config["size_recipe"] = size, 2
    payload = json.dumps(config, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _train_tokenizer(corpus: list[str], split_cells: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_cells:  # every grid cell symbol and every digit is its own token
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex("[#_\u221a\\d]"), behavior="isolated"),
            pre_tokenizers.Split(Regex("(?<=[#_\u221a\n])[A-Z](?=[#_\u221a\n])"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is a token: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    if split_cells:  # the response tags are single tokens: a short valid response is 6 tokens
        tok.add_tokens(["<think>", "</think>", "<action>", "</action>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(seed: int = 0, *, force: bool = False, size: str = "tiny") -> Path:
    """Build (once) and return the folder of the tiny model for ``seed``; ``size`` is a key of
    :data:`TINY_SIZES` (``tiny``: 140k parameters, ``tiny-large``: 1.1M)."""
    if size not in TINY_SIZES:
        raise ValueError(f"model.name: unknown tiny size {size!r}; use one of {', '.join(TINY_SIZES)}")
    corpus = tiny_corpus() if size == "tiny" else large_corpus()
    folder = cache_dir() / "models" / f"{size}-{_recipe_hash(corpus, seed, size)}"
    if folder.is_dir() and (folder / "model.safetensors").exists() and not force:
        return folder
    writable_cache(folder.parent)  # before the tokenizer is trained: one line naming the setting

    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = _train_tokenizer(corpus, split_cells=size != "tiny")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_SIZES[size],
    )
    return save_model_folder(seeded_model(Qwen2ForCausalLM, config, tokenizer, seed), tokenizer, folder, replace=force)


def seeded_model(model_class, config, tokenizer, seed: int):
    """``model_class(config)`` initialised from ``seed`` (the global RNG left as it was), sampling by
    default: temperature 1, no top-k / top-p, stopping at ``tokenizer``'s end of sequence."""
    import torch
    from transformers import GenerationConfig

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True,
        temperature=1.0, top_k=0, top_p=1.0,
    )
    return model


def save_model_folder(model, tokenizer, folder: Path, *, replace: bool = False) -> Path:
    """Save a model and its tokenizer as a Hugging Face folder, atomically: written beside the
    target, then renamed, so a crash never leaves a half-written model.

    A complete folder already there (its ``model.safetensors``) is kept, and this build dropped:
    the builders run on first use, so parallel runs on a new machine build the same recipe at once,
    and deleting the first one's folder under its readers failed their loading. ``replace=True``
    (the builders' ``force``) replaces it; an incomplete one is always replaced."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, folder)  # refused where a folder with files is there already
        except OSError:
            if (folder / "model.safetensors").exists() and not replace:
                return folder  # another process's build of the same recipe
            shutil.rmtree(folder)
            os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder

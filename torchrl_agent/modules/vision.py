"""Vision-language models (Qwen2-VL, Qwen2.5-VL) behind the text engine's interfaces: the rollout
engine :class:`VisionPolicy` and the trainer's scorer :class:`VisionResponseLogProbs`.

An image's way from the env to the logits, the reference's (verl-agent), one image per prompt:

1. the env writes ``pixels`` (uint8 ``[b, H, W, 3]``) and a text whose observation ends with the
   placeholder ``<image>``; the prompt transform renders the chat prompt around it as for text;
2. :func:`image_inputs`: each frame's area is rescaled into ``[min_pixels, max_pixels]`` (the
   reference's ``process_image``: 96x96 becomes 256x256), then the processor's image processor cuts
   it into 14-px patches: ``pixel_values`` ``[P, 3 * 2 * 14 * 14]`` and ``image_grid_thw`` ``[1, 3]``;
3. :func:`expand_image`: the prompt's last ``<image>`` becomes
   ``<|vision_start|>`` + ``<|image_pad|>`` x ``t * h * w / merge^2`` + ``<|vision_end|>``
   (81 pads for a 96x96 frame, 121 for a 300x300 one); these ids are ``("tokens", "prompt")``, so
   the token ledger counts the image's tokens;
4. the model replaces the pads' embeddings by the vision tower's output, and its rotary embedding
   takes M-RoPE positions ``[3, b, L]`` (temporal, height, width) from the model's own
   ``get_rope_index`` over ``input_ids``, ``image_grid_thw`` and the attention mask: the text
   tokens count 0, 1, 2, ... on all three rows, an image's tokens take their grid coordinates.

The rows keep ``pixels``, not ``pixel_values`` (27 KB for a 96x96 frame instead of 1.5 MB of
float32 patches): the scorer redoes steps 2 and 4 from them with the same function, so generation
and training see the same inputs. Earlier steps' ``<image>`` placeholders in a memory's history
stay plain text: every prompt holds one image, the current frame (the reference's).
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from torchrl_agent.envs.base import IMAGE_PLACEHOLDER
from torchrl_agent.models.tiny_vl import process_image
from torchrl_agent.modules.logprobs import ResponseLogProbs
from torchrl_agent.modules.policy import Generation
from torchrl_agent.modules.transformers_policy import TransformersPolicy

__all__ = ["VISION_PLACEHOLDER", "VisionPolicy", "VisionResponseLogProbs", "expand_image", "image_inputs",
           "placeholder_token_ids", "prompt_with_image", "rope_positions", "set_image_tokens", "transformers_engine"]

#: Qwen's unexpanded image placeholder (what its processors' chat templates write for an image part).
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
#: The reference's ``process_image`` bounds on an image's area.
MIN_PIXELS, MAX_PIXELS = 256 * 256, 2048 * 2048


def image_inputs(processor, frames, *, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> dict:
    """The image processor's inputs for ``frames`` (uint8 ``[n, H, W, 3]``, or a list of ``[H, W, 3]``).

    Returns ``pixel_values`` ``[P, C]`` float32 (the ``n`` images' patches, one after the other) and
    ``image_grid_thw`` ``[n, 3]`` int64 (patches per image along time, height, width).
    """
    images = [process_image(frame, min_pixels=min_pixels, max_pixels=max_pixels) for frame in frames]
    out = processor.image_processor(images=images, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def expand_image(prompt: str, image_tokens: int) -> str:
    """``prompt`` with its image (the last ``<image>``, else its one :data:`VISION_PLACEHOLDER`)
    expanded to ``image_tokens`` ``<|image_pad|>`` tokens."""
    if IMAGE_PLACEHOLDER in prompt:
        head, _, tail = prompt.rpartition(IMAGE_PLACEHOLDER)
        prompt = head + VISION_PLACEHOLDER + tail
    if prompt.count(VISION_PLACEHOLDER) != 1:
        raise ValueError(f"a VLM prompt needs one image placeholder ({IMAGE_PLACEHOLDER!r} or {VISION_PLACEHOLDER!r}), "
                         f"found {prompt.count(VISION_PLACEHOLDER)} (env.kwargs.modality=image writes one): "
                         f"{prompt[:120]!r}")
    return prompt.replace("<|image_pad|>", "<|image_pad|>" * image_tokens)


def prompt_with_image(processor, prompt: str, frame, *, min_pixels: int = MIN_PIXELS,
                      max_pixels: int = MAX_PIXELS) -> tuple[str, dict]:
    """``(prompt with its image expanded, image inputs)`` of one prompt and its frame (uint8
    ``[H, W, 3]``): :func:`image_inputs` of the frame, then :func:`expand_image` to the tokens its
    grid gives. What every engine of a VLM tokenizes (here, in a collector process's client)."""
    inputs = image_inputs(processor, [frame], min_pixels=min_pixels, max_pixels=max_pixels)
    return expand_image(prompt, *_image_tokens(processor, inputs["image_grid_thw"])), inputs


def set_image_tokens(tensordict: TensorDictBase, image_token_id: int) -> TensorDictBase:
    """Write ``image_tokens`` ``[b, 1]`` int64: the image pads in each row's ``("tokens", "prompt")``."""
    prompts = tensordict.get(("tokens", "prompt"), as_list=True)
    tensordict.set("image_tokens", torch.tensor([[int((p == image_token_id).sum())] for p in prompts]))
    return tensordict


def transformers_engine(model_path, *, dtype: str = "float32", **kwargs) -> TransformersPolicy:
    """The transformers engine of a model folder: :class:`VisionPolicy` (with the folder's processor)
    for a VLM (:func:`~torchrl_agent.models.is_vision_model`), else :class:`TransformersPolicy`;
    ``kwargs``: the policy's (a VLM's ``min_pixels``, ``max_pixels`` besides)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from torchrl_agent.models import is_vision_model, load_processor

    if is_vision_model(model_path):
        model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        return VisionPolicy(model, load_processor(model_path), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    return TransformersPolicy(model, tokenizer, **kwargs)


def rope_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   image_grid_thw: torch.Tensor) -> torch.Tensor:
    """M-RoPE position ids ``[3, b, L]`` of ``input_ids`` ``[b, L]`` (left or right padded), from the
    model's own ``get_rope_index`` (Qwen2-VL, Qwen2.5-VL): 0 on padding."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    image = (input_ids == base.config.image_token_id).int()  # the modality of each token: 1 image, 0 text
    positions, _ = base.model.get_rope_index(input_ids, mm_token_type_ids=image, image_grid_thw=image_grid_thw,
                                             attention_mask=attention_mask)
    return positions


def placeholder_token_ids(config) -> list[int]:
    """A VLM's image and video placeholder ids (``image_token_id``, ``video_token_id``,
    ``vision_start_token_id``, ``vision_end_token_id`` of its config, those it has). The engines never
    sample them (``suppress_token_ids``) and the scorer gives them probability 0: one in a response
    would be read as a frame's place (the model's forward counts the pads of the whole sequence,
    M-RoPE gives them image positions), so its row could not be scored."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [i for i in (getattr(config, name, None) for name in names) if i is not None]


def _image_tokens(processor, image_grid_thw: torch.Tensor) -> list[int]:
    """Tokens per image after the 2x2 (``merge_size``) merge: ``t * h * w / merge^2``."""
    return (image_grid_thw.prod(-1) // processor.image_processor.merge_size ** 2).tolist()


class VisionPolicy(TransformersPolicy):
    """The transformers rollout engine of a VLM: each prompt with its frame (see the module docstring).

    Reads ``("text", "prompt")`` ``[b]`` str (one ``<image>`` each, the current frame's place) and
    ``pixels`` uint8 ``[b, H, W, 3]``; writes the keys of :class:`~torchrl_agent.modules.LLMPolicy`
    (``("tokens", "prompt")`` holds the expanded image tokens) plus ``image_tokens`` ``[b, 1]``
    int64. Sampling and its log-probs are :class:`TransformersPolicy`'s (same loop, KV cache, seeds);
    the prompt's forward also takes ``pixel_values``, ``image_grid_thw`` and M-RoPE positions
    ``[3, b, L]``, each later token the last positions + 1 on all three rows. The image placeholders
    (:func:`placeholder_token_ids`) are never sampled: a model that puts mass on them (an untrained
    one does) answers with other tokens, and :class:`VisionResponseLogProbs` scores the same
    distribution.

    Args:
        model: a Qwen2-VL or Qwen2.5-VL ``...ForConditionalGeneration`` (shared with the trainer).
        processor: its processor (``image_processor`` and ``tokenizer``;
            :func:`~torchrl_agent.models.tiny_vl.load_processor`).

    Keyword Args:
        min_pixels, max_pixels: bounds on each frame's area before the processor (the reference's
            ``process_image``: ``256^2``, ``2048^2``); ``min_pixels=0`` keeps small frames small
            (a 96x96 frame: 9 image tokens instead of 81).
        **kwargs: :class:`TransformersPolicy`'s (``max_new_tokens``, ``temperature``, ``batch_size``,
            ``request_seeds``, ``max_prompt_tokens``).
    """

    in_keys = [("text", "prompt"), "pixels"]
    out_keys = [*TransformersPolicy.out_keys, "image_tokens"]

    def __init__(self, model, processor, *, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS, **kwargs):
        if kwargs.get("max_prompt_tokens") is None:  # the language model's context, not the config's top level
            text = model.config.get_text_config()
            kwargs["max_prompt_tokens"] = text.max_position_embeddings - kwargs.get("max_new_tokens", 64)
        super().__init__(model, processor.tokenizer, suppress_token_ids=placeholder_token_ids(model.config), **kwargs)
        self.processor = processor
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.image_token_id = model.config.image_token_id

    def image_inputs(self, frames) -> dict:
        """:func:`image_inputs` with this engine's bounds."""
        return image_inputs(self.processor, frames, min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def generate(self, prompts: list[str], seeds: list[int] | None = None, images=None) -> list[Generation]:
        """One response per prompt, prompt ``i`` with frame ``images[i]`` (uint8 ``[H, W, 3]``)."""
        if images is None or len(images) != len(prompts):
            raise ValueError(f"VisionPolicy: {len(prompts)} prompts need as many frames (`pixels`, written by "
                             f"env.kwargs.modality=image), got {None if images is None else len(images)}")
        expanded = [prompt_with_image(self.processor, p, frame, min_pixels=self.min_pixels,
                                      max_pixels=self.max_pixels) for p, frame in zip(prompts, images)]
        return self._generate_encoded([self.encode(p) for p, _ in expanded], seeds, [x for _, x in expanded])

    def _generate_inputs(self, tensordict: TensorDictBase) -> dict:
        return {"images": tensordict.get("pixels")}

    def _prefill(self, input_ids, attention, inputs):
        device = input_ids.device
        grid = torch.cat([x["image_grid_thw"] for x in inputs]).to(device)
        positions = rope_positions(self.model, input_ids, attention, grid)
        return positions, {"pixel_values": torch.cat([x["pixel_values"] for x in inputs]).to(device),
                           "image_grid_thw": grid}

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return set_image_tokens(super().forward(tensordict), self.image_token_id)


class VisionResponseLogProbs(ResponseLogProbs):
    """:class:`~torchrl_agent.modules.ResponseLogProbs` of a VLM: each row's response log-probs given
    its prompt and its frame.

    Reads ``("tokens", "prompt")``, ``("tokens", "response")`` and ``pixels`` ``[N, H, W, 3]`` of the
    rows ``[N]``; writes ``log_prob`` ``[N, T]``, ``mask`` and ``entropy`` as the text scorer does (the
    LM head in chunks, never ``[N, L, V]``). The image inputs are rebuilt from ``pixels`` by
    :func:`image_inputs` with the engine's bounds, the positions by :func:`rope_positions`; a row's
    prompt must hold as many image pads as its frame gives (else the frame is not the one it was
    generated with: an error), and a row without pads (a text prompt) takes no frame. The image
    placeholders have probability 0, as in :class:`VisionPolicy`'s sampling. Gradients reach the
    language model and the vision tower.

    Args:
        model: the VLM (possibly PEFT-wrapped).
        processor: its processor.

    Keyword Args:
        min_pixels, max_pixels: the engine's bounds (:class:`VisionPolicy`).
        **kwargs: :class:`ResponseLogProbs`'s (``temperature``, ``log_prob_key``, ``with_entropy``,
            ``chunk_tokens``); the pad id is the tokenizer's.
    """

    in_keys = [*ResponseLogProbs.in_keys, "pixels"]

    def __init__(self, model, processor, *, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS, **kwargs):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
        super().__init__(model, processor.tokenizer.pad_token_id, suppress_token_ids=placeholder_token_ids(base.config),
                         **kwargs)
        self.processor = processor
        self.min_pixels, self.max_pixels = min_pixels, max_pixels

    def _model_inputs(self, rows: TensorDictBase, batch: dict[str, torch.Tensor]) -> dict:
        input_ids, attention = batch["input_ids"], batch["attention_mask"]
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        pads = (input_ids == base.config.image_token_id).sum(-1).tolist()  # [N]
        seen = [i for i, n in enumerate(pads) if n]
        if not seen:
            return {}
        frames = rows.get("pixels")
        vision = image_inputs(self.processor, [frames[i] for i in seen], min_pixels=self.min_pixels,
                              max_pixels=self.max_pixels)
        expected = _image_tokens(self.processor, vision["image_grid_thw"])
        if expected != [pads[i] for i in seen]:
            raise ValueError(f"VisionResponseLogProbs: the rows' prompts hold {[pads[i] for i in seen]} image tokens, "
                             f"their frames give {expected} (other frames, or other min_pixels/max_pixels than "
                             "the engine's)")
        device = input_ids.device
        grid = vision["image_grid_thw"].to(device)
        return {"pixel_values": vision["pixel_values"].to(device), "image_grid_thw": grid,
                "position_ids": rope_positions(self.model, input_ids, attention, grid)}

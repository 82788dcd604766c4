"""The LLM policy interface: prompts in, response tokens and their sampling log-probs out.

Every engine (transformers, vLLM, HTTP) implements :meth:`LLMPolicy.generate` over a list of
prompt strings; :meth:`LLMPolicy.forward` wraps it as a TensorDict module over a batch ``[b]``
of running environments:

- reads ``("text", "prompt")`` (``[b]`` str);
- writes ``("text", "response")`` (``[b]`` str), and, as ragged per-row tensors,
  ``("tokens", "prompt")`` (int64), ``("tokens", "response")`` (int64) and
  ``("log_probs", "response")`` (float32, one per response token), plus
  ``prompt_too_long`` ``[b, 1]`` (the prompt exceeded the engine's limit: nothing was generated).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase, lazy_stack
from tensordict.nn import TensorDictModuleBase

__all__ = ["Generation", "LLMPolicy"]


@dataclass
class Generation:
    """One prompt's result. ``log_probs[t]`` is the sampling log-prob of ``response_ids[t]``."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    text: str = ""
    prompt_too_long: bool = False
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache, when reported


class LLMPolicy(TensorDictModuleBase, abc.ABC):
    """Base of the rollout engines. Subclasses implement :meth:`generate` (and
    :meth:`update_weights` when the engine holds its own copy of the weights)."""

    in_keys = [("text", "prompt")]
    #: ``generate`` takes ``seeds=`` (one sampling seed per prompt); ``forward`` then passes the
    #: optional ``request_seed`` ``[b]`` entry the collectors write.
    accepts_request_seeds = False
    out_keys = [("text", "response"), ("tokens", "prompt"), ("tokens", "response"), ("log_probs", "response"),
                "prompt_too_long"]

    def __init__(self, tokenizer, *, max_new_tokens: int = 64, temperature: float = 1.0,
                 max_prompt_tokens: int | None = None):
        super().__init__()
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.max_prompt_tokens = max_prompt_tokens

    @abc.abstractmethod
    def generate(self, prompts: list[str]) -> list[Generation]:
        """Generate one response per prompt (batched by the engine)."""

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new weights into the engine (a no-op for engines sharing the trainer's model)."""

    def release_memory(self) -> bool:
        """Free what the engine holds on the accelerator that the update does not need (call it after
        collection, before the update); returns True when something was freed. No-op by default."""
        return False

    def resume(self) -> bool:
        """Undo :meth:`release_memory` before the next generation (engines also do it themselves when
        needed); returns True when the engine was woken. No-op by default."""
        return False

    def encode(self, prompt: str) -> list[int]:
        """The exact prompt token ids (the chat template is already in the text)."""
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        """Response text; invalid UTF-8 byte sequences become U+FFFD, never an error."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _generate_inputs(self, tensordict: TensorDictBase) -> dict:
        """Keyword arguments of :meth:`generate` read from the batch besides the prompts (none here;
        a VLM's frames: :class:`~torchrl_agent.modules.VisionPolicy`)."""
        return {}

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        n = tensordict.batch_size[0]
        prompts = tensordict.get(("text", "prompt"))
        prompts = [prompts] * n if isinstance(prompts, str) else list(prompts.tolist())
        seeds = tensordict.get("request_seed", None) if self.accepts_request_seeds else None
        kwargs = self._generate_inputs(tensordict) | ({} if seeds is None else {"seeds": seeds.tolist()})
        generations = self.generate(prompts, **kwargs)
        rows = [
            TensorDict({
                "prompt": torch.tensor(g.prompt_ids, dtype=torch.int64),
                "response": torch.tensor(g.response_ids, dtype=torch.int64),
            })
            for g in generations
        ]
        tensordict.set("tokens", lazy_stack(rows))
        tensordict.set("log_probs", lazy_stack([
            TensorDict({"response": torch.tensor(g.log_probs, dtype=torch.float32)}) for g in generations]))
        tensordict.set(("text", "response"), NonTensorStack(*[g.text for g in generations], batch_size=[n]))
        tensordict.set("prompt_too_long", torch.tensor([g.prompt_too_long for g in generations]).reshape(n, 1))
        tensordict.set("cached_tokens", torch.tensor([g.cached_tokens for g in generations]).reshape(n, 1))
        return tensordict

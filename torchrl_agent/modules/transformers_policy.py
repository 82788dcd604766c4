"""The transformers rollout engine (the CPU default)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from torchrl_agent.modules.logprobs import ResponseLogProbs, pad_rows  # noqa: F401  (their former home)
from torchrl_agent.modules.policy import Generation, LLMPolicy

__all__ = ["TransformersPolicy"]


class TransformersPolicy(LLMPolicy):
    """Samples over a left-padded batch with a KV cache, scoring each token as it is drawn.

    The sampling log-prob of each token is ``log_softmax(logits / T)`` of the raw logits (no top-k
    or top-p: the distribution sampled from is exactly the one the trainer recomputes). With
    ``temperature=0`` decoding is greedy and log-probs are those of ``T=1``. Memory per call: the KV
    cache and one step's ``[batch, vocabulary]`` float32 scores; no ``[batch, new tokens,
    vocabulary]`` logits are kept (``model.generate(output_logits=True)`` kept them: 20 GB for 64
    rows x 512 tokens of Qwen2.5's 151,936-token vocabulary, ``benchmarks/engine_memory.py``).

    Args:
        model: a causal LM (shared with the trainer: updates are seen at once).
        tokenizer: its tokenizer (``pad_token`` set).
        max_new_tokens, temperature, max_prompt_tokens: see :class:`LLMPolicy`.
        batch_size: at most this many prompts per ``generate`` call.
        request_seeds: sample each prompt alone, seeded by the collector's ``request_seed`` (a
            function of the collector's seed, the trajectory and the step): a row's sample then
            does not depend on which other prompts share the call, so sharded collectors
            (:class:`~torchrl_agent.collectors.RayStepCollector`) give the single-process rows.
            Slower (no batching); the global RNG is left as it was.
        suppress_token_ids: token ids never sampled (their logits are ``-inf``, in the log-probs too):
            a VLM's image placeholders (:class:`~torchrl_agent.modules.VisionPolicy`). The trainer's
            scorer must suppress the same ids (``ResponseLogProbs(suppress_token_ids=...)``).
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 64, request_seeds: bool = False,
                 suppress_token_ids: Sequence[int] = (), **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.model = model
        self.suppress_token_ids = list(suppress_token_ids)
        self.batch_size = batch_size
        self.accepts_request_seeds = request_seeds
        self._keeps_logits: bool | None = None
        if self.max_prompt_tokens is None:
            self.max_prompt_tokens = getattr(model.config, "max_position_embeddings", 4096) - self.max_new_tokens

    def generate(self, prompts: list[str], seeds: list[int] | None = None) -> list[Generation]:
        return self._generate_encoded([self.encode(p) for p in prompts], seeds)

    def _generate_encoded(self, encoded: list[list[int]], seeds: list[int] | None = None,
                          inputs: list | None = None) -> list[Generation]:
        """:meth:`generate` over token id lists; ``inputs[i]`` (optional) is prompt ``i``'s extra model
        input, handed per batch to :meth:`_prefill` (a VLM's image: :class:`VisionPolicy`)."""
        out = [Generation(ids, prompt_too_long=len(ids) > self.max_prompt_tokens) for ids in encoded]
        todo = [i for i, g in enumerate(out) if not g.prompt_too_long]
        if seeds is not None:  # one prompt at a time, each from its own seed
            chunks = [[i] for i in todo]
        else:
            chunks = [todo[start:start + self.batch_size] for start in range(0, len(todo), self.batch_size)]
        for chunk in chunks:
            with torch.random.fork_rng(devices=self._rng_devices(), enabled=seeds is not None):
                if seeds is not None:
                    torch.manual_seed(int(seeds[chunk[0]]))
                results = self._generate_batch([encoded[i] for i in chunk],
                                               None if inputs is None else [inputs[i] for i in chunk])
            for i, (ids, lps) in zip(chunk, results):
                out[i].response_ids, out[i].log_probs, out[i].text = ids, lps, self.decode(ids)
        return out

    def _rng_devices(self) -> list:
        device = next(self.model.parameters()).device
        return [device] if device.type == "cuda" else []

    def release_memory(self) -> bool:
        """Return the CUDA caching allocator's free blocks (the last generate call's KV cache) to the
        device before the update; the weights stay (they are the trainer's, or its engine copy's).
        Returns True when something could be freed (a CUDA model), else False."""
        if next(self.model.parameters()).device.type != "cuda":
            return False
        torch.cuda.empty_cache()
        return True

    def _prefill(self, input_ids: torch.Tensor, attention: torch.Tensor, inputs: list | None) -> tuple[torch.Tensor, dict]:
        """The prompt forward's position ids and extra keyword arguments, for the left-padded
        ``input_ids`` ``[b, L]`` and ``attention`` ``[b, L]``: text positions ``[b, L]`` counted over
        the attended tokens, no extra input. Each later step's positions are the last ones + 1."""
        return (attention.cumsum(-1) - 1).masked_fill_(attention == 0, 1), {}

    @torch.no_grad()
    def _generate_batch(self, batch: list[list[int]], inputs: list | None = None) -> list[tuple[list[int], list[float]]]:
        """Sample up to ``max_new_tokens`` for each prompt of ``batch`` (token id lists), scoring each
        token as it is drawn: ``[b]`` log-probs per step, never the ``[b, t, V]`` logits of a call.

        The loop is ``model.generate``'s sampling with a KV cache (left padding, position ids from the
        attention mask, rows that ended get padding): per step ``p = softmax(logits.float() / T)``,
        ``torch.multinomial(p, 1)`` (greedy: ``argmax``), the same draws from the same generator, so a
        seed gives ``generate``'s tokens. Only the model's own logits are used (``suppress_token_ids``
        at ``-inf``): no generation config of the model folder (repetition penalty, top-k/p) changes
        the distribution sampled from.
        """
        pad = self.tokenizer.pad_token_id
        eos = self.tokenizer.eos_token_id
        device = next(self.model.parameters()).device  # the engine's device (inputs are built on CPU)
        n, width = len(batch), max(len(ids) for ids in batch)
        input_ids = torch.full((n, width), pad, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for row, ids in enumerate(batch):  # left padding
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention[row, width - len(ids):] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions, prefill = self._prefill(input_ids, attention, inputs)
        sample = self.temperature > 0
        temperature = self.temperature if sample else 1.0
        tokens = torch.full((n, self.max_new_tokens), pad, dtype=torch.long, device=device)
        log_probs = torch.zeros((n, self.max_new_tokens), dtype=torch.float32, device=device)
        running = torch.ones(n, dtype=torch.bool, device=device)
        suppressed = torch.tensor(self.suppress_token_ids, dtype=torch.long, device=device)
        cache, step_ids, steps = None, input_ids, 0
        with _inference_mode(self.model):
            for t in range(self.max_new_tokens):
                out = self.model(input_ids=step_ids, attention_mask=attention, position_ids=positions,
                                 past_key_values=cache, use_cache=True, **self._last_logit_only, **prefill)
                prefill = {}  # the prompt's extra inputs (an image) are in the KV cache now
                cache = out.past_key_values
                scores = out.logits[:, -1, :].float() / temperature  # [b, V], this step only
                del out
                if len(suppressed):
                    scores.index_fill_(-1, suppressed, float("-inf"))
                if sample:
                    token = torch.multinomial(F.softmax(scores, dim=-1), num_samples=1).squeeze(1)
                else:
                    token = scores.argmax(dim=-1)
                token = torch.where(running, token, torch.full_like(token, pad))
                log_probs[:, t] = F.log_softmax(scores, dim=-1).gather(-1, token[:, None]).squeeze(-1)
                tokens[:, t] = token
                steps = t + 1
                running &= token != eos
                if not bool(running.any()):
                    break
                step_ids = token[:, None]
                attention = torch.cat([attention, attention.new_ones(n, 1)], dim=-1)
                positions = positions[..., -1:] + 1  # [b, 1] (or M-RoPE's [3, b, 1])
        tokens, log_probs = tokens[:, :steps].tolist(), log_probs[:, :steps].tolist()
        results = []
        for ids, lps in zip(tokens, log_probs):
            end = ids.index(eos) + 1 if eos in ids else len(ids)  # keep the eos token: it was sampled
            results.append((ids[:end], lps[:end]))
        return results

    @property
    def _last_logit_only(self) -> dict:
        """``logits_to_keep=1`` when the model's forward takes it: the prompt's forward computes the
        head at its last position only, not ``[b, prompt, V]`` logits."""
        if self._keeps_logits is None:
            forward = getattr(self.model, "get_base_model", lambda: self.model)().forward
            self._keeps_logits = "logits_to_keep" in inspect.signature(forward).parameters
        return {"logits_to_keep": 1} if self._keeps_logits else {}


@contextlib.contextmanager
def _inference_mode(model):
    """``model.eval()`` for the ``with`` block (the engine may share the trainer's model, in train
    mode: gradient checkpointing would turn the KV cache off), then each module's mode restored."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training

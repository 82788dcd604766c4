"""The transformers rollout engine (the CPU default)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchrl_agent.modules.logprobs import ResponseLogProbs, pad_rows  # noqa: F401  (their former home)
from torchrl_agent.modules.policy import Generation, LLMPolicy

__all__ = ["TransformersPolicy"]


class TransformersPolicy(LLMPolicy):
    """Samples with ``model.generate`` over a left-padded batch.

    The sampling log-prob of each token is ``log_softmax(logits / T)`` of the raw logits (no top-k
    or top-p: the distribution sampled from is exactly the one the trainer recomputes). With
    ``temperature=0`` decoding is greedy and log-probs are those of ``T=1``.

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
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 64, request_seeds: bool = False, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.model = model
        self.batch_size = batch_size
        self.accepts_request_seeds = request_seeds
        if self.max_prompt_tokens is None:
            self.max_prompt_tokens = getattr(model.config, "max_position_embeddings", 4096) - self.max_new_tokens

    def generate(self, prompts: list[str], seeds: list[int] | None = None) -> list[Generation]:
        encoded = [self.encode(p) for p in prompts]
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
                results = self._generate_batch([encoded[i] for i in chunk])
            for i, (ids, lps) in zip(chunk, results):
                out[i].response_ids, out[i].log_probs, out[i].text = ids, lps, self.decode(ids)
        return out

    def _rng_devices(self) -> list:
        device = next(self.model.parameters()).device
        return [device] if device.type == "cuda" else []

    @torch.no_grad()
    def _generate_batch(self, batch: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        pad = self.tokenizer.pad_token_id
        eos = self.tokenizer.eos_token_id
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):  # left padding
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention[row, width - len(ids):] = 1
        device = next(self.model.parameters()).device  # the engine's device (inputs are built on CPU)
        input_ids, attention = input_ids.to(device), attention.to(device)
        sample = self.temperature > 0
        output = self.model.generate(
            input_ids=input_ids, attention_mask=attention, max_new_tokens=self.max_new_tokens,
            do_sample=sample, temperature=self.temperature if sample else None, top_k=0 if sample else None,
            top_p=1.0 if sample else None, pad_token_id=pad, eos_token_id=eos,
            return_dict_in_generate=True, output_logits=True,
        )
        new = output.sequences[:, width:]
        logits = torch.stack(output.logits, dim=1).float()  # [b, t, V], raw (unprocessed)
        logp = F.log_softmax(logits / (self.temperature if sample else 1.0), dim=-1)
        token_logp = logp.gather(-1, new[:, : logp.shape[1], None]).squeeze(-1)
        results = []
        for row in range(len(batch)):
            ids = new[row].tolist()
            end = ids.index(eos) + 1 if eos in ids else len(ids)  # keep the eos token: it was sampled
            results.append((ids[:end], token_logp[row, :end].tolist()))
        return results

"""The transformers rollout engine (the CPU default) and the trainer-side log-prob module."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from torchrl_agent.modules.policy import Generation, LLMPolicy

__all__ = ["ResponseLogProbs", "TransformersPolicy", "pad_rows"]


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
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 64, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.model = model
        self.batch_size = batch_size
        if self.max_prompt_tokens is None:
            self.max_prompt_tokens = getattr(model.config, "max_position_embeddings", 4096) - self.max_new_tokens

    def generate(self, prompts: list[str]) -> list[Generation]:
        encoded = [self.encode(p) for p in prompts]
        out = [Generation(ids, prompt_too_long=len(ids) > self.max_prompt_tokens) for ids in encoded]
        todo = [i for i, g in enumerate(out) if not g.prompt_too_long]
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start:start + self.batch_size]
            for i, (ids, lps) in zip(chunk, self._generate_batch([encoded[i] for i in chunk])):
                out[i].response_ids, out[i].log_probs, out[i].text = ids, lps, self.decode(ids)
        return out

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


def pad_rows(rows: TensorDictBase, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad each row's prompt + response into one sequence.

    Returns ``input_ids`` ``[N, L]``, ``attention_mask`` ``[N, L]``, ``response_mask`` ``[N, T]``
    and ``response_start`` ``[N]`` (index of the first response token in its sequence), where
    ``T`` is the longest response.
    """
    n = rows.batch_size[0]
    prompts = [rows[i]["tokens", "prompt"] for i in range(n)]
    responses = [rows[i]["tokens", "response"] for i in range(n)]
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    t_max = max(1, max(len(r) for r in responses))
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    response_mask = torch.zeros((n, t_max), dtype=torch.bool)
    start = torch.zeros(n, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq = torch.cat([p, r])
        input_ids[i, : len(seq)] = seq
        attention[i, : len(seq)] = 1
        response_mask[i, : len(r)] = True
        start[i] = len(p)
    return {"input_ids": input_ids, "attention_mask": attention, "response_mask": response_mask,
            "response_start": start}


class ResponseLogProbs(TensorDictModuleBase):
    """Recomputes the per-token log-probs (and entropies) of each row's response.

    Reads the ragged ``("tokens", "prompt")`` and ``("tokens", "response")`` of a rows TensorDict
    ``[N]``; writes padded ``log_prob`` ``[N, T]``, ``entropy`` ``[N, T]`` and ``mask`` ``[N, T]``
    (True on response tokens). Gradients flow into ``model`` unless called under ``no_grad``.
    ``log_prob_key`` renames the output (``old_log_prob``, ``ref_log_prob``).
    """

    in_keys = [("tokens", "prompt"), ("tokens", "response")]

    def __init__(self, model, pad_token_id: int, *, temperature: float = 1.0, log_prob_key: str = "log_prob",
                 with_entropy: bool = True):
        super().__init__()
        self.model = model
        self.pad_token_id = pad_token_id
        self.temperature = temperature if temperature > 0 else 1.0
        self.log_prob_key = log_prob_key
        self.with_entropy = with_entropy
        self.out_keys = [log_prob_key, "mask"] + (["entropy"] if with_entropy else [])

    def forward(self, rows: TensorDictBase) -> TensorDictBase:
        device = next(self.model.parameters()).device  # outputs live on the model's device
        batch = {k: v.to(device) for k, v in pad_rows(rows, self.pad_token_id).items()}
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logits = logits.float() / self.temperature
        n, t_max = batch["response_mask"].shape
        # logits at position j predict token j+1: response token k sits at start+k, predicted at start+k-1
        positions = (batch["response_start"][:, None] - 1 + torch.arange(t_max, device=device)[None]).clamp(
            max=logits.shape[1] - 1)
        picked = logits.gather(1, positions[..., None].expand(n, t_max, logits.shape[-1]))  # [N, T, V]
        targets = batch["input_ids"].gather(1, (positions + 1).clamp(max=batch["input_ids"].shape[1] - 1))
        logp_all = F.log_softmax(picked, dim=-1)
        mask = batch["response_mask"]
        rows.set(self.log_prob_key, logp_all.gather(-1, targets[..., None]).squeeze(-1) * mask)
        rows.set("mask", mask)
        if self.with_entropy:
            rows.set("entropy", -(logp_all.exp() * logp_all).sum(-1) * mask)
        return rows

"""Trainer-side log-probs and entropies of response tokens, computed without the vocabulary tensor.

A causal LM's head turns every position's hidden state into ``V`` logits. At the paper's scale
(256 rows x 1,500 tokens x 151,936 vocabulary) the ``[rows, sequence, vocabulary]`` float32 tensor
of all logits is hundreds of GB. :class:`ResponseLogProbs` never builds it: during the model's own
forward, the LM head is stood in for by :class:`ChunkedResponseHead`, which picks the hidden states
that predict response tokens (``M`` of them, no prompt and no padding position) and runs the head
over chunks of ``chunk_tokens`` of them::

    logits  = head(h[chunk]).float() / T          # [C, V], the only vocabulary-sized tensor
    logp    = log_softmax(logits)[target]         # [C]
    entropy = -(exp(log_softmax) * log_softmax).sum(-1)

With gradients, each chunk is recomputed in the backward (``torch.utils.checkpoint``): only the
``[C, V]`` tensors of one chunk exist at a time, forward or backward. Running inside the model's
forward keeps FSDP2's hooks in charge of the (gathered) head weight, and ``autocast`` / a
``MixedPrecisionPolicy`` apply to the head as to any other layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint

__all__ = ["ChunkedResponseHead", "ResponseLogProbs", "pad_rows", "token_log_probs"]


def pad_rows(rows: TensorDictBase, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad each row's prompt + response into one sequence.

    Returns ``input_ids`` ``[N, L]``, ``attention_mask`` ``[N, L]``, ``response_mask`` ``[N, T]``
    and ``response_start`` ``[N]`` (index of the first response token in its sequence), where
    ``T`` is the longest response.
    """
    # the ragged rows as lists (tensordict's ``as_list``), joined per row and padded by torch; TorchRL's
    # ``("tokens", "full")`` is not read: our collectors' rows carry prompt and response only
    prompts = rows.get(("tokens", "prompt"), as_list=True)
    responses = rows.get(("tokens", "response"), as_list=True)
    sequences = [torch.cat([p, r]).long() for p, r in zip(prompts, responses)]
    input_ids = pad_sequence(sequences, batch_first=True, padding_value=pad_token_id)
    seq_len = torch.tensor([len(x) for x in sequences], device=input_ids.device)
    response_len = torch.tensor([len(r) for r in responses], device=input_ids.device)
    width = max(1, int(response_len.max()))
    return {"input_ids": input_ids,
            "attention_mask": (torch.arange(input_ids.shape[1], device=input_ids.device) < seq_len[:, None]).long(),
            "response_mask": torch.arange(width, device=input_ids.device) < response_len[:, None],
            "response_start": seq_len - response_len}


def _chunk_log_probs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                     with_entropy: bool, suppressed: torch.Tensor | None = None) -> torch.Tensor:
    logits = head(hidden).float() / temperature  # [C, V]
    if suppressed is not None:  # tokens the engine never samples: probability 0 (finite, so 0 * log 0 stays 0)
        logits = logits.index_fill(-1, suppressed, torch.finfo(logits.dtype).min)
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return logp[:, None]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return torch.stack([logp, entropy], dim=-1)


def token_log_probs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                    chunk_tokens: int = 1024, with_entropy: bool = True,
                    suppressed: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probs (and entropies) of ``targets`` under ``log_softmax(head(hidden) / temperature)``,
    with the ``suppressed`` token ids' logits at ``-inf`` (the engine's ``suppress_token_ids``).

    Args:
        head: the LM head (``hidden -> logits``), e.g. ``model.get_output_embeddings()``.
        hidden: ``[M, H]`` hidden states, one per predicted token.
        targets: ``[M]`` int64, the predicted token ids.

    Keyword Args:
        temperature: the sampling temperature (``> 0``).
        chunk_tokens: at most this many tokens' ``[C, V]`` logits exist at once.
        with_entropy: also return the entropy of each token's distribution.
        suppressed: ``[S]`` int64 token ids given probability 0 (``None``: none).

    Returns:
        ``[M, 2]`` float32 (log-prob, entropy), or ``[M, 1]`` without entropy. With gradients
        enabled each chunk is recomputed in the backward instead of keeping its logits.
    """
    if chunk_tokens < 1:
        raise ValueError(f"`chunk_tokens` must be >= 1, got {chunk_tokens}")
    track = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    out = []
    for start in range(0, max(hidden.shape[0], 1), chunk_tokens):  # an empty input still runs (FSDP2's hooks)
        h, y = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if track:
            out.append(checkpoint(_chunk_log_probs, head, h, y, temperature, with_entropy, suppressed,
                                  use_reentrant=False))
        else:
            out.append(_chunk_log_probs(head, h, y, temperature, with_entropy, suppressed))
    return torch.cat(out)


class ChunkedResponseHead(nn.Module):
    """Stands in for a causal LM's head during one forward (see :meth:`swapped_into`).

    Called by the model with its final hidden states ``[N, L, H]``, it returns
    :func:`token_log_probs` at the ``positions`` ``(row [M], column [M])`` for ``targets`` ``[M]``:
    ``[M, 2]`` (or ``[M, 1]``), which the model hands back as its ``logits``.
    """

    def __init__(self, head: nn.Module, positions: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor, *,
                 temperature: float, chunk_tokens: int, with_entropy: bool, suppressed: torch.Tensor | None = None):
        super().__init__()
        self.head = head
        self.positions, self.targets = positions, targets
        self.temperature, self.chunk_tokens, self.with_entropy = temperature, chunk_tokens, with_entropy
        self.suppressed = suppressed
        self.calls = 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return token_log_probs(self.head, hidden[self.positions], self.targets, temperature=self.temperature,
                               chunk_tokens=self.chunk_tokens, with_entropy=self.with_entropy,
                               suppressed=self.suppressed)

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module):
        """Installs this head as ``model``'s output embeddings for the ``with`` block, then restores
        the original (the same module object, so parameter names and FSDP2 sharding are unchanged)."""
        model.set_output_embeddings(self)
        try:
            yield self
        finally:
            model.set_output_embeddings(self.head)


class ResponseLogProbs(TensorDictModuleBase):
    """Recomputes the per-token log-probs (and entropies) of each row's response.

    Reads the ragged ``("tokens", "prompt")`` and ``("tokens", "response")`` of a rows TensorDict
    ``[N]``; writes padded ``log_prob`` ``[N, T]``, ``entropy`` ``[N, T]`` (float32, 0 on padding)
    and ``mask`` ``[N, T]`` (True on response tokens). Gradients flow into ``model`` unless called
    under ``no_grad``. Only response positions reach the LM head, ``chunk_tokens`` at a time (see the
    module docstring): no ``[N, L, V]`` tensor is ever built. ``log_prob_key`` renames the output
    (``old_log_prob``, ``ref_log_prob``). TorchRL's ``TransformersWrapper(generate=False)`` is not used
    for this: it returns log-probs of the full sequence from the full ``[N, L, V]`` logits.

    Args:
        model: a Hugging Face causal LM (``get_output_embeddings`` / ``set_output_embeddings``),
            possibly FSDP2-sharded or wrapped by PEFT.
        pad_token_id: the id used for padding.

    Keyword Args:
        temperature: logits are divided by it (``<= 0`` means 1, greedy decoding's log-probs).
        log_prob_key: the output key of the log-probs.
        with_entropy: also write ``entropy``.
        chunk_tokens: response tokens per head chunk (memory: ``chunk_tokens x V`` float32 a few times).
        suppress_token_ids: token ids the engine never samples (its ``suppress_token_ids``: a VLM's
            image placeholders), given probability 0 here too, so both score the same distribution.
    """

    in_keys = [("tokens", "prompt"), ("tokens", "response")]

    def __init__(self, model, pad_token_id: int, *, temperature: float = 1.0, log_prob_key: str = "log_prob",
                 with_entropy: bool = True, chunk_tokens: int = 1024, suppress_token_ids: Sequence[int] = ()):
        super().__init__()
        if chunk_tokens < 1:
            raise ValueError(f"`chunk_tokens` must be >= 1, got {chunk_tokens}")
        self.model = model
        self.pad_token_id = pad_token_id
        self.temperature = temperature if temperature > 0 else 1.0
        self.log_prob_key = log_prob_key
        self.with_entropy = with_entropy
        self.chunk_tokens = chunk_tokens
        self.suppress_token_ids = list(suppress_token_ids)
        self.out_keys = [log_prob_key, "mask"] + (["entropy"] if with_entropy else [])

    def _model_inputs(self, rows: TensorDictBase, batch: dict[str, torch.Tensor]) -> dict:
        """The model's keyword arguments besides ``input_ids`` and ``attention_mask`` for the padded
        ``batch`` (:func:`pad_rows`, on the model's device) of ``rows``: none for a causal LM; a VLM's
        image inputs and M-RoPE positions (:class:`~torchrl_agent.modules.VisionResponseLogProbs`).
        A VLM's text rows score here; rows with image tokens are refused (without their frames the
        model would read the pads as text tokens)."""
        image_token_id = getattr(self.model.config, "image_token_id", None)
        if image_token_id is not None and bool((batch["input_ids"] == image_token_id).any()):
            raise ValueError(f"{type(self).__name__}: the rows' prompts hold image tokens; score a VLM's image rows "
                             "with VisionResponseLogProbs (their pixels give the image inputs)")
        return {}

    def forward(self, rows: TensorDictBase) -> TensorDictBase:
        device = next(self.model.parameters()).device  # outputs live on the model's device
        batch = {k: v.to(device) for k, v in pad_rows(rows, self.pad_token_id).items()}
        mask = batch["response_mask"]  # [N, T]
        row, col = mask.nonzero(as_tuple=True)  # response token `col` of row `row`, M of them
        # logits at position j predict token j+1: response token k sits at start+k, predicted at start+k-1
        position = batch["response_start"][row] + col - 1
        targets = batch["input_ids"][row, position + 1]
        head = ChunkedResponseHead(self.model.get_output_embeddings(), (row, position), targets,
                                   temperature=self.temperature, chunk_tokens=self.chunk_tokens,
                                   with_entropy=self.with_entropy,
                                   suppressed=torch.tensor(self.suppress_token_ids, device=device)
                                   if self.suppress_token_ids else None)
        extra = self._model_inputs(rows, batch)
        with head.swapped_into(self.model):
            out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra).logits
        if head.calls != 1:
            raise RuntimeError(f"{type(self.model).__name__} did not call its output embeddings module once "
                               f"(called {head.calls} times): ResponseLogProbs cannot stand in for its LM head")
        zeros = torch.zeros(mask.shape, dtype=torch.float32, device=device)
        rows.set(self.log_prob_key, zeros.index_put((row, col), out[:, 0]))
        rows.set("mask", mask)
        if self.with_entropy:
            rows.set("entropy", zeros.index_put((row, col), out[:, 1]))
        return rows

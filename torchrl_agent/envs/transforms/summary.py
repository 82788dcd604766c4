"""Summary memory: the last ``k`` steps verbatim, everything older compressed into a running summary.

The summary is written by a *summariser* engine (any :class:`~torchrl_agent.modules.LLMPolicy`:
the policy itself or another model) and stored **in the memory state**, as the first record::

    {"summary": "<text>", "through": 4}        # steps 0..4 are summarised
    {"step": 5, "observation": ..., "action": ...}
    {"step": 6, "observation": ..., "action": ...}

so a row's prompt is replayed from the row alone (:meth:`PromptTransform.render_row`), without the
summariser: ``load_memory`` rebuilds ``SummaryMemory(**params)`` with ``summarizer=None``, which
only renders.

Summarisation is batched across environments: at each environment step, every environment whose
verbatim window overflowed gets one summariser prompt (its previous summary plus the records that
leave the window), and all of them go to the engine in **one** ``generate`` call. Environments that
are already done take no slot. Whatever text comes back is the new summary (a garbage output is a
garbage summary, never an error), cut to ``max_summary_tokens`` response tokens.

Under a :class:`PromptTransform` token budget the summary, being the oldest record, is dropped
first (then the oldest verbatim records); the next summary then starts afresh from the records
leaving the window.
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDictBase

from torchrl_agent.envs.base import clean_text
from torchrl_agent.envs.transforms.memory import MemoryTransform, _string_stack, _strings

__all__ = ["SUMMARY_TEMPLATE", "SummaryMemory"]

#: The default summariser prompt. Fields: ``{task}``, ``{summary}`` (the previous summary, or
#: "(nothing yet)"), ``{steps}`` (the records leaving the verbatim window, one per line).
SUMMARY_TEMPLATE = (
    "You keep the notes of an agent acting in a text environment, so that it can continue without "
    "its full history.\n"
    "Task: {task}\n"
    "Notes so far: {summary}\n"
    "New steps:\n{steps}\n"
    "Rewrite the notes in a few short sentences: what the agent has done, what it has found, and what "
    "remains to do. Answer with the notes only."
)


def _step_line(record: dict) -> str:
    return f"[Step {record['step'] + 1}] Observation: {record['observation']} Action: {record['action']}"


class SummaryMemory(MemoryTransform):
    """The last ``k`` (observation, action) pairs verbatim, older ones in a running summary.

    Args:
        k: verbatim records kept (``>= 0``).
        summarizer: the engine writing summaries (an ``LLMPolicy``: ``generate(prompts) ->
            list[Generation]`` and a ``tokenizer``). Not serialised: ``None`` (what replay builds)
            renders only, and stepping with it raises once a summary is needed.
        max_summary_tokens: the summary keeps at most this many of the summariser's response tokens.
        summarize_every: summarise once this many records wait beyond the window (``1``: every step
            after the first ``k``; larger values call the summariser less often, and the window then
            holds between ``k`` and ``k + summarize_every - 1`` records).
        template: the summariser prompt (fields ``{task}``, ``{summary}``, ``{steps}``), sent as one
            user message through the summariser tokenizer's chat template. Not serialised (replay
            does not need it).

    Keys: as :class:`MemoryTransform`; also reads ``task`` and ``done`` (done environments are not
    summarised). ``params`` (serialised) are ``k``, ``max_summary_tokens`` and ``summarize_every``.

    Examples:
        >>> memory = SummaryMemory(k=2, summarizer=policy)   # doctest: +SKIP
        >>> env = TransformedEnv(base_env, Compose(memory, PromptTransform(tok), ActionProjection()))  # doctest: +SKIP
    """

    kind = "summary"

    def __init__(self, k: int = 2, *, summarizer: Any = None, max_summary_tokens: int = 128,
                 summarize_every: int = 1, template: str | None = None):
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"SummaryMemory: k must be an int >= 0, got {k!r}")
        if not isinstance(max_summary_tokens, int) or max_summary_tokens < 1:
            raise ValueError(f"SummaryMemory: max_summary_tokens must be an int >= 1, got {max_summary_tokens!r}")
        if not isinstance(summarize_every, int) or summarize_every < 1:
            raise ValueError(f"SummaryMemory: summarize_every must be an int >= 1, got {summarize_every!r}")
        if summarizer is not None and not callable(getattr(summarizer, "generate", None)):
            raise TypeError("SummaryMemory: summarizer must be an LLMPolicy (with a generate(prompts) method) "
                            f"or None, got {type(summarizer).__name__}")
        template = SUMMARY_TEMPLATE if template is None else template
        try:
            template.format(task="", summary="", steps="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"SummaryMemory: bad template field {err}; allowed fields are task, summary, steps") \
                from err
        super().__init__(k=k, max_summary_tokens=max_summary_tokens, summarize_every=summarize_every)
        self.k, self.max_summary_tokens, self.summarize_every = k, max_summary_tokens, summarize_every
        self.summarizer = summarizer
        self.template = template

    @classmethod
    def from_config(cls, cfg, policy=None):
        return cls(cfg.k, summarizer=policy, max_summary_tokens=cfg.max_summary_tokens,
                   summarize_every=cfg.summarize_every)

    @classmethod
    def fills_history(cls, cfg):
        return True

    # ---------------------------------------------------------------- pure functions
    @staticmethod
    def split(records: list[dict]) -> tuple[dict | None, list[dict]]:
        """``(summary_record or None, verbatim_records)``."""
        if records and "summary" in records[0]:
            return records[0], records[1:]
        return None, list(records)

    def update(self, records, record):
        """Append ``record``; records beyond the window stay until :meth:`summarize` folds them in."""
        return records + [record]

    def pending(self, records: list[dict]) -> list[dict]:
        """The verbatim records to fold into the summary now (empty when none is due)."""
        _, verbatim = self.split(records)
        overflow = len(verbatim) - self.k
        return verbatim[:overflow] if overflow >= self.summarize_every else []

    def render(self, records):
        summary, verbatim = self.split(records)
        parts = []
        if summary is not None:
            parts.append(f"Summary of steps 1-{summary['through'] + 1}: {summary['summary']}")
        if verbatim:
            parts.append(f"Your last {len(verbatim)} steps:\n" + "\n".join(_step_line(r) for r in verbatim))
        return "\n".join(parts), []

    def summary_prompt(self, task: str, records: list[dict]) -> str:
        """The summariser's chat prompt for one environment whose window overflowed."""
        summary, _ = self.split(records)
        content = self.template.format(task=task, summary=summary["summary"] if summary else "(nothing yet)",
                                       steps="\n".join(_step_line(r) for r in self.pending(records)))
        tokenizer = getattr(self.summarizer, "tokenizer", None)
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            return content
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)

    def summary_text(self, generation) -> str:
        """The summary from one :class:`~torchrl_agent.modules.policy.Generation`: its first
        ``max_summary_tokens`` response tokens, decoded, stripped. Never raises."""
        ids = list(generation.response_ids or [])
        decode = getattr(self.summarizer, "decode", None)
        if ids and decode is not None:
            text = decode(ids[: self.max_summary_tokens])
        else:  # an engine reporting text only: bound it by characters (a token is rarely over 16)
            text = (generation.text or "")[: 16 * self.max_summary_tokens]
        return clean_text(text).strip()

    def fold(self, records: list[dict], summary: str) -> list[dict]:
        """Replace the summary and the pending records by ``summary`` (keeps the rest verbatim)."""
        folded = self.pending(records)
        _, verbatim = self.split(records)
        return [{"summary": summary, "through": folded[-1]["step"]}] + verbatim[len(folded):]

    # ---------------------------------------------------------------- TorchRL plumbing
    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        n = tensordict.batch_size.numel()
        tasks = _strings(tensordict.get("task", None), n)
        updated = self.updated_records(tensordict)
        new_records = [records for records, _, _ in updated]
        dropped = [d for _, d, _ in updated]
        due = [i for i, (records, _, stepped) in enumerate(updated) if stepped and self.pending(records)]
        if due:  # one batched call for every environment that needs a new summary
            if self.summarizer is None:
                raise RuntimeError("SummaryMemory: a summary is due but summarizer is None; pass "
                                   "summarizer=<an LLMPolicy> to step (None only renders, e.g. for replay)")
            generations = self.summarizer.generate([self.summary_prompt(tasks[i], new_records[i]) for i in due])
            if len(generations) != len(due):
                raise RuntimeError(f"SummaryMemory: summarizer returned {len(generations)} generations "
                                   f"for {len(due)} prompts")
            for i, generation in zip(due, generations):
                if generation.prompt_too_long:  # nothing generated: keep the previous summary text
                    previous, _ = self.split(new_records[i])
                    text = previous["summary"] if previous else ""
                else:
                    text = self.summary_text(generation)
                new_records[i] = self.fold(new_records[i], text)
        out = [self.dumps(r, d) for r, d in zip(new_records, dropped)]
        next_tensordict.set("memory", _string_stack(out, next_tensordict.batch_size))
        return next_tensordict

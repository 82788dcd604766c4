"""Memory transforms: what of the episode so far goes into the next prompt.

The memory state is data, not hidden transform state: it lives in the ``memory`` key of every
step as a JSON string ``{"kind": ..., "params": ..., "records": [...], "dropped": int}``, so any
step's prompt can be rebuilt from that step's row alone (:meth:`PromptTransform.render_row`).

A record is written when a step is taken, from the step's input: the observation **before** the
action, and the projected action (the command the environment received: for a response without
action tags, the last 30 characters of the lower-cased response, as the reference does); :class:`FullHistory` also keeps the raw response.

Writing a new memory means subclassing :class:`MemoryTransform` and overriding two pure
functions, :meth:`~MemoryTransform.update` (records, new record -> records) and
:meth:`~MemoryTransform.render` (records -> history text and earlier chat turns).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase
from torchrl.data import Composite, NonTensor
from torchrl.envs import Transform

from torchrl_agent.envs.base import clean_text

__all__ = ["MEMORY_REGISTRY", "FullHistory", "MemoryTransform", "NoHistory", "WindowMemory", "load_memory"]

#: kind -> MemoryTransform subclass, filled by ``__init_subclass__``; used to replay a row.
MEMORY_REGISTRY: dict[str, type[MemoryTransform]] = {}


def _strings(value, n: int) -> list[str]:
    """A string entry of any batch shape (or ``None``: all ``""``) as ``n`` strings, flattened row-major."""
    if value is None:
        return [""] * n
    if not isinstance(value, str):
        value = value.tolist()  # nested lists for a batch of more than one dimension
    if isinstance(value, str):  # one string for the whole batch (a scalar batch, or a NonTensorData)
        return [clean_text(value)] * n
    while value and isinstance(value[0], list):
        value = [v for row in value for v in row]
    return [clean_text(v) for v in value]


def _string_stack(strings: list[str], shape: torch.Size):
    """``strings`` (flattened row-major) as an entry of batch ``shape`` (the inverse of :func:`_strings`)."""
    if len(shape) == 1:
        return NonTensorStack(*strings, batch_size=shape)
    if not shape:  # a scalar batch holds one string
        return NonTensorData(strings[0])
    return NonTensorStack(*strings, batch_size=[len(strings)]).reshape(shape)


class MemoryTransform(Transform):
    """Base of all memories. Reads the step's ``observation``, ``action``, ``action_valid`` and
    ``("text", "response")``; writes ``memory`` (``[*B]`` str, any batch shape ``B``) at reset and after every step.

    Subclasses set ``kind`` and override :meth:`update` and :meth:`render`; constructor
    keyword arguments are stored in ``params`` and serialised with the state, so
    ``load_memory(row["memory"])`` rebuilds the same memory. Setting ``kind`` registers the class in
    :data:`MEMORY_REGISTRY`, the one list of ``memory.kind`` names: a run config builds it through
    :meth:`from_config`, and :meth:`fills_history` says whether the template needs a ``{history}`` slot.
    """

    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.kind:
            MEMORY_REGISTRY[cls.kind] = cls

    def __init__(self, **params: Any):
        super().__init__(in_keys=[], out_keys=["memory"])
        self.params = params

    @classmethod
    def from_config(cls, cfg: Any, policy: Any = None) -> MemoryTransform:
        """This memory for a ``memory`` config section (``k``, ``max_summary_tokens``, ...; read duck-typed);
        ``policy``: the run's rollout engine (a summarising memory's summariser)."""
        return cls()

    @classmethod
    def fills_history(cls, cfg: Any) -> bool:
        """Whether this memory, configured by ``cfg``, writes lines that only a template with a
        ``{history}`` slot shows (checked at start: without the slot the model would never see them)."""
        return False

    # ---------------------------------------------------------------- the two functions to override
    def update(self, records: list[dict], record: dict) -> list[dict]:
        """Return the records after one more step. ``record`` has ``step``, ``observation``,
        ``action``, ``response`` and ``valid``. Pure: do not mutate ``records``."""
        raise NotImplementedError

    def render(self, records: list[dict]) -> tuple[str, list[dict]]:
        """Return ``(history_text, earlier_turns)``: text for the template's ``{history}`` slot,
        and chat messages placed before the current user message (multi-turn memories)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- state <-> string
    def dumps(self, records: list[dict], dropped: int = 0) -> str:
        return json.dumps({"kind": self.kind, "params": self.params, "records": records, "dropped": dropped},
                          ensure_ascii=False)

    @staticmethod
    def loads(state: str) -> tuple[list[dict], int]:
        data = json.loads(state) if state else {}
        return data.get("records", []), data.get("dropped", 0)

    def make_record(self, step: int, observation: str, action: str, response: str, valid: bool) -> dict:
        # the projected action, as the reference's memory stores it: for a response without action
        # tags the projection already made it the tail of the lower-cased response
        return {"step": step, "observation": observation, "action": action}

    # ---------------------------------------------------------------- TorchRL plumbing
    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        shape = tensordict_reset.batch_size
        n = shape.numel()
        mask = tensordict.get("_reset", None) if tensordict is not None else None
        previous = _strings(tensordict.get("memory", None), n) if tensordict is not None else [""] * n
        fresh = self.dumps([])
        mask = [True] * n if mask is None else mask.reshape(n).tolist()
        states = [fresh if m or not p else p for m, p in zip(mask, previous)]
        tensordict_reset.set("memory", _string_stack(states, shape))
        return tensordict_reset

    def updated_records(self, tensordict: TensorDictBase) -> list[tuple[list[dict], int, bool]]:
        """For each environment of a step's input: ``(records, dropped, stepped)``, the records after
        this step, flattened row-major over the batch dimensions. A game already done ignores the
        action, so its memory stays as it is."""
        n = tensordict.batch_size.numel()
        states = _strings(tensordict.get("memory", None), n)
        observations = _strings(tensordict.get("observation", None), n)
        actions = _strings(tensordict.get("action", None), n)
        responses = _strings(tensordict.get(("text", "response"), None), n)
        valid = tensordict.get("action_valid", None)
        valid = [True] * n if valid is None else valid.reshape(n).tolist()
        steps = tensordict.get("step_count", None)
        steps = [0] * n if steps is None else steps.reshape(n).tolist()
        done = tensordict.get("done", None)
        done = [False] * n if done is None else done.reshape(n).tolist()
        out = []
        for i in range(n):
            records, dropped = self.loads(states[i])
            if not done[i]:
                records = self.update(records, self.make_record(steps[i], observations[i], actions[i],
                                                                responses[i], valid[i]))
            out.append((records, dropped, not done[i]))
        return out

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        out = [self.dumps(records, dropped) for records, dropped, _ in self.updated_records(tensordict)]
        next_tensordict.set("memory", _string_stack(out, next_tensordict.batch_size))
        return next_tensordict

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return next_tensordict

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        observation_spec["memory"] = NonTensor(shape=observation_spec.shape, example_data="", dtype=None)
        return observation_spec

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return tensordict


class WindowMemory(MemoryTransform):
    """The last ``k`` (observation, action) pairs (the reference default, ``k=2``)."""

    kind = "window"

    def __init__(self, k: int = 2):
        if k < 0:
            raise ValueError(f"WindowMemory: k must be >= 0, got {k}")
        super().__init__(k=k)
        self.k = k

    @classmethod
    def from_config(cls, cfg, policy=None):
        return cls(cfg.k)

    @classmethod
    def fills_history(cls, cfg):
        return cfg.k > 0

    def update(self, records, record):
        return (records + [record])[-self.k:] if self.k else []

    def render(self, records):
        if not records:
            return "", []
        lines = [f"[Step {r['step'] + 1}] Observation: {r['observation']} Action: {r['action']}" for r in records]
        return f"Your last {len(records)} steps:\n" + "\n".join(lines), []


class ActionWindow(WindowMemory):
    """The last ``k`` actions without their observations: ``"Your last 2 actions: turn left, turn
    right"``. For an env whose observation already shows what the policy needs, a few tokens let it
    see what it just did (a memoryless greedy policy can repeat a left/right cycle forever)."""

    kind = "actions"

    def render(self, records):
        if not records:
            return "", []
        return f"Your last {len(records)} actions: " + ", ".join(r["action"] for r in records), []


class NoHistory(WindowMemory):
    """No memory at all: each prompt shows the current observation only."""

    kind = "none"

    def __init__(self):
        super().__init__(k=0)
        self.params = {}

    @classmethod
    def from_config(cls, cfg, policy=None):
        return cls()

    @classmethod
    def fills_history(cls, cfg):
        return False


class FullHistory(MemoryTransform):
    """The concatenation baseline: the whole transcript as a multi-turn chat, with the model's
    earlier raw responses. Its prompt grows with every step (quadratic episode cost)."""

    kind = "full"

    def __init__(self):
        super().__init__()

    def make_record(self, step, observation, action, response, valid):
        return {"step": step, "observation": observation, "response": response}

    def update(self, records, record):
        return records + [record]

    def render(self, records):
        turns = []
        for r in records:
            turns.append({"role": "user", "content": f"[Step {r['step'] + 1}] Observation: {r['observation']}"})
            turns.append({"role": "assistant", "content": r["response"]})
        return "", turns


def load_memory(state: str) -> tuple[MemoryTransform, list[dict]]:
    """Rebuild the memory that wrote ``state`` and return it with its records."""
    data = json.loads(state)
    kind = data["kind"]
    if kind not in MEMORY_REGISTRY:
        raise KeyError(f"unknown memory kind {kind!r}; known: {sorted(MEMORY_REGISTRY)}")
    return MEMORY_REGISTRY[kind](**data["params"]), data["records"]


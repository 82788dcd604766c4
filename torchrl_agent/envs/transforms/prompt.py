"""Prompt rendering: the step's chat prompt, rebuilt from the memory state and the current step.

Each step's prompt is one user message (plus earlier turns for multi-turn memories) filled from
a per-environment template (:mod:`torchrl_agent.envs.transforms.templates`: ours, and the
reference's texts for the reference mode).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.data import Categorical, Composite, NonTensor
from torchrl.envs import Transform

from torchrl_agent.envs.transforms.memory import MemoryTransform, WindowMemory, _string_stack, _strings, load_memory
from torchrl_agent.envs.transforms.templates import (
    PROMPT_TEMPLATES,
    REFERENCE_TEMPLATES,
    ReferenceTemplate,
    resolve_template,
)

__all__ = ["PromptTransform"]


class PromptTransform(Transform):
    """Renders ``("text", "prompt")`` (``[*B]`` str, any batch shape ``B``) after every reset and step.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        template: a key of :data:`PROMPT_TEMPLATES` or :data:`REFERENCE_TEMPLATES`, ``"reference"``
            (with ``env_name``), a :class:`ReferenceTemplate` or a template string (it must contain
            ``{observation}``).
        max_prompt_tokens: the per-step budget. Over budget, the oldest memory records are
            dropped first (and the ``memory`` key is rewritten with the count of dropped records, so
            replay stays exact); the current observation is never cut: if the prompt is still over
            budget with no records left, it is kept whole and ``prompt_over_budget`` is set.
        system_prompt: an optional system message placed first.
        env_name: the environment's name, for ``template="reference"``.

    Reads ``task``, ``observation``, ``admissible_actions``, ``step_count`` and ``memory``
    (absent memory = no history). Writes ``("text", "prompt")`` and ``prompt_over_budget`` ``[*B, 1]``.
    """

    def __init__(self, tokenizer, template: str | ReferenceTemplate = "default", *,
                 max_prompt_tokens: int | None = None, system_prompt: str | None = None, env_name: str = ""):
        super().__init__(in_keys=[], out_keys=[("text", "prompt")])
        self.tokenizer = tokenizer
        self.template = template if isinstance(template, ReferenceTemplate) else resolve_template(template, env_name)
        if not isinstance(self.template, ReferenceTemplate):
            try:
                self.template.format(task="", history="", step=0, observation="", admissible_actions="")
            except (KeyError, IndexError, ValueError) as err:
                raise ValueError(f"PromptTransform: bad template field {err}; allowed fields are "
                                 "task, history, step, observation, admissible_actions") from err
            if "{observation}" not in self.template:
                raise ValueError(f"PromptTransform: the template has no {{observation}} field (a mistyped template "
                                 f"name?): {self.template[:80]!r}; known names: {sorted(PROMPT_TEMPLATES)}, "
                                 f"'reference', {sorted(REFERENCE_TEMPLATES)}")
        self.max_prompt_tokens = max_prompt_tokens
        self.system_prompt = system_prompt

    # ---------------------------------------------------------------- rendering (pure)
    def messages(self, task: str, observation: str, admissible_actions: str, step: int,
                 history: str, earlier_turns: list[dict], records: list[dict] | None = None,
                 window: bool = True) -> list[dict[str, Any]]:
        """The chat messages of one step. ``records``, ``window``: see :meth:`ReferenceTemplate.content`
        (reference templates only)."""
        if isinstance(self.template, ReferenceTemplate):  # the reference's text, exactly as it fills it
            content = self.template.content(task, observation, [a for a in admissible_actions.split("\n") if a],
                                            step, records, history, window=window)
        else:
            actions = ", ".join(a for a in admissible_actions.split("\n") if a) or "any"
            content = self.template.format(task=task, history=history, step=step, observation=observation,
                                           admissible_actions=actions)
            content = "\n".join(line for line in content.split("\n") if line.strip())  # no empty history line
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + earlier_turns + [{"role": "user", "content": content}]

    def render(self, task: str, observation: str, admissible_actions: str, step: int,
               memory_state: str) -> tuple[str, str, bool]:
        """Return ``(prompt, memory_state, over_budget)``; the state changes only if records were dropped."""
        if memory_state:
            memory, records = load_memory(memory_state)
            dropped = MemoryTransform.loads(memory_state)[1]
        else:
            memory, records, dropped = None, [], 0
        while True:
            history, turns = memory.render(records) if memory is not None else ("", [])
            keeps = memory is not None and getattr(memory, "k", 1) > 0  # NoHistory / window k=0 keep nothing
            prompt = self.tokenizer.apply_chat_template(
                self.messages(task, observation, admissible_actions, step, history, turns,
                              records if keeps else None, window=type(memory) is WindowMemory),
                tokenize=False, add_generation_prompt=True)
            over = self.max_prompt_tokens is not None and self.num_tokens(prompt) > self.max_prompt_tokens
            if not over or not records:
                break
            records, dropped = records[1:], dropped + 1  # oldest first
        if memory is not None and memory_state and dropped != MemoryTransform.loads(memory_state)[1]:
            memory_state = memory.dumps(records, dropped)
        return prompt, memory_state, over

    def num_tokens(self, prompt: str) -> int:
        return len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def render_row(self, row: TensorDictBase) -> str:
        """Re-render the prompt of one recorded step row from that row alone."""
        step = row.get("step_count", None)
        memory = row["memory"] if "memory" in row.keys() else ""
        return self.render(row["task"], row["observation"], row["admissible_actions"],
                           int(step.reshape(-1)[0]) if step is not None else 0, memory)[0]

    # ---------------------------------------------------------------- TorchRL plumbing
    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        shape = next_tensordict.batch_size
        n = shape.numel()
        tasks = _strings(next_tensordict.get("task", None), n)
        observations = _strings(next_tensordict.get("observation", None), n)
        actions = _strings(next_tensordict.get("admissible_actions", None), n)
        memories = _strings(next_tensordict.get("memory", None), n)
        steps = next_tensordict.get("step_count", None)
        steps = [0] * n if steps is None else steps.reshape(n).tolist()
        prompts, over = [], []
        for i in range(n):
            prompt, memories[i], o = self.render(tasks[i], observations[i], actions[i], steps[i], memories[i])
            prompts.append(prompt)
            over.append(o)
        next_tensordict.set(("text", "prompt"), _string_stack(prompts, shape))
        if "memory" in next_tensordict.keys():
            next_tensordict.set("memory", _string_stack(memories, shape))
        next_tensordict.set("prompt_over_budget", torch.tensor(over, dtype=torch.bool).reshape(*shape, 1))
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return self._call(tensordict_reset)

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        shape = observation_spec.shape
        observation_spec["text"] = Composite(prompt=NonTensor(shape=shape, example_data="", dtype=None),
                                             shape=shape)
        observation_spec["prompt_over_budget"] = Categorical(2, shape=(*shape, 1), dtype=torch.bool)
        return observation_spec

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self._call(tensordict)

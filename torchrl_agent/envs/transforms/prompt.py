"""Prompt rendering: the step's chat prompt, rebuilt from the memory state and the current step.

Each step's prompt is one user message (plus earlier turns for multi-turn memories) filled from
a per-environment template. The stable part (instructions, task) comes first and the changing
part (history, step, observation, actions) last, so an engine's prefix cache can reuse it.

Template fields: ``{task}``, ``{history}``, ``{step}`` (steps taken), ``{observation}``,
``{admissible_actions}`` (comma-joined, or ``"any"`` when free-form).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NonTensorStack, TensorDictBase
from torchrl.data import Categorical, Composite, NonTensor
from torchrl.envs import Transform

from torchrl_agent.envs.transforms.memory import MemoryTransform, _strings, load_memory

__all__ = ["PROMPT_TEMPLATES", "PromptTransform"]

_TAGS = ("First reason step by step inside <think> </think>, then give exactly one action inside "
         "<action> </action>.")

PROMPT_TEMPLATES: dict[str, str] = {
    "default": (
        "You are an agent acting in a text environment. " + _TAGS + "\n"
        "Your task: {task}\n"
        "{history}\n"
        "You have taken {step} steps. Current observation: {observation}\n"
        "Admissible actions: {admissible_actions}"
    ),
    "numberline": (
        "You move a marker on a number line. Answer '+' to move right or '-' to move left. " + _TAGS + "\n"
        "Your task: {task}\n"
        "{history}\n"
        "You have taken {step} steps. Current state: {observation}\n"
        "Admissible actions: {admissible_actions}"
    ),
    "alfworld": (
        "You are an expert agent operating in the ALFRED embodied household environment. " + _TAGS + "\n"
        "Your task: {task}\n"
        "{history}\n"
        "You have taken {step} steps. Your current observation is: {observation}\n"
        "Your admissible actions of the current situation are: [{admissible_actions}]"
    ),
    "sokoban": (
        "You are a Sokoban solver. Push every box (X) onto a target (O) without getting stuck. "
        "Symbols: # wall, _ floor, O target, X box, \u221a box on target, P player, S player on target. "
        + _TAGS + "\n"
        "{history}\n"
        "You have taken {step} steps. Current room:\n{observation}\n"
        "Admissible actions: {admissible_actions}"
    ),
    "cards": (
        "You play a card game one token at a time. First reason step by step inside <think> </think>, "
        "then answer with a JSON object such as {{\"action\": \"+\"}}.\n"
        "Your task: {task}\n"
        "{history}\n"
        "You have taken {step} steps. Current state: {observation}\n"
        "Admissible actions: {admissible_actions}"
    ),
    "search": (
        "Answer the question. Reason inside <think> </think>. To look something up, write "
        "<search> query </search> and the top results come back inside <information> </information>. "
        "When you know the answer, write <answer> answer </answer>.\n"
        "Question: {task}\n"
        "{history}\n"
        "You have taken {step} turns. Latest information: {observation}"
    ),
    "webshop": (
        "You are an expert autonomous agent operating in the WebShop e-commerce environment. "
        "First reason step by step about the current situation inside <think> </think>, then choose exactly one "
        "admissible action and give it inside <action> </action>.\n"
        "Your task is to: {task}\n"
        "{history}\n"
        "You have taken {step} steps. Your current observation is: {observation}\n"
        "Your admissible actions of the current situation are: [{admissible_actions}]"
    ),
    "appworld": (
        "I am your supervisor and you are a super intelligent AI Assistant whose job is to achieve my day-to-day "
        "tasks completely autonomously. You interact with apps (e.g. spotify, venmo, simple_note) through their "
        "APIs in a Python REPL: write code, read its output, write the next code. Useful APIs: "
        "apis.api_docs.show_app_descriptions(), apis.api_docs.show_api_descriptions(app_name=...), "
        "apis.api_docs.show_api_doc(app_name=..., api_name=...); apis.supervisor.show_account_passwords() gives my "
        "passwords. When the task is done call apis.supervisor.complete_task() (with answer=... if it asks a "
        "question). First reason inside <think> </think>, then give exactly one code block inside <code> </code>.\n"
        "{task}\n"
        "{history}\n"
        "You have taken {step} steps. Output of your last code: {observation}"
    ),
}


class PromptTransform(Transform):
    """Renders ``("text", "prompt")`` (``[B]`` str) after every reset and step.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        template: a key of :data:`PROMPT_TEMPLATES` or a template string.
        max_prompt_tokens: the per-step budget. Over budget, the oldest memory records are
            dropped first (and the ``memory`` key is rewritten with the count of dropped records, so
            replay stays exact); the current observation is never cut: if the prompt is still over
            budget with no records left, it is kept whole and ``prompt_over_budget`` is set.
        system_prompt: an optional system message placed first.

    Reads ``task``, ``observation``, ``admissible_actions``, ``step_count`` and ``memory``
    (absent memory = no history). Writes ``("text", "prompt")`` and ``prompt_over_budget`` ``[B, 1]``.
    """

    def __init__(self, tokenizer, template: str = "default", *, max_prompt_tokens: int | None = None,
                 system_prompt: str | None = None):
        super().__init__(in_keys=[], out_keys=[("text", "prompt")])
        self.tokenizer = tokenizer
        self.template = PROMPT_TEMPLATES.get(template, template)
        try:
            self.template.format(task="", history="", step=0, observation="", admissible_actions="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"PromptTransform: bad template field {err}; allowed fields are "
                             "task, history, step, observation, admissible_actions") from err
        self.max_prompt_tokens = max_prompt_tokens
        self.system_prompt = system_prompt

    # ---------------------------------------------------------------- rendering (pure)
    def messages(self, task: str, observation: str, admissible_actions: str, step: int,
                 history: str, earlier_turns: list[dict]) -> list[dict[str, Any]]:
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
            prompt = self.tokenizer.apply_chat_template(
                self.messages(task, observation, admissible_actions, step, history, turns),
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
        n = next_tensordict.batch_size[0]
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
        next_tensordict.set(("text", "prompt"), NonTensorStack(*prompts, batch_size=[n]))
        if "memory" in next_tensordict.keys():
            next_tensordict.set("memory", NonTensorStack(*memories, batch_size=[n]))
        next_tensordict.set("prompt_over_budget", torch.tensor(over, dtype=torch.bool).reshape(n, 1))
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

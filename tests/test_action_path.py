"""The action path under plain TorchRL: ``env.rollout`` records the projection's parse, and the
transforms run over any batch shape (TorchRL's SerialEnv/ParallelEnv of batched text envs)."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from tensordict import NonTensorStack, TensorDict
from tensordict.nn import TensorDictModule
from torchrl.envs import Compose, ParallelEnv, SerialEnv, TransformedEnv

from torchrl_agent.envs import make_env
from torchrl_agent.envs.transforms import ActionProjection, PromptTransform, WindowMemory, project_action
from torchrl_agent.envs.transforms.summary import SummaryMemory
from torchrl_agent.modules import Generation, LLMPolicy, TransformersPolicy


def _flat(value) -> list[str]:
    """A string entry of any batch shape as a flat list."""
    return [v for row in value for v in _flat(row)] if isinstance(value, list) else [value]


def scripted_response(expert_action, step_count):
    """The expert's action in the tags format at steps 0, 2, 3, 5, 6, ...; a response without tags
    at steps 1, 4, 7, ... (for any batch shape)."""
    steps = step_count.reshape(-1).tolist()
    experts = _flat(expert_action) if not isinstance(expert_action, str) else [expert_action] * len(steps)
    texts = [f"<think>step {s}</think><action>{e}</action>" if s % 3 != 1 else f"No tags, I go {e}"
             for e, s in zip(experts, steps)]
    return NonTensorStack(*texts, batch_size=[len(texts)]).reshape(step_count.shape[:-1])


POLICY = TensorDictModule(scripted_response, in_keys=["expert_action", "step_count"],
                          out_keys=[("text", "response")])


def transforms(tokenizer, memory=None):
    return Compose(memory or WindowMemory(2), PromptTransform(tokenizer, "numberline"), ActionProjection())


def test_rollout_records_the_parsed_action_and_its_validity(tokenizer):
    env = TransformedEnv(make_env("numberline", num_groups=2, group_size=2, max_steps=8, seed=3), transforms(tokenizer))
    assert env.action_keys == [("text", "response")]  # the policy's response is the env's action
    rollout = env.rollout(6, POLICY, break_when_any_done=False)  # done envs restart: 6 steps in every env
    steps = rollout["step_count"].squeeze(-1)
    valid = rollout["next", "action_valid"].squeeze(-1)
    assert valid.tolist() == (steps % 3 != 1).tolist() and not valid.all() and valid.any()
    responses, actions = _flat(rollout["text", "response"]), _flat(rollout.get(("next", "action")).tolist())
    experts = _flat(rollout.get("expert_action").tolist())
    for response, action, expert, ok in zip(responses, actions, experts, valid.reshape(-1).tolist()):
        # the command sent: the tags' content, or (no tags) the lower-cased tail of the response
        assert action == (expert if ok else f"no tags, i go {expert}") == project_action(response)[0]
    assert not rollout["next", "response_cut"].any()
    # the env received the parsed command: a valid move changes the position, a response without tags does not
    before, after = _flat(rollout.get("observation").tolist()), _flat(rollout.get(("next", "observation")).tolist())
    for b, a, ok in zip(before, after, valid.reshape(-1).tolist()):
        assert (a != b) == ok
    # and the memory records it: the next step's window ends with the parsed action
    memories = _flat(rollout.get(("next", "memory")).tolist())
    assert [json.loads(m)["records"][-1]["action"] for m in memories] == actions
    assert "action" not in rollout.keys()  # the step's input holds the response, not a stale command


def test_rollout_with_the_tiny_model_records_its_parse(tokenizer, tiny_model):
    env = TransformedEnv(make_env("numberline", num_groups=1, group_size=2, max_steps=3, seed=0), transforms(tokenizer))
    torch.manual_seed(0)
    rollout = env.rollout(2, TransformersPolicy(tiny_model, tokenizer, max_new_tokens=8), return_contiguous=False)
    assert rollout.batch_size == (2, 2)
    responses = _flat(rollout.get(("text", "response")).tolist())
    parsed = [project_action(r) for r in responses]
    assert _flat(rollout.get(("next", "action")).tolist()) == [a for a, _ in parsed]
    assert rollout["next", "action_valid"].reshape(-1).tolist() == [v for _, v in parsed]


@pytest.mark.parametrize("batched", [SerialEnv, ParallelEnv])
def test_batched_envs_under_the_transforms_equal_one_env_per_row(tokenizer, batched):
    factories = [partial(make_env, "numberline", num_groups=1, group_size=2, max_steps=6, seed=s) for s in (0, 1)]
    env = TransformedEnv(batched(2, factories), transforms(tokenizer))
    try:
        # no early stop: done envs are reset inside the batched env (a [2, 2] partial reset)
        rollout = env.rollout(8, POLICY, break_when_any_done=False)
    finally:
        env.close()
    assert rollout.batch_size == (2, 2, 8)
    rows = [TransformedEnv(f(), transforms(tokenizer)).rollout(8, POLICY, break_when_any_done=False) for f in factories]
    assert rollout["next", "done"].any() and rollout["next", "action_valid"].any()
    assert not rollout["next", "action_valid"].all()
    for key in ("observation", ("text", "prompt"), "memory", ("text", "response"), ("next", "action"),
                ("next", "memory"), ("next", "observation")):
        assert rollout.get(key).tolist() == [r.get(key).tolist() for r in rows], key
    for key in ("step_count", ("next", "action_valid"), ("next", "response_cut"), ("next", "reward"), ("next", "done")):
        assert torch.equal(rollout[key], torch.stack([r[key] for r in rows])), key


class EchoSummarizer(LLMPolicy):
    """A scripted summariser: the summary names the last step it was asked to fold (the memory's
    batching across environments is under test, not the text)."""

    def generate(self, prompts):
        return [Generation(self.encode(p), text="through " + p.rsplit("[Step ", 1)[1].split("]")[0]) for p in prompts]


def test_summary_memory_over_a_two_dim_batch_equals_one_env_per_row(tokenizer):
    def memory():
        return SummaryMemory(k=1, summarizer=EchoSummarizer(tokenizer))

    factories = [partial(make_env, "numberline", num_groups=1, group_size=2, max_steps=8, seed=s) for s in (2, 3)]
    env = TransformedEnv(SerialEnv(2, factories), transforms(tokenizer, memory()))
    rollout = env.rollout(4, POLICY, break_when_any_done=False)
    rows = [TransformedEnv(f(), transforms(tokenizer, memory())).rollout(4, POLICY, break_when_any_done=False)
            for f in factories]
    memories = rollout.get(("next", "memory")).tolist()
    assert memories == [r.get(("next", "memory")).tolist() for r in rows]
    assert '"summary": "through ' in memories[1][0][-1]


@pytest.mark.parametrize("shape", [(), (2, 3)], ids=["scalar", "2d"])
def test_projection_module_on_any_batch_shape(shape):
    responses = ["<think>a</think><action>Go East</action>", "no tags", "<think>b</think><action>x</action>",
                 "<think>c</think>", "<action>y</action>", "<think>d</think><action>+</action>"]
    n = max(1, torch.Size(shape).numel())
    td = TensorDict({"text": {"response": NonTensorStack(*responses[:n], batch_size=[n]).reshape(shape)
                              if shape else responses[0]}}, batch_size=shape)
    ActionProjection()(td)
    expected = [project_action(r) for r in responses[:n]]
    assert td["action_valid"].shape == (*shape, 1)
    assert td["action_valid"].reshape(-1).tolist() == [v for _, v in expected]
    actions = td.get("action")
    assert _flat(actions.tolist() if shape else [actions.data]) == [a for a, _ in expected]

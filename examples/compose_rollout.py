"""Compose a step-independent rollout by hand: env + memory + prompt + projection, then a policy.

Every piece is a plain TorchRL object, stepped in a plain Python loop (no collector, no trainer):

* ``make_env("numberline")``: a batch of text games (here one) as a TorchRL ``EnvBase``;
* ``WindowMemory(2)``: keeps the last two (observation, action) pairs, as JSON in the ``memory`` key;
* ``PromptTransform``: renders each step's chat prompt from that memory into ``("text", "prompt")``;
* ``ActionProjection``: parses ``<think>..</think><action>..</action>`` into ``action`` / ``action_valid``;
* ``TransformersPolicy``: the bundled tiny model (random weights: expect malformed answers, which
  become invalid actions, never errors).

At the end, one step's prompt is rebuilt from that step's row alone, as a trainer would replay it::

    python examples/compose_rollout.py --steps 5
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torchrl.envs import Compose, TransformedEnv  # noqa: E402
from torchrl.envs.utils import step_mdp  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from torchrl_agent.envs import make_env  # noqa: E402
from torchrl_agent.envs.transforms import ActionProjection, PromptTransform, WindowMemory  # noqa: E402
from torchrl_agent.models import build_tiny_model  # noqa: E402
from torchrl_agent.modules import TransformersPolicy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description="Step one numberline episode with the tiny model.")
    parser.add_argument("--steps", type=int, default=10, help="episode length limit (max_steps)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    torch.manual_seed(args.seed)

    # 1. the model and its engine
    path = build_tiny_model(seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=24)

    # 2. the environment, with memory -> prompt -> projection composed as TorchRL transforms
    prompt = PromptTransform(tokenizer, "numberline")
    projection = ActionProjection()
    env = TransformedEnv(make_env("numberline", max_steps=args.steps, seed=args.seed),
                         Compose(WindowMemory(2), prompt, projection))

    # 3. one episode, step by step
    td = env.reset()
    rows = []
    while True:
        step = int(td["step_count"][0])
        out = policy(td.select(("text", "prompt")))  # generate from the rendered prompt
        td["text", "response"] = out["text", "response"]
        projection(td)  # response -> action, action_valid (recorded in the row)
        rows.append(td[0].clone())
        td = env.step(td)
        print(f"===== step {step + 1}")
        print(f"--- prompt\n{rows[-1]['text', 'prompt']}")
        print(f"--- response\n{td['text', 'response'][0]!r}")
        print(f"--- action {td['action'][0]!r} (valid: {bool(td['action_valid'][0])}), "
              f"reward {float(td['next', 'reward'][0]):+.1f}, done {bool(td['next', 'done'][0])}")
        if td["next", "done"].all():
            break
        td = step_mdp(td)

    # 4. replay: a step's prompt from its row alone (its memory state, observation, task, ...)
    row = rows[-1]
    replayed = PromptTransform(tokenizer, "numberline").render_row(row)
    print(f"===== episode over after {len(rows)} steps")
    print(f"memory state the last prompt was built from: {row['memory']}")
    print(f"replay of step {len(rows)}: {'identical' if replayed == row['text', 'prompt'] else 'DIFFERENT'}")


if __name__ == "__main__":
    main()

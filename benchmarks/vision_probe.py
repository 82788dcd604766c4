"""Can the tiny VLM read a frame layout at all? Supervised, no RL: the vision task's frames, the move.

For every NumberLine state of the vision task (a line 0..9: 90 position/target pairs) the frame is
the task's strip (:func:`~torchrl_agent.envs.games.images.numberline_strip`, a column of 19 cells)
or, ``--layout row``, the same strip turned on its side (19 cells side by side). The bundled
``tiny-vl`` model is trained by cross-entropy on the expert's move at the answer's position (the
token after ``<think></think><action>`` in the task's prompt), AdamW, mini-batches of 32 states; the
accuracy over all 90 states is printed every 50 steps and, as the LAST line, one JSON object::

    python benchmarks/vision_probe.py [--layout column|row] [--steps 300] [--lr 3e-3] [--seed 0] [--rope-theta X]

A layout the model cannot learn supervised cannot be learned by RL either: docs/vision.md has the
figures: at the hub models' ``--rope-theta 1e4`` a row stays at 0.5 and a column reaches 1.0 in 250
steps; at the bundled model's 10 both reach 1.0 in 100.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from torchrl_agent.envs.games.images import numberline_strip  # noqa: E402
from torchrl_agent.envs.games.numberline import NumberLineGame  # noqa: E402
from torchrl_agent.envs.transforms.templates import resolve_template  # noqa: E402
from torchrl_agent.models.tiny_vl import build_tiny_vl, load_tiny_vl, process_image  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", choices=["column", "row"], default="column")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rope-theta", type=float, default=None,
                        help="the text model's rope_theta (default: tiny-vl's, torchrl_agent.models.tiny_vl.TINY_VL_TEXT)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model, processor = load_tiny_vl(build_tiny_vl(seed=args.seed, rope_theta=args.rope_theta))
    tokenizer = processor.tokenizer
    text, image = resolve_template("numberline_short", "").split("{observation}")[0], "<image>"
    observation = NumberLineGame.STRIP_OBSERVATION.replace(image, "")
    messages = [{"role": "user", "content": [{"type": "text", "text": text + observation}, {"type": "image"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt += "<think></think><action>"
    moves = [tokenizer.encode(m)[-1] for m in ("-", "+")]  # the answer token of each move
    states = [(p, t) for p in range(10) for t in range(10) if p != t]

    def batch(pairs):
        frames = [numberline_strip(p, t, 9) for p, t in pairs]
        if args.layout == "row":
            frames = [f.transpose(1, 0, 2).copy() for f in frames]
        inputs = processor(text=[prompt] * len(pairs), images=[process_image(f, min_pixels=0) for f in frames],
                           return_tensors="pt")
        return inputs, torch.tensor([int(t > p) for p, t in pairs])

    def move_logits(inputs):
        return model(**inputs).logits[:, -1, moves]

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rng, curve, t0 = random.Random(args.seed), [], time.perf_counter()
    for step in range(args.steps + 1):
        if step % 50 == 0:
            with torch.no_grad():
                inputs, y = batch(states)
                accuracy = float((move_logits(inputs).argmax(-1) == y).float().mean())
            curve.append({"step": step, "accuracy": round(accuracy, 4)})
            print(f"step {step}: accuracy {accuracy:.3f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        if step == args.steps:
            break
        inputs, y = batch(rng.sample(states, 32))
        loss = torch.nn.functional.cross_entropy(move_logits(inputs), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    theta = model.config.text_config.rope_parameters["rope_theta"]
    print(json.dumps({"layout": args.layout, "lr": args.lr, "seed": args.seed, "steps": args.steps, "rope_theta": theta,
                      "final_accuracy": curve[-1]["accuracy"], "curve": curve}))


if __name__ == "__main__":
    main()

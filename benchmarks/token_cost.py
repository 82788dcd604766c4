"""Prompt-token cost of an episode: the window memory versus the full transcript (and a summary memory).

One 50-step ALFWorld episode on the real TextWorld engine (the first training game of the data set
in ``--data-dir`` or ``$ALFWORLD_DATA``, else a game the env generates offline from the
alfworld wheel), played as a scripted exploration rather than a solution: at each step the action
is a seeded random choice among the admissible commands, drawn once and replayed identically under
every memory. Each step's response is a fixed, realistic ``<think>...</think><action>a</action>``
text. The env runs in a ``TransformedEnv(Compose(memory, PromptTransform(tok, "alfworld"),
ActionProjection()))``; every step's prompt is re-rendered from its row with
:meth:`PromptTransform.render_row` for each tokenizer and its tokens counted.

Memories: ``WindowMemory(2)``, ``FullHistory()`` and, unless ``--no-summary``, ``SummaryMemory(2)``
with the tiny model as summariser (its random output stands for a summary of bounded length;
``max_summary_tokens=64``; the summariser's own prompt and response tokens are reported apart).

Without the ``alfworld`` package or the game data, the episode falls back to Sokoban (random
admissible moves) and the JSON says so in ``env``.

Prints one JSON object as the LAST line, with ``full_over_window_episode_prompt_tokens``,
``window_step50_over_step1`` and the per-step series ``window_prompt_tokens`` / ``full_prompt_tokens``
(tiny tokenizer), plus the same for the other tokenizers under ``by_tokenizer``::

    python benchmarks/token_cost.py [--steps 50] [--seed 0] [--data-dir DIR] [--no-summary]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from torchrl.envs import Compose, TransformedEnv  # noqa: E402
from torchrl.envs.utils import step_mdp  # noqa: E402

from torchrl_agent.envs import make_env  # noqa: E402
from torchrl_agent.envs.transforms import ActionProjection, FullHistory, PromptTransform, WindowMemory  # noqa: E402
from torchrl_agent.envs.transforms.summary import SummaryMemory  # noqa: E402
from torchrl_agent.modules import LLMPolicy, TransformersPolicy  # noqa: E402


def response(task: str, action: str) -> str:
    """A fixed, realistic response: a short reasoning, then the action."""
    return (f"<think>My task is to {task.rstrip('.')}. I have not found what I need yet, so I keep exploring "
            f"the places I have not checked. The next useful action is to {action}.</think>"
            f"<action>{action}</action>")


def make_base_env(data_dir: str | None, steps: int, workdir: str):
    """One real ALFWorld game (``data_dir``'s first training game, copied to ``workdir`` because a
    data set may be read-only; without ``data_dir``, the first generated one), else Sokoban."""
    try:
        from torchrl_agent.envs.alfworld import find_game_files

        if data_dir is None:
            return make_env("alfworld", max_steps=steps), "alfworld (generated)", "alfworld"
        copy = os.path.join(workdir, "alfworld")
        shutil.copytree(data_dir, copy)
        files = find_game_files(copy, "train")
        return make_env("alfworld", game_files=files[:1], max_steps=steps), "alfworld", "alfworld"
    except (ImportError, FileNotFoundError, ValueError) as err:
        print(f"ALFWorld unavailable ({type(err).__name__}: {err}); falling back to sokoban", file=sys.stderr)
        return make_env("sokoban", max_steps=steps), "sokoban (fallback: alfworld unavailable)", "sokoban"


class Counting(LLMPolicy):
    """Wraps the summariser engine to count its calls and tokens."""

    def __init__(self, inner: LLMPolicy):
        super().__init__(inner.tokenizer, max_new_tokens=inner.max_new_tokens)
        self.inner, self.calls, self.prompt_tokens, self.response_tokens = inner, 0, 0, 0

    def generate(self, prompts):
        out = self.inner.generate(prompts)
        self.calls += 1
        self.prompt_tokens += sum(len(g.prompt_ids) for g in out)
        self.response_tokens += sum(len(g.response_ids) for g in out)
        return out


def run_episode(base_env, memory, tokenizer, template: str, actions: list[str] | None, seed: int):
    """Step one episode; return its step rows and the actions played (drawn here when ``actions`` is None)."""
    env = TransformedEnv(base_env, Compose(memory, PromptTransform(tokenizer, template), ActionProjection()))
    env.set_seed(seed)
    rng = np.random.default_rng(seed)
    td = env.reset()
    rows, played = [], []
    while True:
        t = len(played)
        if actions is None:
            options = [a for a in td["admissible_actions"][0].split("\n") if a]
            action = options[int(rng.integers(len(options)))] if options else "look"
        else:
            if t >= len(actions):
                break
            action = actions[t]
        td["text", "response"] = [response(td["task"][0], action)]
        env.transform[-1](td)
        assert td["action"][0] == action, (td["action"][0], action)
        rows.append(td[0].clone())
        played.append(action)
        td = env.step(td)
        if td["next", "done"].all():
            break
        td = step_mdp(td)
    return rows, played


def load_tokenizers(tiny_only: bool) -> tuple[dict, dict]:
    """``({name: tokenizer}, {name: why unavailable})``: the tiny one always, SmolLM2's when installed."""
    from transformers import AutoTokenizer

    from torchrl_agent.models import build_tiny_model, model_path

    tokenizers, unavailable = {"tiny": AutoTokenizer.from_pretrained(build_tiny_model(seed=0))}, {}
    if not tiny_only:
        try:
            path = model_path(types.SimpleNamespace(name="smollm2-135m", path=None, seed=0))
            tokenizers["smollm2-135m"] = AutoTokenizer.from_pretrained(path)
        except Exception as err:  # noqa: BLE001 - optional: reported, not fatal
            unavailable["smollm2-135m"] = f"{type(err).__name__}: {err}"
            print(f"smollm2-135m tokenizer unavailable ({unavailable['smollm2-135m']})", file=sys.stderr)
    return tokenizers, unavailable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=os.environ.get("ALFWORLD_DATA"),
                        help="an ALFWorld data set (holding json_2.1.1/); default: a game generated offline")
    parser.add_argument("--no-summary", action="store_true", help="skip the SummaryMemory run")
    parser.add_argument("--tiny-only", action="store_true", help="count with the tiny tokenizer only")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    t0 = time.perf_counter()
    tokenizers, unavailable = load_tokenizers(args.tiny_only)
    tiny = tokenizers["tiny"]
    workdir = tempfile.mkdtemp(prefix="token_cost_")
    try:
        base_env, env_name, template = make_base_env(args.data_dir, args.steps, workdir)
        window_rows, actions = run_episode(base_env, WindowMemory(2), tiny, template, None, args.seed)
        full_rows, _ = run_episode(base_env, FullHistory(), tiny, template, actions, args.seed)
        runs = {"window": window_rows, "full": full_rows}
        summarizer = None
        if not args.no_summary:
            import torch
            from transformers import AutoModelForCausalLM

            from torchrl_agent.models import build_tiny_model

            torch.manual_seed(args.seed)
            model = AutoModelForCausalLM.from_pretrained(build_tiny_model(seed=0)).eval()
            summarizer = Counting(TransformersPolicy(model, tiny, max_new_tokens=64, temperature=1.0))
            runs["summary"], _ = run_episode(base_env, SummaryMemory(2, summarizer=summarizer, max_summary_tokens=64),
                                             tiny, template, actions, args.seed)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    by_tokenizer = {}
    for name, tok in tokenizers.items():
        prompt = PromptTransform(tok, template)
        series = {k: [prompt.num_tokens(prompt.render_row(r)) for r in rows] for k, rows in runs.items()}
        window, full = series["window"], series["full"]
        entry = {
            "full_over_window_episode_prompt_tokens": sum(full) / sum(window),
            f"window_step{len(window)}_over_step1": window[-1] / window[0],
            "window_step50_over_step1": window[-1] / window[0],
            "full_step50_over_step1": full[-1] / full[0],
            "window_episode_prompt_tokens": sum(window),
            "full_episode_prompt_tokens": sum(full),
        }
        if "summary" in series:
            entry["summary_episode_prompt_tokens"] = sum(series["summary"])
            entry["full_over_summary_episode_prompt_tokens"] = sum(full) / sum(series["summary"])
        entry.update({f"{k}_prompt_tokens": v for k, v in series.items()})
        by_tokenizer[name] = entry
        print(f"{name}: window {sum(window)} full {sum(full)} tokens over {len(window)} steps "
              f"(x{entry['full_over_window_episode_prompt_tokens']:.2f}); window step {len(window)}/1 = "
              f"{entry['window_step50_over_step1']:.2f}")
    # the replayed prompts are the prompts the env rendered (tiny tokenizer)
    replay = PromptTransform(tiny, template)
    assert all(replay.render_row(r) == r["text", "prompt"] for rows in runs.values() for r in rows)
    result = {"benchmark": "token_cost", "env": env_name, "steps": len(window_rows), "seed": args.seed,
              "memories": list(runs), "tokenizer": "tiny", **by_tokenizer["tiny"],
              "by_tokenizer": {k: v for k, v in by_tokenizer.items() if k != "tiny"},
              "tokenizers_unavailable": unavailable,
              "actions": actions, "response_example": response(window_rows[0]["task"], actions[0]),
              "elapsed_s": round(time.perf_counter() - t0, 2)}
    if summarizer is not None:
        result.update({"summarizer_calls": summarizer.calls, "summarizer_prompt_tokens": summarizer.prompt_tokens,
                       "summarizer_response_tokens": summarizer.response_tokens})
    print(json.dumps(result))


if __name__ == "__main__":
    main()

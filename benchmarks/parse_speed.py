"""Action parsing speed: the linear projection vs the backtracking regular expressions it replaced.

Pathological responses (tags opened many times and never closed, the shape that made the old
patterns quadratic) and ordinary ones, at 16 kB, 64 kB and 160 kB, parsed by
``project_action(..., max_chars=None)`` (no cut) and by the previous implementation (its
patterns are reproduced below), side by side in one run; both are checked to agree on ordinary
responses. The last printed line is one JSON object.

    python benchmarks/parse_speed.py
"""

from __future__ import annotations

import json
import re
import time

from torchrl_agent.envs.transforms import project_action, reference_formats

# the previous implementation's patterns (tags format), quadratic on unclosed tags
_OLD_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_OLD_ACTION = re.compile(r"<action>(.*?)</action>", re.DOTALL)


def old_tags(response: str) -> tuple[str, bool]:
    valid = _OLD_THINK.search(response) is not None
    match = _OLD_ACTION.search(response)
    if match is None or not valid:
        return response.lower()[-30:], False
    return match.group(1).strip().lower(), True


def best_of(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    sizes = {"16kB": 16_000, "64kB": 64_000, "160kB": 160_000}
    out: dict = {"old_s": {}, "new_s": {}, "new_all_formats_s": {}}
    for label, n in sizes.items():
        pathological = "<think><action>" * (n // 15)
        ordinary = "<think>" + "reasoning " * (n // 10) + "</think><action>go to sink 1</action>"
        assert old_tags(ordinary) == project_action(ordinary, "tags", max_chars=None)
        repeats = 1 if n > 20_000 else 3  # the old parser takes seconds here
        out["old_s"][label] = round(best_of(lambda p=pathological: old_tags(p), repeats), 4)
        out["new_s"][label] = round(best_of(lambda p=pathological: project_action(p, "tags", max_chars=None)), 5)
        out["new_all_formats_s"][label] = round(best_of(lambda p=pathological: [
            project_action(p, fmt, max_chars=None) for fmt in ("tags", "json", "search", *reference_formats())]), 5)
    out["speedup_160kB"] = round(out["old_s"]["160kB"] / out["new_s"]["160kB"], 1)
    # linear: 10x the text takes about 10x the time (quadratic: about 100x)
    out["new_growth_16kB_to_160kB"] = round(out["new_s"]["160kB"] / out["new_s"]["16kB"], 1)
    out["old_growth_16kB_to_160kB"] = round(out["old_s"]["160kB"] / out["old_s"]["16kB"], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""What the data-file checks cost beside reading the files (WebShop products, ALFWorld games, Search-R1 rows).

The envs check every record they use while they read it (``torchrl_agent.envs.data_files``). This
measures, on copies of the shipped or real data:

* WebShop: the shipped small catalogue repeated to ``--products`` products: ``json.loads`` of the
  items file vs the record checks (per product, in microseconds);
* ALFWorld: the real game (``$TORCHRL_AGENT_SHARED_DATA/alfworld``): the plain text search for
  ``"solvable": true`` that game discovery did before vs the parse and check of ``read_game_file``
  (per game, in milliseconds);
* Search-R1: ``--rows`` jsonl rows read by ``load_searchr1_questions`` (per row, in microseconds).

Best of ``--repeats``. Last line: one JSON object.

    python benchmarks/data_checks.py --products 10000 --rows 20000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path

from torchrl_agent.envs.alfworld.files import read_game_file
from torchrl_agent.envs.search import load_searchr1_questions
from torchrl_agent.envs.webshop import SHIPPED_DATA_DIR
from torchrl_agent.envs.webshop.catalogue import _check_instructions, _check_item

REAL_GAME = ("alfworld/json_2.1.1/train/pick_heat_then_place_in_recep-Potato-None-SinkBasin-14/"
             "trial_T20190908_231731_054988/game.tw-pddl")


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--products", type=int, default=10_000)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--games", type=int, default=200, help="reads of the real game file")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    shipped = json.loads((SHIPPED_DATA_DIR / "items_shuffle_small.json").read_text())
    items = (shipped * (args.products // len(shipped) + 1))[: args.products]
    attributes = json.loads((SHIPPED_DATA_DIR / "items_ins_v2_small.json").read_text())
    text = json.dumps(items)

    def check_products():
        for i, item in enumerate(items):
            _check_item(item, i, "items")
            if item["asin"] in attributes:
                _check_instructions(attributes[item["asin"]], item["asin"], "attributes")

    load_s = best(lambda: json.loads(text), args.repeats)
    check_s = best(check_products, args.repeats)

    shared = Path(os.environ.get("TORCHRL_AGENT_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    game = shared / REAL_GAME
    solvable = re.compile(r'"solvable"\s*:\s*true\b')

    def search_games():
        for _ in range(args.games):
            with open(game) as f:
                solvable.search(f.read())

    def parse_games():
        for _ in range(args.games):
            read_game_file(str(game))

    search_s = best(search_games, args.repeats)
    parse_s = best(parse_games, args.repeats)

    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "train.jsonl"
        rows.write_text("".join(json.dumps({"id": f"nq_{i}", "question": f"question {i}?",
                                            "golden_answers": ["an answer", "another"], "data_source": "nq"}) + "\n"
                                for i in range(args.rows)))
        rows_s = best(lambda: load_searchr1_questions(rows), args.repeats)

    print(json.dumps({
        "webshop_products": args.products,
        "webshop_json_loads_us_per_product": round(load_s / args.products * 1e6, 1),
        "webshop_checks_us_per_product": round(check_s / args.products * 1e6, 1),
        "alfworld_game_bytes": game.stat().st_size,
        "alfworld_text_search_ms_per_game": round(search_s / args.games * 1e3, 3),
        "alfworld_parse_and_check_ms_per_game": round(parse_s / args.games * 1e3, 3),
        "searchr1_rows": args.rows,
        "searchr1_load_us_per_row": round(rows_s / args.rows * 1e6, 1),
    }))


if __name__ == "__main__":
    main()

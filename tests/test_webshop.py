"""WebShop on the shipped small catalogue: pages, actions, WebShop's score, the expert, the data format."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from torchrl.envs.utils import check_env_specs

from torchrl_agent.envs import make_env
from torchrl_agent.envs.bm25 import LuceneBM25, lucene_tokenize
from torchrl_agent.envs.webshop import (
    SHIPPED_DATA_DIR,
    WebShopEnv,
    load_catalogue,
    parse_webshop_action,
    webshop_score,
)
from torchrl_agent.envs.webshop.catalogue import _parse_pricing

GARBAGE = ["", "x" * 20_000, "\x00\x01\x7f\x1b[31m\r\n\t", "\ud800 lone \udfff", "click[]", "click[nothing here]",
           "search[]", "buy now", "click[search]", "[[[]]]"]


class _Driver:
    """Steps ``env`` with the same action for every game (or one action per game)."""

    def __init__(self, env):
        self.env, self.td = env, env.reset()

    def __call__(self, actions):
        actions = [actions] * self.env.batch_size[0] if isinstance(actions, str) else list(actions)
        self.td["action"] = actions
        self.td = self.env.step(self.td)["next"]
        return self.td


def _goal(asin, options=()):
    """A goal of the shipped catalogue for product ``asin`` whose option values are ``options``."""
    catalogue = load_catalogue()
    return next(g for g in catalogue.goals if g.asin == asin and set(options) <= set(g.option_values))


def _play(env, actions):
    drive = _Driver(env)
    for action in actions:
        out = drive(action)
    return out, drive


def test_specs_groups_and_garbage():
    env = make_env("webshop", num_groups=3, group_size=2, seed=0)
    check_env_specs(env)
    td = env.reset()
    tasks = td["task"]
    assert tasks[0] == tasks[1] and tasks[2] == tasks[3] and tasks[4] == tasks[5]
    assert len(set(tasks[::2])) >= 2
    assert td["observation"][0] == "'Search'"
    assert td["admissible_actions"][0].split("\n") == ["search[<your query>]", "click[search]"]
    assert td["task_score"].shape == (6, 1) and td["task_score"].eq(0).all()
    drive = _Driver(make_env("webshop", num_groups=1, group_size=len(GARBAGE), seed=1))
    first = drive.td["observation"]
    for _ in range(3):
        out = drive(GARBAGE)
        assert out["observation"] == first and out["reward"].eq(0).all() and not out["done"].any()


def test_train_and_eval_goals_are_disjoint():
    train = WebShopEnv(num_groups=4, group_size=1)
    evaluation = WebShopEnv(num_groups=4, group_size=1, split="eval")
    catalogue = load_catalogue()
    n_test = len(catalogue.goals) // 5
    assert evaluation.goals == catalogue.goals[:n_test] and train.goals == catalogue.goals[n_test:]
    assert evaluation.reset()["task"] == [g.instruction_text for g in catalogue.goals[:4]]  # the panel walks them
    with pytest.raises(ValueError, match="num_test_goals"):
        WebShopEnv(num_test_goals=0)


def test_expert_wins_every_goal_with_reward_10():
    env = WebShopEnv(num_groups=1, group_size=len(load_catalogue().goals), goals=load_catalogue().goals)
    # each game plays a different goal: seed s picks goal (s // 2) % n, so give game i the seed 2 i
    tds = [game.reset(2 * i) for i, game in enumerate(env.games)]
    assert len({s.task for s in tds}) == len(env.games)
    for i, game in enumerate(env.games):
        state, reward, done = tds[i], 0.0, False
        for _ in range(15):
            state, reward, done, success = game.step(state.expert_action)
            if done:
                break
        assert done and success and reward == 10.0 and game.task_score == 1.0, (state.task, state.observation)


def test_scripted_search_and_click_wins_and_wrong_purchase_scores_its_attributes():
    goal = _goal("B09TWD3K1A", ("lavender", "2.65 ounce (pack of 1)"))
    assert goal.instruction_text.startswith("i want a long lasting aluminum free deodorant with scent: lavender")
    env = WebShopEnv(num_groups=1, group_size=1, goals=[goal])
    out, drive = _play(env, ["search[long lasting aluminum free deodorant]"])
    assert "'B09TWD3K1A'" in out["observation"][0] and "click[b09twd3k1a]" in out["admissible_actions"][0].split("\n")
    out, drive = _play(env, ["search[long lasting aluminum free deodorant]", "click[b09twd3k1a]", "click[lavender]",
                      "click[2.65 ounce (pack of 1)]", "click[buy now]"])
    assert out["reward"].item() == 10.0 and out["success"].item() and out["task_score"].item() == 1.0
    assert out["terminated"].item()
    # the right product with a wrong option: 2 attributes + 1 of 2 options + price = 4 of 5
    out, drive = _play(env, ["search[deodorant]", "click[b09twd3k1a]", "click[unscented]", "click[2.65 ounce (pack of 1)]",
                      "click[buy now]"])
    assert out["reward"].item() == 0.0 and not out["success"].item()
    assert out["task_score"].item() == pytest.approx(4 / 5)
    # a wrong product: "long lasting" is one of its attributes, "aluminum free" is nowhere in its text,
    # no option matches, the price is within the bound; same query, so the type factor is 1: 2 of 5
    out, drive = _play(env, ["search[clinical strength antiperspirant]", "click[b08kq2m7zc]", "click[fresh]", "click[buy now]"])
    assert out["reward"].item() == 0.0 and out["task_score"].item() == pytest.approx(2 / 5)
    game = env.games[0]
    assert game.score_info["r_type"] == 1.0 and game.score_info["r_att"] == 0.5 and game.score_info["r_price"]


def test_type_factor_and_price_bound():
    catalogue = load_catalogue()
    goal = _goal("B09TWD3K1A", ("lavender", "2.65 ounce (pack of 1)"))
    headphones = catalogue.by_asin["B0BQJ4FZ2M"]  # another query and category; one shared title noun ("hour")
    score, info = webshop_score(headphones, goal, price=5.0, options={})
    assert not info["query_match"] and not info["category_match"] and 0 < info["title_score"] < 0.1
    assert info["r_type"] == 0.1 and score == pytest.approx((0 + 0 + 1) / 5 * 0.1)  # only the price bound holds
    deodorant = catalogue.by_asin["B09TWD3K1A"]
    options = {"scent": "lavender", "size": "2.65 ounce (pack of 1)"}
    assert webshop_score(deodorant, goal, price=catalogue.prices["B09TWD3K1A"], options=options)[0] == 1.0
    over, info = webshop_score(deodorant, goal, price=goal.price_upper + 1, options=options)
    assert over == pytest.approx(4 / 5) and not info["r_price"]
    assert goal.price_upper > catalogue.prices["B09TWD3K1A"]
    assert f"price lower than {goal.price_upper:.2f} dollars" in goal.instruction_text


def test_pages_and_navigation():
    goal = _goal("B07QMZ3F6W", ("navy blue", "large"))
    env = WebShopEnv(num_groups=1, group_size=1, goals=[goal])
    out, drive = _play(env, ["search[free]"])
    obs, actions = out["observation"][0], out["admissible_actions"][0].split("\n")
    assert obs.startswith("'Back to Search' [SEP] 'Page 1 (Total results: ")
    assert actions[:2] == ["click[back to search]", "click[next >]"] and "search[<your query>]" not in actions
    total = int(obs.split("Total results: ")[1].split(")")[0])
    assert total == len(env.catalogue.search("free")) and total > 10  # more than one page
    assert sum(a.startswith("click[b0") for a in actions) == 10
    out = drive(["click[next >]"])
    assert "'Page 2 (Total results:" in out["observation"][0]
    assert out["admissible_actions"][0].split("\n")[:3] == ["click[back to search]", "click[< prev]", "click[next >]"]
    out = drive(["click[< prev]"])
    assert "'Page 1 (Total results:" in out["observation"][0]
    out, drive = _play(env, ["search[men's cotton t-shirt]", "click[b07qmz3f6w]"])
    obs = out["observation"][0]
    assert "'color' [SEP] 'black' [SEP] 'navy blue'" in obs and obs.endswith("'Reviews' [SEP] 'Buy Now'")
    assert "'Price: $14.99 to $19.99'" in obs
    actions = out["admissible_actions"][0].split("\n")
    assert actions[:6] == ["click[back to search]", "click[< prev]", "click[description]", "click[features]",
                           "click[reviews]", "click[buy now]"]
    assert "click[navy blue]" in actions and "click[x-large]" in actions
    out = drive(["click[features]"])
    assert out["observation"][0] == "'Back to Search' [SEP] '< Prev' [SEP] '100% cotton' [SEP] " \
        "'Classic fit, crew neck, short sleeve' [SEP] 'Machine wash cold, tumble dry low'"
    out = drive(["click[< prev]"])  # back to the item page
    assert out["observation"][0] == obs
    out = drive(["click[back to search]"])
    assert out["observation"][0] == "'Search'"
    assert out["step_count"].item() == 5 and not out["done"].item()


def test_fifteen_step_limit_and_done_games_ignore_actions():
    drive = _Driver(make_env("webshop", num_groups=1, group_size=2, seed=0))
    for turn in range(1, 16):
        out = drive(["search[candle]", "click[nothing]"])
        assert out["truncated"].all() == (turn == 15)
    assert out["done"].all() and out["reward"].eq(0).all()


def test_action_parsing_and_prices():
    assert parse_webshop_action(" Click[Buy Now] ") == ("click", "buy now")
    assert parse_webshop_action("search[red shoes]") == ("search", "red shoes")
    assert parse_webshop_action("buy") == ("buy", None)
    assert _parse_pricing("$12.99") == ([12.99], "$12.99")
    assert _parse_pricing("$10.00 - $1,020.50") == ([10.0, 1020.5], "$10.0 to $1020.5")
    assert _parse_pricing("") == ([100.0], "$100.0") and _parse_pricing(None) == ([100.0], "$100.0")


def test_lucene_bm25():
    assert lucene_tokenize("The Men's Running-Shoes, 3.5 oz, and a T-Shirt") == [
        "men", "run", "shoe", "3.5", "oz", "t", "shirt"]
    index = LuceneBM25(["running shoes for women", "a deodorant for men", "the men's classic shirt"])
    assert [i for i, _ in index.search("men's deodorants", 5)] == [1, 2]
    assert index.search("the and of", 5) == [] and index.search("zzzz", 5) == []


def test_reads_webshop_data_files(tmp_path):
    # WebShop's own file names (the 1000-product files) and its human goals
    for name in ("items_shuffle", "items_ins_v2"):
        shutil.copy(SHIPPED_DATA_DIR / f"{name}_small.json", tmp_path / f"{name}_1000.json")
    shutil.copy(SHIPPED_DATA_DIR / "items_human_ins_small.json", tmp_path / "items_human_ins.json")
    catalogue = load_catalogue(str(tmp_path), human_goals=True)
    human = json.loads((SHIPPED_DATA_DIR / "items_human_ins_small.json").read_text())
    assert len(catalogue.goals) == sum(len(v) for v in human.values())
    env = WebShopEnv(data_dir=str(tmp_path), human_goals=True, num_test_goals=2, num_groups=len(catalogue.goals) - 2)
    td = env.reset()
    assert set(td["task"]) <= {g.instruction_text for g in catalogue.goals[2:]}
    for _ in range(15):  # the expert wins human goals too (their options are values of the product)
        td["action"] = list(td["expert_action"])
        td = env.step(td)["next"]
        if td["done"].all():
            break
    assert td["success"].all() and td["reward"].eq(10).all()
    with pytest.raises(FileNotFoundError, match="items_shuffle.json"):
        load_catalogue(str(tmp_path), small=False)
    with pytest.raises(ValueError, match="num_test_goals"):
        WebShopEnv(data_dir=str(tmp_path), human_goals=True)  # 500 test goals of 7


def test_goals_are_validated():
    goal = _goal("B07QMZ3F6W")
    with pytest.raises(ValueError, match="goals"):
        WebShopEnv(goals=[dataclasses.replace(goal, asin="B000000000")])
    env = WebShopEnv(goals=[goal], seed=3)
    assert torch.equal(env.reset()["step_count"], torch.zeros(1, 1, dtype=torch.int64))

"""The WebShop game (pages, clicks, the purchase) and its batched env."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from torchrl.data import Unbounded

from torchrl_agent.envs.base import GameState, TextEnv, TextGame
from torchrl_agent.envs.webshop.catalogue import WebShopCatalogue, WebShopGoal, load_catalogue
from torchrl_agent.envs.webshop.scoring import _nlp, webshop_score

__all__ = ["WebShopEnv", "WebShopGame", "parse_webshop_action"]

PRODUCT_WINDOW = 10  # products per result page
SUB_PAGES = ("description", "features", "reviews", "attributes")
BUY_NOW, BACK_TO_SEARCH, NEXT_PAGE, PREV_PAGE = "buy now", "back to search", "next >", "< prev"
SEARCH_PLACEHOLDER = "search[<your query>]"


_ACTION = re.compile(r"(.+)\[(.+)\]", re.DOTALL)


def parse_webshop_action(action: str) -> tuple[str, str | None]:
    """``"click[Buy Now]"`` -> ``("click", "buy now")``; WebShop's parse, then the argument lower-cased."""
    match = _ACTION.match(action.strip()) if isinstance(action, str) else None
    if match is None:
        return (action.strip().lower() if isinstance(action, str) else ""), None
    return match.group(1).strip().lower(), match.group(2).strip().lower()


class WebShopGame(TextGame):
    """One WebShop session over a :class:`WebShopCatalogue`.

    Seed ``s`` picks goal ``(s // 2) % len(goals)`` of the split's goal list (training seeds are
    random even numbers, the evaluation panel's odd seeds walk the test goals in order).
    """

    def __init__(self, catalogue: WebShopCatalogue, goals: list[WebShopGoal], *, show_attrs: bool = False):
        if not goals:
            raise ValueError("goals is empty: a WebShop game needs at least one goal")
        self.catalogue, self.goals, self.show_attrs = catalogue, goals, show_attrs
        self.goal = goals[0]
        self.task_score = 0.0
        self._new_session()

    def _new_session(self) -> None:
        self.page = "search"  # search | results | item | one of SUB_PAGES | done
        self.keywords, self.page_num, self.results = "", 1, []
        self.asin: str | None = None
        self.options: dict[str, str] = {}

    def reset(self, seed: int) -> GameState:
        self.goal = self.goals[(int(seed) // 2) % len(self.goals)]
        self.task_score = 0.0
        self._new_session()
        return self._state()

    # ------------------------------------------------------------------ pages
    def _page_parts(self) -> list[str]:
        """The page's visible texts, in page order (WebShop's text mode, after the instruction)."""
        if self.page == "search":
            return ["Search"]
        if self.page == "done":
            return ["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)", f"{self.task_score}"]
        parts = ["Back to Search", "< Prev"]
        if self.page == "results":
            if self.page_num == 1:
                parts.pop()
            parts += [f"Page {self.page_num} (Total results: {len(self.results)})", "Next >"]
            for asin in self._page_asins():
                product = self.catalogue.by_asin[asin]
                parts += [asin, product["Title"], product["Price"]]
            return parts
        product = self.catalogue.by_asin[self.asin]
        if self.page == "item":
            for name, values in product["options"].items():
                parts += [name, *values]
            parts += [product["Title"], f"Price: {product['Price']}", f"Rating: {product['Rating']}",
                      "Description", "Features", "Reviews"] + (["Attributes"] if self.show_attrs else []) + ["Buy Now"]
        elif self.page == "description":
            parts.append(product["Description"])
        elif self.page == "features":
            parts += [str(b) for b in product["BulletPoints"]]
        elif self.page == "reviews":
            for review in product["Reviews"]:
                parts += [str(review.get("title", "")), str(review.get("score", "")), str(review.get("body", ""))]
        elif self.page == "attributes":
            parts += list(product["Attributes"])
        return parts

    def _page_asins(self) -> list[str]:
        return self.results[(self.page_num - 1) * PRODUCT_WINDOW : self.page_num * PRODUCT_WINDOW]

    def clickables(self) -> list[str]:
        """The clickable texts of the current page, lower-cased, in WebShop's order (buttons, links, options)."""
        if self.page == "search":
            return ["search"]
        if self.page == "done":
            return []
        if self.page == "results":
            buttons = [BACK_TO_SEARCH] + ([PREV_PAGE] if self.page_num > 1 else []) + [NEXT_PAGE]
            return buttons + [a.lower() for a in self._page_asins()]
        if self.page == "item":
            subs = ["description", "features", "reviews"] + (["attributes"] if self.show_attrs else [])
            values = [v for vs in self.catalogue.by_asin[self.asin]["options"].values() for v in vs]
            return [BACK_TO_SEARCH, PREV_PAGE, *subs, BUY_NOW] + list(dict.fromkeys(values))
        return [BACK_TO_SEARCH, PREV_PAGE]

    def available_actions(self) -> tuple[str, ...]:
        search = [SEARCH_PLACEHOLDER] if self.page == "search" else []
        return tuple(search + [f"click[{c}]" for c in self.clickables()])

    def _state(self) -> GameState:
        observation = " [SEP] ".join(f"'{part}'" for part in self._page_parts())
        return GameState(observation=observation, task=self.goal.instruction_text,
                         admissible_actions=self.available_actions(), expert_action=self.expert_action(),
                         task_type=self.goal.category)

    # ------------------------------------------------------------------ expert
    def expert_action(self) -> str:
        """An oracle step towards the goal's product with the goal's options."""
        goal, page = self.goal, self.page
        if page == "done":
            return ""
        if page == "item" and self.asin == goal.asin:
            product_values = {v for vs in self.catalogue.by_asin[self.asin]["options"].values() for v in vs}
            for value in goal.option_values:
                if value in product_values and value not in self.options.values():
                    return f"click[{value}]"
            return f"click[{BUY_NOW}]"
        if page in ("item", *SUB_PAGES):
            return f"click[{PREV_PAGE}]"
        if page == "results" and goal.asin in self.results:
            target_page = self.results.index(goal.asin) // PRODUCT_WINDOW + 1
            if target_page == self.page_num:
                return f"click[{goal.asin.lower()}]"
            return f"click[{NEXT_PAGE if target_page > self.page_num else PREV_PAGE}]"
        instruction = goal.instruction_text.split(", and price lower than")[0]
        if page == "results" and self.keywords == instruction.lower():  # not found that way: search its title
            return f"search[{goal.name.lower()}]"
        return f"search[{instruction}]"

    # ------------------------------------------------------------------ step
    def step(self, action: str) -> tuple[GameState, float, bool, bool]:
        if self.page == "done":
            return self._state(), 0.0, True, self.task_score == 1.0
        name, arg = parse_webshop_action(action)
        if name == "search" and arg:
            self._search(" ".join(arg.split(" ")))
        elif name == "click" and arg is not None and arg != "search" and arg in self.clickables():
            if arg == BUY_NOW:
                return self._buy()
            self._click(arg)
        return self._state(), 0.0, False, False

    def _search(self, keywords: str, page_num: int = 1) -> None:
        if keywords != self.keywords or not self.results:
            self.results = self.catalogue.search(keywords)
        self.page, self.keywords, self.page_num = "results", keywords, page_num
        self.asin, self.options = None, {}

    def _click(self, arg: str) -> None:
        if arg == BACK_TO_SEARCH:
            self._new_session()
        elif arg == NEXT_PAGE and self.page == "results":
            self._search(self.keywords, self.page_num + 1)
        elif arg == PREV_PAGE and self.page == "results":
            self._search(self.keywords, self.page_num - 1)
        elif arg == PREV_PAGE and self.page in SUB_PAGES:
            self.page = "item"
        elif arg == PREV_PAGE and self.page == "item":
            self._search(self.keywords, self.page_num)
        elif arg in SUB_PAGES:
            self.page = arg
        elif self.page == "results":  # a product link
            self.asin, self.page = arg.upper(), "item"
        else:  # an option value: its option name (the last one holding the value, as WebShop's page map)
            names = [n for n, values in self.catalogue.by_asin[self.asin]["options"].items() if arg in values]
            self.options[names[-1]] = arg

    def _buy(self) -> tuple[GameState, float, bool, bool]:
        product = self.catalogue.by_asin[self.asin]
        score, self.score_info = webshop_score(product, self.goal, self.catalogue.prices[self.asin], self.options)
        self.task_score = score
        self.page = "done"
        success = score == 1.0
        return self._state(), 10.0 if success else 0.0, True, success


class WebShopEnv(TextEnv):
    """A batch of WebShop games. See :mod:`torchrl_agent.envs.webshop` for the rules and :class:`TextEnv` for the keys.

    Args:
        data_dir: WebShop's data folder; ``None`` uses the shipped small catalogue.
        human_goals, small, num_products: see :func:`load_catalogue`.
        num_test_goals: goals ``0..num_test_goals-1`` are the evaluation goals, the rest train;
            default 500 on WebShop's data (the reference's split), a fifth of the goals on the
            shipped catalogue.
        goals: explicit goals (:class:`WebShopGoal` s of this catalogue) instead, used for both splits.
        show_attrs: show WebShop's "Attributes" sub-page (off in the reference).
        max_steps: 15, as the reference.

    Extra key: ``task_score`` (float ``[B, 1]``), the raw WebShop score of the purchase (0 before).
    """

    def __init__(
        self,
        *,
        data_dir: str | None = None,
        human_goals: bool = False,
        small: bool = True,
        num_products: int | None = None,
        num_test_goals: int | None = None,
        goals: Sequence[WebShopGoal] | None = None,
        show_attrs: bool = False,
        max_steps: int = 15,
        split: Literal["train", "eval"] = "train",
        **kwargs,
    ):
        catalogue = load_catalogue(None if data_dir in (None, "") else str(data_dir), bool(human_goals), bool(small),
                                   num_products)
        _nlp()  # the type score's tagger: loaded with the env, not at the first purchase
        self.catalogue = catalogue
        if goals is not None:
            if not goals or not all(isinstance(g, WebShopGoal) and g.asin in catalogue.by_asin for g in goals):
                raise ValueError("goals must be a non-empty sequence of WebShopGoal of products in the catalogue")
            self.goals = list(goals)
        else:
            goals = catalogue.goals
            if num_test_goals is None:
                num_test_goals = 500 if data_dir else len(goals) // 5
            if not 0 < num_test_goals < len(goals):
                raise ValueError(
                    f"num_test_goals must be in 1..{len(goals) - 1} for {len(goals)} goals, got {num_test_goals}")
            self.goals = goals[:num_test_goals] if split == "eval" else goals[num_test_goals:]
        super().__init__(lambda: WebShopGame(catalogue, self.goals, show_attrs=show_attrs), max_steps=max_steps,
                         split=split, **kwargs)

    def _make_specs(self) -> None:
        super()._make_specs()
        spec = self.observation_spec.clone()
        spec["task_score"] = Unbounded(shape=(*self.batch_size, 1), dtype=torch.float32)
        self.observation_spec = spec

    def _observation_td(self, reward, terminated, truncated, env_fault=None):
        td = super()._observation_td(reward, terminated, truncated, env_fault)
        scores = np.array([game.task_score for game in self.games], dtype=np.float32)
        td.set("task_score", torch.from_numpy(scores).unsqueeze(-1))
        return td

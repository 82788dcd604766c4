"""Search retrievers: the batched :class:`Retriever` interface, BM25 over a corpus, and a retrieval server's client.

The dense retriever is in :mod:`torchrl_agent.envs.search.dense`.
"""

from __future__ import annotations

import abc
import http.client
import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from torchrl_agent.envs.base import clean_text
from torchrl_agent.envs.bm25 import require_bm25s
from torchrl_agent.envs.search.corpus import Corpus, Passage, load_wiki_corpus

__all__ = ["BM25Retriever", "HttpRetriever", "RetrievalError", "Retriever"]


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
        bm25s = require_bm25s("BM25Retriever")
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
        return require_bm25s("BM25Retriever").tokenize(texts, lower=True, stopwords="en", return_ids=False, show_progress=False)

    def _build(self):
        bm25 = require_bm25s("BM25Retriever").BM25(k1=self.k1, b=self.b)
        bm25.index(self._tokenize([p.contents for p in self.corpus.passages]), show_progress=False)
        return bm25

    def _load(self):
        if not (self.index_path / "params.index.json").is_file():
            return None
        try:
            bm25 = require_bm25s("BM25Retriever").BM25.load(str(self.index_path), load_corpus=False, show_progress=False)
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

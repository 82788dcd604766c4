"""The Search game and env: a question, searches answered with passages, an answer scored by exact match."""

from __future__ import annotations

import functools
import logging
import multiprocessing
from collections.abc import Sequence
from typing import Literal

from torchrl_agent.envs.base import GameState, TextEnv, TextGame, _as_str_list
from torchrl_agent.envs.search.answers import INVALID_ACTION_MESSAGE, exact_match, parse_action
from torchrl_agent.envs.search.corpus import Passage
from torchrl_agent.envs.search.dense import DenseRetriever
from torchrl_agent.envs.search.questions import (
    SearchQuestion,
    load_fanoutqa_questions,
    load_searchr1_questions,
    split_questions,
)
from torchrl_agent.envs.search.retrievers import BM25Retriever, HttpRetriever, RetrievalError, Retriever

__all__ = ["SearchEnv", "SearchGame", "format_passages"]

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


@functools.lru_cache(maxsize=1)
def _default_bm25() -> BM25Retriever:
    return BM25Retriever()


@functools.lru_cache(maxsize=1)
def _default_dense() -> Retriever:
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
    """A batch of Search games. See :class:`~torchrl_agent.envs.base.TextEnv` for the keys and :mod:`torchrl_agent.envs.search` for the rules.

    Args:
        retriever: a :class:`Retriever`, ``"bm25"`` (default: BM25 over the Wikipedia summaries,
            shared by every env of the process), ``"dense"`` (MiniLM embeddings of the same
            summaries, :class:`~torchrl_agent.envs.search.dense.DenseRetriever`) or the URL of a
            Search-R1 retrieval server.
        subset: which FanOutQA questions to use (:func:`load_fanoutqa_questions`).
        questions: explicit questions instead (used for both splits, as given).
        train_file, test_file: Search-R1 data files (parquet/jsonl with ``question``,
            ``golden_answers``, ``data_source``; :func:`~torchrl_agent.envs.search.questions.load_searchr1_questions`)
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

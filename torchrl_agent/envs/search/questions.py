"""Search questions: FanOutQA's short-answer sub-questions, Search-R1's data files, and the train/eval split."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torchrl_agent.envs.base import stable_hash
from torchrl_agent.envs.data_files import DataFileError, check_type, describe, read_json
from torchrl_agent.envs.search.answers import normalize_answer
from torchrl_agent.envs.search.corpus import _package_data, load_wiki_corpus

__all__ = ["SearchQuestion", "load_fanoutqa_questions", "load_searchr1_questions", "split_questions"]

logger = logging.getLogger(__name__)


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


def _read_rows(path: Path) -> list:
    """The rows of a parquet, jsonl or json file, as Python objects (each should be a dict)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow), or convert it to jsonl") from err
        try:
            return pq.read_table(path).to_pylist()
        except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
            raise DataFileError(path, f"not a readable parquet file ({err})") from None
    if suffix in (".jsonl", ".json"):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise DataFileError(path, f"not UTF-8 text (byte {err.start}: {err.reason})") from None
        if suffix == ".json" and text.lstrip().startswith("["):  # one JSON array, else one object a line
            return read_json(path)
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataFileError(path, f"line {n} is not valid JSON ({err.msg}, column {err.colno})") from None
        return rows
    raise ValueError(f"{path}: Search-R1 data must be .parquet, .jsonl or .json, got {suffix!r}")


def _golden_answers(row: dict, path: Path, n: int) -> list[str]:
    """The gold answers of row ``n``: ``golden_answers`` (a list, or one string), else
    ``reward_model.ground_truth.target``; a field of another type is a :class:`DataFileError`."""
    field, answers = "golden_answers", row.get("golden_answers")
    if answers is None:  # Search-R1's processed files also carry them in reward_model.ground_truth.target
        node, field = row, None
        for key in ("reward_model", "ground_truth", "target"):
            check_type(node, dict, path, record=n, field=field)
            field = key if field is None else f"{field}.{key}"
            node = node.get(key)
            if node is None:
                return []
        answers = node
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, (list, tuple)):
        raise DataFileError(path, f"must be a list of strings or a string, got {describe(answers)}", record=n,
                            field=field)
    for i, answer in enumerate(answers):
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise DataFileError(path, f"answer {i} must be a string, got {describe(answer)}", record=n, field=field)
    return [str(a).strip() for a in answers if str(a).strip()]


def load_searchr1_questions(path: str | os.PathLike, *, limit: int | None = None) -> tuple[SearchQuestion, ...]:
    """The questions of a Search-R1 data file (``train.parquet``, ``test.parquet``, or jsonl rows).

    Each row needs ``question`` and ``golden_answers`` (a list; a string is taken as one answer;
    Search-R1's ``reward_model.ground_truth.target`` is read when ``golden_answers`` is missing);
    ``data_source`` (``nq``, ``hotpotqa``, ...) becomes the question's ``source``, which the env
    reports as its ``task_type`` so success is logged per source; ``id`` is kept when present.
    Rows without a question or without answers are skipped (counted in a warning that names the
    first one). A file that cannot be read, a row that is not an object, or a field of the wrong
    type (``golden_answers: 3``) raises :class:`~torchrl_agent.envs.data_files.DataFileError`
    naming the file, the row (0-based) and the field.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Search-R1 data file {path} does not exist")
    questions, skipped = [], []
    for n, row in enumerate(_read_rows(path)):
        if limit is not None and len(questions) >= limit:
            break
        check_type(row, dict, path, record=n)
        question = row.get("question")
        if question is not None:
            question = check_type(question, str, path, record=n, field="question").strip()
        for field in ("data_source", "id"):
            if row.get(field) is not None:
                check_type(row[field], (str, int), path, record=n, field=field)
        answers = _golden_answers(row, path, n)
        if not question or not answers:
            skipped.append(n)
            continue
        source = str(row.get("data_source") or "")
        qid = str(row.get("id", f"{source or path.stem}_{n}"))
        questions.append(SearchQuestion(id=qid, question=question, answers=tuple(answers), source=source))
    if skipped:
        logger.warning("%s: skipped %d rows without a question or golden answers (the first: row %d)", path,
                       len(skipped), skipped[0])
    if not questions:
        raise ValueError(f"{path} holds no usable question (rows need 'question' and 'golden_answers')")
    return tuple(questions)

"""Search actions and answers: the tagged action's parsing, and the SQuAD / Search-R1 answer match."""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Sequence
from typing import Literal

__all__ = ["INVALID_ACTION_MESSAGE", "MAX_ACTION_CHARS", "exact_match", "normalize_answer", "parse_action"]

#: Actions longer than this are invalid (a tagged query or answer is far shorter).
MAX_ACTION_CHARS = 4096

#: The observation after an invalid action (Search-R1's wording).
INVALID_ACTION_MESSAGE = (
    "My previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again."
)

_TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL | re.IGNORECASE)


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

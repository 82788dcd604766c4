"""Reading the environments' data files: a bad file fails when the env is built, naming the file, record and field.

:class:`DataFileError` is a ``ValueError`` (so the CLI reports it as ``torchrl-agent: invalid
config: ...`` and exits with status 2), with a one-line message of the form::

    <file>: record <index or id>: field '<name>': <what is wrong>

:func:`read_json` parses a JSON file and turns a parse error (a file cut short, not JSON at all, not
UTF-8) into a :class:`DataFileError` with the line and column. :func:`check_type` and
:func:`check_str_list` check one field of one record. The environments call them while they read
their files (WebShop's catalogue, Search-R1's questions, ALFWorld's games, AppWorld's tasks), so
every record they use is checked once and none is skipped silently.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["DataFileError", "check_str_list", "check_type", "describe", "read_json"]

_KIND_NAMES = {str: "a string", list: "a list", dict: "an object", bool: "true or false", int: "an integer",
               float: "a number", type(None): "null"}


class DataFileError(ValueError):
    """A data file is not what its environment reads: not parseable, or a record with a missing or mistyped field.

    Attributes: ``path``, ``record`` (index or id, or ``None`` for the whole file), ``field``
    (dotted name, or ``None``) and ``problem`` (what is wrong).
    """

    def __init__(self, path: str | os.PathLike, problem: str, *, record: Any = None, field: str | None = None):
        self.path, self.problem, self.record, self.field = os.fspath(path), problem, record, field
        where = [self.path]
        if record is not None:
            where.append(f"record {record}")
        if field is not None:
            where.append(f"field {field!r}")
        super().__init__(": ".join(where) + ": " + problem)

    def __reduce__(self):  # picklable (worker processes send their errors to the parent)
        return _rebuild, (self.path, self.problem, self.record, self.field)


def _rebuild(path, problem, record, field) -> DataFileError:
    return DataFileError(path, problem, record=record, field=field)


def describe(value: Any) -> str:
    """A short description of a value for an error message: ``"int 3"``, ``"str 'abc'"``, ``"a list"``."""
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def read_json(path: str | os.PathLike) -> Any:
    """The parsed content of the JSON file ``path``.

    Raises FileNotFoundError when it is missing, and :class:`DataFileError` (naming the file, the
    line and the column) when it is not UTF-8 or not valid JSON, e.g. cut short by a failed copy.
    """
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataFileError(path, f"not UTF-8 text (byte {err.start}: {err.reason})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        end = text.rstrip()[-1:]
        cut = "; it ends without closing its brackets: cut short?" if end not in ("}", "]") else ""
        raise DataFileError(path, f"not valid JSON ({err.msg}: line {err.lineno}, column {err.colno}){cut}") from None


def check_type(value: Any, kinds: type | tuple[type, ...], path: str | os.PathLike, *, record: Any = None,
               field: str | None = None, expected: str | None = None) -> Any:
    """``value`` if it is an instance of ``kinds`` (``bool`` never counts as a number), else a
    :class:`DataFileError` saying it must be ``expected`` (default: the kinds' names, "a list")."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    is_bool_for_number = isinstance(value, bool) and bool not in kinds
    if not isinstance(value, kinds) or is_bool_for_number:
        wanted = expected or " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds)
        raise DataFileError(path, f"must be {wanted}, got {describe(value)}", record=record, field=field)
    return value


def check_str_list(value: Any, path: str | os.PathLike, *, record: Any = None, field: str | None = None) -> list[str]:
    """``value`` if it is a list of strings, else a :class:`DataFileError` naming the first bad element."""
    check_type(value, list, path, record=record, field=field)
    if not all(isinstance(item, str) for item in value):
        i, item = next((i, item) for i, item in enumerate(value) if not isinstance(item, str))
        raise DataFileError(path, f"must be a list of strings, element {i} is {describe(item)}", record=record,
                            field=field)
    return value

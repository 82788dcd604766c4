"""ALFWorld's game files: the task types, the data layout and the search for solvable games."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

__all__ = ["TASK_TYPES", "check_task_types", "find_game_files", "task_type_of"]

#: The six ALFWorld task types (ALFRED's names), in ALFWorld's order (ids 1..6).
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)


def task_type_of(game_file: str) -> str:
    """The task type of a game: ``traj_data.json``'s ``task_type`` (read beside ``game_file``)."""
    folder = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(game_file))))
    prefix = folder.split("-", 1)[0]
    if prefix in TASK_TYPES:  # ALFRED names the task folder after its type: no need to parse the JSON
        return prefix
    with open(os.path.join(os.path.dirname(game_file), "traj_data.json")) as f:
        return json.load(f)["task_type"]


def _split_dir(data_dir: str, split: str) -> str:
    for candidate in (os.path.join(data_dir, "json_2.1.1", split), os.path.join(data_dir, split)):
        if os.path.isdir(candidate):
            return candidate
    raise FileNotFoundError(
        f"data_dir={data_dir!r} has no split {split!r}: expected {data_dir}/json_2.1.1/{split}/ or {data_dir}/{split}/"
    )


_SOLVABLE = re.compile(r'"solvable"\s*:\s*true\b')


def _find_game_files(split_dir: str, task_types: tuple[str, ...]) -> tuple[str, ...]:
    found = []
    for root, _dirs, files in os.walk(split_dir):
        if "traj_data.json" not in files or "game.tw-pddl" not in files:
            continue
        if "movable" in root or "Sliced" in root:  # not supported by ALFWorld's text engine either
            continue
        game_file = os.path.join(root, "game.tw-pddl")
        if task_type_of(game_file) not in task_types:
            continue
        with open(game_file) as f:  # ALFWorld marks the games its expert solved (a text search: no JSON parse)
            if not _SOLVABLE.search(f.read()):
                continue
        found.append(game_file)
    return tuple(sorted(found))


def find_game_files(data_dir: str, split: str = "train", task_types: Sequence[str] = TASK_TYPES) -> list[str]:
    """The solvable games of ``split`` under ``data_dir``, sorted, as ``AlfredTWEnv`` collects them.

    ``data_dir`` is ALFWorld's data root (holding ``json_2.1.1/``) or ``json_2.1.1`` itself. Games
    of the "movable" and "Sliced" families are skipped, like ALFWorld does.
    """
    task_types = check_task_types(task_types)
    return list(_find_game_files(os.path.abspath(_split_dir(os.fspath(data_dir), split)), task_types))


def check_task_types(task_types: Sequence[str] | None) -> tuple[str, ...]:
    """``task_types`` (``None``: all) as a tuple in :data:`TASK_TYPES` order; a ValueError names an unknown one."""
    if task_types is None:
        return TASK_TYPES
    if isinstance(task_types, str):
        task_types = (task_types,)
    unknown = [t for t in task_types if t not in TASK_TYPES]
    if unknown or not task_types:
        raise ValueError(f"task_types must be a non-empty subset of {TASK_TYPES}, got {list(task_types)!r}")
    return tuple(t for t in TASK_TYPES if t in task_types)

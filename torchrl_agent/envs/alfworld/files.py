"""ALFWorld's game files: the task types, the data layout and the search for solvable games."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from torchrl_agent.envs.data_files import DataFileError, check_type, read_json

__all__ = ["GAME_FIELDS", "TASK_TYPES", "check_task_types", "find_game_files", "read_game_file", "task_type_of"]

logger = logging.getLogger(__name__)

#: The six ALFWorld task types (ALFRED's names), in ALFWorld's order (ids 1..6).
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)


#: The fields of a ``game.tw-pddl`` that TextWorld's PDDL engine reads (all strings), besides ``solvable``.
GAME_FIELDS = ("pddl_domain", "grammar", "pddl_problem")


def read_game_file(game_file: str) -> dict:
    """A ``game.tw-pddl`` parsed and checked: :data:`GAME_FIELDS` are strings, ``solvable`` (when
    present) true or false. A file cut short or with a missing or mistyped field raises
    :class:`~torchrl_agent.envs.data_files.DataFileError` naming the file and the field."""
    game = check_type(read_json(game_file), dict, game_file)
    for field in GAME_FIELDS:
        if field not in game:
            raise DataFileError(game_file, "is missing (a game.tw-pddl holds the PDDL domain, grammar and problem)",
                                field=field)
        check_type(game[field], str, game_file, field=field)
    if "solvable" in game:
        check_type(game["solvable"], bool, game_file, field="solvable")
    return game


def task_type_of(game_file: str) -> str:
    """The task type of a game: ``traj_data.json``'s ``task_type`` (read beside ``game_file``)."""
    folder = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(game_file))))
    prefix = folder.split("-", 1)[0]
    if prefix in TASK_TYPES:  # ALFRED names the task folder after its type: no need to parse the JSON
        return prefix
    traj_file = os.path.join(os.path.dirname(game_file), "traj_data.json")
    traj = check_type(read_json(traj_file), dict, traj_file)
    if "task_type" not in traj:
        raise DataFileError(traj_file, "is missing", field="task_type")
    return check_type(traj["task_type"], str, traj_file, field="task_type")


def _split_dir(data_dir: str, split: str) -> str:
    for candidate in (os.path.join(data_dir, "json_2.1.1", split), os.path.join(data_dir, split)):
        if os.path.isdir(candidate):
            return candidate
    raise FileNotFoundError(
        f"data_dir={data_dir!r} has no split {split!r}: expected {data_dir}/json_2.1.1/{split}/ or {data_dir}/{split}/"
    )


def _find_game_files(split_dir: str, task_types: tuple[str, ...]) -> tuple[str, ...]:
    found, incomplete, unsolvable = [], [], []
    for root, _dirs, files in os.walk(split_dir):
        has_traj, has_game = "traj_data.json" in files, "game.tw-pddl" in files
        if not (has_traj or has_game):
            continue
        if "movable" in root or "Sliced" in root:  # not supported by ALFWorld's text engine either
            continue
        if not (has_traj and has_game):  # ALFWorld skips such folders too ("Skipping missing game!")
            incomplete.append(os.path.join(root, "game.tw-pddl" if has_traj else "traj_data.json"))
            continue
        game_file = os.path.join(root, "game.tw-pddl")
        if task_type_of(game_file) not in task_types:
            continue
        if read_game_file(game_file).get("solvable") is not True:  # ALFWorld marks the games its expert solved
            unsolvable.append(game_file)
            continue
        found.append(game_file)
    if incomplete:
        logger.warning("%s: skipped %d game folders that miss a file (as ALFWorld does); the first lacks %s",
                       split_dir, len(incomplete), incomplete[0])
    if unsolvable:
        logger.info("%s: skipped %d games not marked solvable (as ALFWorld does); the first: %s", split_dir,
                    len(unsolvable), unsolvable[0])
    return tuple(sorted(found))


def find_game_files(data_dir: str, split: str = "train", task_types: Sequence[str] = TASK_TYPES) -> list[str]:
    """The solvable games of ``split`` under ``data_dir``, sorted, as ``AlfredTWEnv`` collects them.

    ``data_dir`` is ALFWorld's data root (holding ``json_2.1.1/``) or ``json_2.1.1`` itself. Games
    of the "movable" and "Sliced" families are skipped, like ALFWorld does, and so are (with a
    warning naming the first) folders that lack their ``game.tw-pddl`` or ``traj_data.json``. Every
    game of the selected task types is parsed and checked (:func:`read_game_file`), so a garbled
    one fails here, naming its file, not when it is first played.
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

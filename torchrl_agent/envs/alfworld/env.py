"""The batched ALFWorld env: games from a data folder, explicit game files, or generated ones."""

from __future__ import annotations

import os
from collections.abc import Sequence

from torchrl_agent.envs.alfworld.files import check_task_types, find_game_files, read_game_file, task_type_of
from torchrl_agent.envs.alfworld.game import ALFWorldGame, require_alfworld
from torchrl_agent.envs.alfworld.generator import generated_data_dir
from torchrl_agent.envs.base import TextEnv

__all__ = ["ALFWorldEnv"]


class ALFWorldEnv(TextEnv):
    """A batch of ALFWorld games. See :class:`~torchrl_agent.envs.base.TextEnv` for the keys.

    Args:
        data_dir: ALFWorld's data root (holding ``json_2.1.1/``), e.g. ``$ALFWORLD_DATA`` after
            ``alfworld-download``. Read only: the engine writes nothing beside the games.
        game_files: explicit ``game.tw-pddl`` paths, used for this env's split instead of
            ``data_dir`` (each needs its ``traj_data.json`` beside it).
        task_types: keep only these task types (default: all six of :data:`TASK_TYPES`).
        train_split, eval_split: the data splits of training and evaluation games (``train``,
            ``valid_seen``: in distribution, ``valid_unseen``: out of distribution).
        expert: compute ``expert_action`` (ALFWorld's hand-coded expert).
        generated_games_per_type: without ``data_dir`` and ``game_files``, how many games per task
            type and split to generate (see :func:`torchrl_agent.envs.alfworld.generator.generated_data_dir`).
        cache_dir: where generated games are cached (default ``~/.cache/torchrl_agent/alfworld_games``).
        max_steps: episode length limit (50).
        num_groups, group_size, split, seed: see :class:`~torchrl_agent.envs.base.TextEnv`.
    """

    def __init__(
        self,
        *,
        data_dir: str | os.PathLike | None = None,
        game_files: Sequence[str] | None = None,
        task_types: Sequence[str] | None = None,
        train_split: str = "train",
        eval_split: str = "valid_unseen",
        expert: bool = True,
        generated_games_per_type: int = 4,
        cache_dir: str | os.PathLike | None = None,
        max_steps: int = 50,
        **kwargs,
    ):
        require_alfworld()
        self.task_types = check_task_types(task_types)
        split = kwargs.get("split", "train")
        data_split = eval_split if split == "eval" else train_split
        if game_files is not None:
            if isinstance(game_files, (str, os.PathLike)):
                raise TypeError("game_files must be a list of paths, got a single path")
            files = [os.fspath(f) for f in game_files]
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise FileNotFoundError(f"game_files: no such game file(s): {missing[:3]}")
            for f in files:
                read_game_file(f)  # a garbled game fails now, naming its file, not when it is played
            files = [f for f in files if task_type_of(f) in self.task_types]
        else:
            if data_dir is None:
                data_dir = generated_data_dir(games_per_type=generated_games_per_type, task_types=self.task_types,
                                              cache_dir=cache_dir, splits=(data_split,))
            files = find_game_files(os.fspath(data_dir), data_split, self.task_types)
        if not files:
            raise ValueError(f"no ALFWorld game found for split {data_split!r} and task_types {self.task_types}")
        self.game_files = files
        super().__init__(lambda: ALFWorldGame(files, expert=expert), max_steps=max_steps, **kwargs)

    @property
    def current_game_files(self) -> list[str]:
        """The game file each game of the batch currently plays."""
        return [game.game_file for game in self.games]

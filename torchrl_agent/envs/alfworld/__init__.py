"""ALFWorld: household tasks played through the real TextWorld PDDL engine of the ``alfworld`` package.

Each game is an ALFWorld ``game.tw-pddl`` (a JSON file holding the PDDL domain, the text grammar and
the PDDL problem of one scene) with its ``traj_data.json`` beside it, in ALFWorld's own layout::

    <data_dir>/json_2.1.1/<split>/<task_type>-<object>-<mrecep>-<receptacle>-<scene>/<trial>/game.tw-pddl
                                                                                      /traj_data.json

A game is played by ``textworld``'s ``PddlEnv`` wrapped in ALFWorld's ``AlfredDemangler`` (object
names such as ``potato 1``), ``AlfredInfos`` and ``AlfredExpert`` (the hand-coded expert,
``expert_type="handcoded"``), exactly as ``alfworld.agents.environment.AlfredTWEnv`` builds it.

Rules (as the reference, verl-agent's ``AlfredTWEnv``): reward 10 when the game is won (the episode then ends, solved), else 0;
50 steps at most. Any string is an action: a command the engine does not know is answered
"Nothing happens." and changes nothing.

Keys written (see :mod:`torchrl_agent.envs.base`):

* ``task``: the goal, e.g. ``"put a hot potato in sinkbasin."`` (the text after "Your task is to: ");
* ``observation``: the raw engine feedback; after a reset the room description
  ("You are in the middle of a room. Looking quickly around you, you see ...");
* ``admissible_actions``: the engine's admissible commands, newline-joined (sorted, as the engine
  gives them), without ``help`` (the reference leaves it out of the prompt: it is not a move);
* ``expert_action``: the hand-coded expert's next command ("look" where ALFWorld's expert wrapper
  falls back to it: right after a reset, or when the expert's command is not admissible or the
  expert fails after off-expert actions);
* ``task_type``: one of :data:`TASK_TYPES`;
* ``anchor``: the observation text (GiGPO's step anchor is the last feedback text).

Game selection: a group's seed picks game ``(seed // 2) % len(games)`` of the split's sorted game
list, so the ``group_size`` games of a group play the same game from the same initial state, and the
evaluation panel (odd seeds ``2 * (base + j) + 1``) walks the evaluation games in order. The
training games come from ``train_split`` (default ``"train"``), the evaluation games from
``eval_split``: ``"valid_unseen"`` (the default: ALFWorld's out-of-distribution scenes, the harder
test) or ``"valid_seen"`` (in distribution: new games in the training scenes, the reference's default
``eval_in_distribution``, which the reference recipes here use).

Without ``data_dir`` or ``game_files``, games are generated offline from the scene data shipped in
the ``alfworld`` wheel (:mod:`torchrl_agent.envs.alfworld.generator`) and cached on disk, each split
the first time an env plays it (``generated_games_per_type`` games per task type; each game is
checked by playing the expert through the engine, tens of seconds a game on one CPU core).

Modules: ``files`` (task types, data layout, finding games), ``game`` (one game on the engine),
``generator`` (offline game generation) and ``env`` (the batched env).
"""

from torchrl_agent.envs.alfworld import prompts as _prompts  # noqa: F401 - registers its templates
from torchrl_agent.envs.alfworld.env import ALFWorldEnv
from torchrl_agent.envs.alfworld.files import TASK_TYPES, find_game_files, task_type_of
from torchrl_agent.envs.alfworld.game import ALFWorldGame
from torchrl_agent.envs.alfworld.generator import GENERATOR_VERSION, SPLITS, generate_games, generated_data_dir

__all__ = ["GENERATOR_VERSION", "SPLITS", "TASK_TYPES", "ALFWorldEnv", "ALFWorldGame", "find_game_files",
           "generate_games", "generated_data_dir", "task_type_of"]

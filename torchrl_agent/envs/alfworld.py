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
the ``alfworld`` wheel (:mod:`torchrl_agent.envs.alfworld_gen`) and cached on disk.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import random
import re
import sys
import threading
from collections.abc import Sequence

from torchrl_agent.envs.base import GameState, TextEnv, TextGame

__all__ = ["TASK_TYPES", "ALFWorldGame", "ALFWorldEnv", "find_game_files", "task_type_of"]

#: The six ALFWorld task types (ALFRED's names), in ALFWorld's order (ids 1..6).
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

WIN_REWARD = 10.0
_BANNER = "-= Welcome to TextWorld, ALFRED! =-"
_TASK_PREFIX = "Your task is to:"


def _require_alfworld():
    try:
        import alfworld.agents.environment.alfred_tw_env as alfred_tw_env
        import textworld
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError(
            "the ALFWorld environment needs the 'alfworld' package: pip install 'torchrl-agent[alfworld]'"
        ) from err
    return textworld, alfred_tw_env


# ------------------------------------------------------------------------------------- game files
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
    task_types = _check_task_types(task_types)
    return list(_find_game_files(os.path.abspath(_split_dir(os.fspath(data_dir), split)), task_types))


def _check_task_types(task_types: Sequence[str] | None) -> tuple[str, ...]:
    if task_types is None:
        return TASK_TYPES
    if isinstance(task_types, str):
        task_types = (task_types,)
    unknown = [t for t in task_types if t not in TASK_TYPES]
    if unknown or not task_types:
        raise ValueError(f"task_types must be a non-empty subset of {TASK_TYPES}, got {list(task_types)!r}")
    return tuple(t for t in TASK_TYPES if t in task_types)


# ------------------------------------------------------------------------------------- engine helpers
#: Held while a game engine runs: it changes process-wide state (``sys.argv``, the ``random``
#: stream: see :func:`_engine_guard`, :func:`_seeded_global_random`), so games stepped from several
#: threads of one process (the shards of a collector process) take turns.
_ENGINE_LOCK = threading.RLock()


@contextlib.contextmanager
def _engine_guard():
    """Undo the engine's process-wide side effects: fast-downward's translator rewrites ``sys.argv``."""
    argv, saved = sys.argv, list(sys.argv)
    try:
        yield
    finally:
        sys.argv = argv
        argv[:] = saved


@functools.lru_cache(maxsize=64)
def _pddl2sas_cached(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
    import fast_downward

    return fast_downward.pddl2sas(domain, problem, verbose=verbose, optimize=optimize)


class _CachedFastDownward:
    """``fast_downward`` with a memoised ``pddl2sas``: the PDDL->SAS translation is a pure function of
    the (domain, problem) texts and takes most of a load; every game of a group (and every later
    episode of the same game) reuses it. The translated task is only read by the engine.

    The engine also translates each problem a second time, optimised, for its planner (``replan``,
    which serves only the ``policy_commands`` / ``walkthrough`` infos; this environment requests
    neither): that second translation is replaced by the first, unoptimised one, which the planner
    accepts as well. This halves the cost of loading a game.
    """

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    @staticmethod
    def pddl2sas(domain, problem, verbose=False, optimize=False):
        return _pddl2sas_cached(domain, problem, verbose, False)


def _memoised_parse(parse):
    """Memoise a text-grammar parse (a pure function of its arguments); callers get a fresh copy."""
    cache: dict = {}

    def cached(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = parse(*args, **kwargs)
        return copy.deepcopy(cache[key])

    cached._torchrl_agent_memoised = True
    return cached


class _CachedRule:
    """Stands for ``textworld.logic.Rule`` inside the text generator: its queries are parsed once."""

    def __init__(self, rule_cls):
        self._parse = _memoised_parse(rule_cls.parse_conjunctive_query)

    def parse_conjunctive_query(self, expression):
        return self._parse(expression)


def _install_engine_caches() -> None:
    """Memoise the engine's pure, repeated work, once per process.

    * the PDDL->SAS translation of a (domain, problem), most of a reset (:class:`_CachedFastDownward`);
    * the text generator's parses of its templates and conditions: every step re-parses the same
      few strings (``"go to [{r.name | ...}]"``) once per admissible command, most of a step.

    Only parsing is cached; game states, facts and the derivations themselves are untouched.
    """
    import textworld.envs.pddl.logic as pddl_logic
    import textworld.envs.pddl.textgen as textgen

    if not isinstance(pddl_logic.fast_downward, _CachedFastDownward):
        pddl_logic.fast_downward = _CachedFastDownward(pddl_logic.fast_downward)
    if not getattr(textgen._parse_and_convert, "_torchrl_agent_memoised", False):
        textgen._parse_and_convert = _memoised_parse(textgen._parse_and_convert)
    if not isinstance(textgen.Rule, _CachedRule):
        textgen.Rule = _CachedRule(textgen.Rule)


@contextlib.contextmanager
def _seeded_global_random(rng: random.Random):
    """Run code that calls the ``random`` module (ALFWorld's expert does) on ``rng``'s stream,
    leaving the process's own ``random`` stream untouched."""
    saved = random.getstate()
    random.setstate(rng.getstate())
    try:
        yield
    finally:
        rng.setstate(random.getstate())
        random.setstate(saved)


@functools.lru_cache(maxsize=1)
def _robust_expert_class():
    _, alfred_tw_env = _require_alfworld()

    class RobustAlfredExpert(alfred_tw_env.AlfredExpert):
        """ALFWorld's ``AlfredExpert`` (hand-coded), whose failures fall back to its "look" default.

        The hand-coded expert tracks the episode from the commands actually played; after arbitrary
        agent commands it may raise (``HandCodedAgentFailed``, an ``IndexError`` on an empty
        command, ...). ALFWorld's wrapper then crashes; here ``expert_plan`` stays ``["look"]``, the
        wrapper's own default for a non-admissible expert command.
        """

        def _gather_infos(self):
            try:
                super()._gather_infos()
            except Exception:  # noqa: BLE001 - any expert failure only loses the hint
                self.state["extra.expert_plan"] = ["look"]

    return RobustAlfredExpert


def split_intro(feedback: str) -> tuple[str, str]:
    """Split a reset text into ``(room description, goal)``; the goal loses its "Your task is to: "."""
    text = feedback.replace(_BANNER, "").strip()
    head, sep, goal = text.partition(_TASK_PREFIX)
    if not sep:
        return text, ""
    return head.strip(), goal.strip()


# ------------------------------------------------------------------------------------- game / env
class ALFWorldGame(TextGame):
    """One ALFWorld episode on the TextWorld PDDL engine.

    Args:
        game_files: the games to choose from (paths to ``game.tw-pddl``, ``traj_data.json`` beside
            each); the seed picks ``game_files[(seed // 2) % len(game_files)]``.
        expert: compute ``expert_action`` with ALFWorld's hand-coded expert (costs a little per step).
    """

    def __init__(self, game_files: Sequence[str], *, expert: bool = True):
        if len(game_files) == 0:
            raise ValueError("game_files is empty: no ALFWorld game to play")
        self.game_files = list(game_files)
        self.expert = expert
        self._env = None
        self._loaded: str | None = None
        self._expert_rng = random.Random(0)
        self.game_file = ""
        self.task = ""
        self.task_type = ""

    def _make_engine(self):
        textworld, alfred_tw_env = _require_alfworld()
        _install_engine_caches()
        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        from textworld.envs import PddlEnv

        env = alfred_tw_env.AlfredInfos(alfred_tw_env.AlfredDemangler(PddlEnv(infos), shuffle=False))
        if self.expert:
            infos.extras.append("expert_plan")
            env = _robust_expert_class()(env, expert_type="handcoded")
        return env

    def reset(self, seed: int) -> GameState:
        game_file = self.game_files[(int(seed) // 2) % len(self.game_files)]
        if self._env is None:
            self._env = self._make_engine()
        self._expert_rng = random.Random(seed)
        with _ENGINE_LOCK, _engine_guard(), _seeded_global_random(self._expert_rng):
            if self._loaded != game_file:
                self._loaded = None
                try:
                    self._env.load(game_file)
                except Exception as err:
                    raise RuntimeError(f"could not load the ALFWorld game {game_file!r}: {err}") from err
                self._loaded = game_file
            state = self._env.reset()
        self.game_file = game_file
        self.task_type = task_type_of(game_file)
        room, self.task = split_intro(state.feedback)
        return self._state(state, room)

    def step(self, action: str) -> tuple[GameState, float, bool, bool]:
        if self._loaded is None:
            raise RuntimeError("step() called before reset()")
        if not isinstance(action, str):
            action = ""
        with _ENGINE_LOCK, _engine_guard(), _seeded_global_random(self._expert_rng):
            state, _score, _done = self._env.step(action)
        won = bool(state["won"])
        return self._state(state, state.feedback), (WIN_REWARD if won else 0.0), won, won

    def _state(self, state, observation: str) -> GameState:
        expert = ""
        if self.expert:
            plan = state.get("extra.expert_plan") or [""]
            expert = plan[0]
        return GameState(
            observation=observation,
            task=self.task,
            admissible_actions=tuple(a for a in state["admissible_commands"] if a != "help"),
            expert_action=expert,
            task_type=self.task_type,
        )


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
            type and split to generate (see :func:`torchrl_agent.envs.alfworld_gen.generated_data_dir`).
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
        _require_alfworld()
        self.task_types = _check_task_types(task_types)
        split = kwargs.get("split", "train")
        data_split = eval_split if split == "eval" else train_split
        if game_files is not None:
            if isinstance(game_files, (str, os.PathLike)):
                raise TypeError("game_files must be a list of paths, got a single path")
            files = [os.fspath(f) for f in game_files]
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise FileNotFoundError(f"game_files: no such game file(s): {missing[:3]}")
            files = [f for f in files if task_type_of(f) in self.task_types]
        else:
            if data_dir is None:
                from torchrl_agent.envs.alfworld_gen import generated_data_dir

                data_dir = generated_data_dir(games_per_type=generated_games_per_type, task_types=self.task_types,
                                              cache_dir=cache_dir, splits=("train", "valid_unseen", data_split))
            files = find_game_files(os.fspath(data_dir), data_split, self.task_types)
        if not files:
            raise ValueError(f"no ALFWorld game found for split {data_split!r} and task_types {self.task_types}")
        self.game_files = files
        super().__init__(lambda: ALFWorldGame(files, expert=expert), max_steps=max_steps, **kwargs)

    @property
    def current_game_files(self) -> list[str]:
        """The game file each game of the batch currently plays."""
        return [game.game_file for game in self.games]

"""One ALFWorld game on the real TextWorld PDDL engine, with ALFWorld's wrappers and hand-coded expert.

A game is played by ``textworld``'s ``PddlEnv`` wrapped in ALFWorld's ``AlfredDemangler`` (object
names such as ``potato 1``), ``AlfredInfos`` and ``AlfredExpert`` (the hand-coded expert,
``expert_type="handcoded"``), exactly as ``alfworld.agents.environment.AlfredTWEnv`` builds it;
the engine's process-wide state is guarded so games can step from several threads.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import random
import sys
import threading
from collections.abc import Sequence

from torchrl_agent.envs.alfworld.files import task_type_of
from torchrl_agent.envs.base import GameState, TextGame

__all__ = ["ALFWorldGame", "require_alfworld", "split_intro"]

WIN_REWARD = 10.0
_BANNER = "-= Welcome to TextWorld, ALFRED! =-"
_TASK_PREFIX = "Your task is to:"


def require_alfworld():
    """``(textworld, alfworld's alfred_tw_env module)``; an ImportError naming the extra when missing."""
    try:
        import alfworld.agents.environment.alfred_tw_env as alfred_tw_env
        import textworld
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError(
            "the ALFWorld environment needs the 'alfworld' package: pip install 'torchrl-agent[alfworld]'"
        ) from err
    return textworld, alfred_tw_env


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
    _, alfred_tw_env = require_alfworld()

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
        textworld, alfred_tw_env = require_alfworld()
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

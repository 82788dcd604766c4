"""BabyAI as a text game, through :class:`~torchrl_agent.envs.games.gymnasium_adapter.GymnasiumTextGame`.

:class:`BabyAIEnv` (registered as ``babyai``) ships the BabyAI levels of the PyPI package
``minigrid`` (no download: levels are procedurally generated) with a text view of the agent's 7x7
egocentric observation and the BabyAI bot (``minigrid.utils.baby_ai_bot.BabyAIBot``) as the expert.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from torchrl_agent.envs.base import GameState, TextEnv
from torchrl_agent.envs.games.gymnasium_adapter import GymnasiumTextGame
from torchrl_agent.envs.transforms.templates import register_template

__all__ = ["BabyAIGame", "BabyAIEnv", "render_babyai"]


#: action text -> MiniGrid action index (``minigrid.core.actions.Actions``)
BABYAI_ACTIONS = {"turn left": 0, "turn right": 1, "go forward": 2, "pick up": 3, "drop": 4, "toggle": 5, "done": 6}
_ALIASES = {"left": 0, "right": 1, "forward": 2, "move forward": 2, "pickup": 3, "pick up the object": 3,
            "open": 5}
_ACTION_NAMES = {v: k for k, v in BABYAI_ACTIONS.items()}
_DIRECTIONS = ("east", "south", "west", "north")
# minigrid.core.constants, copied so rendering needs no import
_OBJECTS = ("unseen", "empty", "wall", "floor", "door", "key", "ball", "box", "goal", "lava", "agent")
_COLORS = ("red", "green", "blue", "purple", "yellow", "grey")
_DOOR_STATES = ("open", "closed", "locked")


def parse_babyai_action(text: str) -> int | None:
    """``"turn left"`` ... ``"done"`` (or the short MiniGrid names) to the action index, else None."""
    key = " ".join(text.strip().lower().split())
    return BABYAI_ACTIONS.get(key, _ALIASES.get(key))


def check_babyai_actions(actions: Sequence[str]) -> tuple[str, ...]:
    """``actions`` as a tuple of :data:`BABYAI_ACTIONS` names; a ValueError names an unknown one."""
    unknown = [a for a in actions if a not in BABYAI_ACTIONS]
    if unknown or not actions:
        raise ValueError(f"BabyAI actions must be a non-empty subset of {list(BABYAI_ACTIONS)}, got {list(actions)}")
    return tuple(actions)


#: BabyAI reward shapings: none, or the BFS distance of :func:`goto_distance` (GoTo levels)
BABYAI_SHAPINGS = (None, "distance")


def check_babyai_shaping(shaping: str | None) -> str | None:
    """``shaping`` if it is one of :data:`BABYAI_SHAPINGS`; else a ValueError naming them."""
    if shaping not in BABYAI_SHAPINGS:
        raise ValueError(f"BabyAI: shaping must be one of {BABYAI_SHAPINGS}, got {shaping!r}")
    return shaping


#: MiniGrid's ``DIR_TO_VEC``: the cell in front for agent directions 0 (east) .. 3 (north)
_FRONT = ((1, 0), (0, 1), (-1, 0), (0, -1))


def goto_distance(env) -> int | None:
    """The fewest navigation moves (turn left, turn right, go forward) after which the agent faces one
    of the objects of its GoTo mission from the next cell (the level's success), by breadth-first
    search over (cell, direction); None when no object can be reached. Raises for a level whose
    mission is not "go to ..."."""
    from minigrid.envs.babyai.core.verifier import GoToInstr

    u = env.unwrapped
    if not isinstance(u.instrs, GoToInstr):
        raise ValueError(f"distance shaping needs a GoTo mission, got {type(u.instrs).__name__} ({u.mission!r})")
    goals = {tuple(int(v) for v in pos) for pos in u.instrs.desc.obj_poss}
    start = (int(u.agent_pos[0]), int(u.agent_pos[1]), int(u.agent_dir))
    frontier, seen = [start], {start}
    for distance in range(4 * u.grid.width * u.grid.height):
        following = []
        for x, y, d in frontier:
            fx, fy = x + _FRONT[d][0], y + _FRONT[d][1]
            if (fx, fy) in goals:
                return distance
            moves = [(x, y, (d - 1) % 4), (x, y, (d + 1) % 4)]
            if 0 <= fx < u.grid.width and 0 <= fy < u.grid.height:
                cell = u.grid.get(fx, fy)
                if cell is None or cell.can_overlap():
                    moves.append((fx, fy, d))
            for move in moves:
                if move not in seen:
                    seen.add(move)
                    following.append(move)
        if not following:
            return None
        frontier = following
    return None


def _steps(n: int, word: str) -> str:
    return f"{n} step{'s' if n != 1 else ''} {word}"


def render_babyai(obs: dict) -> str:
    """Describe a MiniGrid observation dict (``image`` 7x7x3 egocentric, ``direction``) in words.

    The agent stands at the bottom centre of its view, looking up the view (``forward``). Objects
    are listed with their offsets ("2 steps forward, 1 step left"); walls only along the three
    lines the agent can act on (ahead, to its left, to its right).
    """
    image = np.asarray(obs["image"])
    width, height = image.shape[:2]
    ax, ay = width // 2, height - 1

    def name(cell) -> str:
        kind, color, state = (int(v) for v in cell)
        kind_name = _OBJECTS[kind] if 0 <= kind < len(_OBJECTS) else "object"
        color_name = _COLORS[color] if 0 <= color < len(_COLORS) else ""
        if kind_name == "door":
            return f"{_DOOR_STATES[state] if 0 <= state < 3 else ''} {color_name} door".strip()
        if kind_name in ("goal", "lava", "wall"):
            return kind_name
        return f"{color_name} {kind_name}".strip()

    lines = [f"You are facing {_DIRECTIONS[int(obs['direction']) % 4]}."]
    carried = _OBJECTS[int(image[ax, ay, 0])]
    lines.append(f"You are carrying a {name(image[ax, ay])}." if carried not in ("empty", "unseen", "agent")
                 else "You are carrying nothing.")
    seen = []
    for y in range(height - 1, -1, -1):
        for x in range(width):
            if (x, y) == (ax, ay):
                continue
            kind = _OBJECTS[int(image[x, y, 0])] if int(image[x, y, 0]) < len(_OBJECTS) else "object"
            if kind in ("unseen", "empty", "wall", "floor", "agent"):
                continue
            forward, right = ay - y, x - ax
            where = [_steps(forward, "forward")] if forward else []
            if right:
                where.append(_steps(abs(right), "right" if right > 0 else "left"))
            seen.append(f"a {name(image[x, y])} {', '.join(where)}")
    lines.append(("You see " + "; ".join(seen) + ".") if seen else "You see no objects.")

    def free_run(cells) -> str:
        count = 0
        for x, y in cells:
            kind = _OBJECTS[int(image[x, y, 0])] if int(image[x, y, 0]) < len(_OBJECTS) else "object"
            if kind == "unseen":
                return f"{count}+ free"
            if kind not in ("empty", "floor", "goal") and not (kind == "door" and int(image[x, y, 2]) == 0):
                return f"{count} free, then a {name(image[x, y])}"
            count += 1
        return f"{count}+ free"

    ahead = free_run([(ax, y) for y in range(ay - 1, -1, -1)])
    left = free_run([(x, ay) for x in range(ax - 1, -1, -1)])
    right = free_run([(x, ay) for x in range(ax + 1, width)])
    lines.append(f"Cells ahead: {ahead}. To your left: {left}. To your right: {right}.")
    return " ".join(lines)


class BabyAIGame(GymnasiumTextGame):
    """One BabyAI episode; ``expert_action`` comes from the BabyAI bot.

    Args:
        level: a registered BabyAI level id, e.g. ``"BabyAI-GoToLocal-v0"``.
        gym_max_steps: the level's own time limit (set high so that :class:`TextEnv` truncates first).
        expert: run the bot (it costs a BFS per step).
        actions: the admissible moves (default: all seven); any other answer is invalid.
        shaping: ``"distance"`` adds the potential-based shaping term ``d(s) - d(s')`` to every step's
            reward (Ng et al., 1999: the optimal policies are unchanged), where ``d`` is
            :func:`goto_distance`: +1 for a move that brings the agent one move closer to the goal, -1 for
            one that takes it further, 0 for a wasted one. GoTo levels only. Success is the level's.
        invalid_reward: the reward of an answer that is not an admissible move (no env step).
    """

    def __init__(self, level: str = "BabyAI-GoToLocal-v0", gym_max_steps: int = 10_000, expert: bool = True,
                 actions: Sequence[str] | None = None, shaping: str | None = None, invalid_reward: float = 0.0):
        self.shaping, self._distance = check_babyai_shaping(shaping), None
        import gymnasium
        import minigrid  # noqa: F401  (registers the BabyAI levels)

        self.use_expert = expert
        self._bot = None
        actions = tuple(BABYAI_ACTIONS) if actions is None else check_babyai_actions(actions)
        allowed = {BABYAI_ACTIONS[a] for a in actions}

        def parse(text: str) -> int | None:  # a move outside ``actions`` is an invalid answer
            index = parse_babyai_action(text)
            return index if index in allowed else None

        super().__init__(
            lambda: gymnasium.make(level, max_steps=gym_max_steps, disable_env_checker=True),
            render_babyai,
            parse,
            admissible_actions=actions,
            task=lambda obs: str(obs["mission"]),
            task_type=level,
            invalid_action_reward=invalid_reward,
        )

    def reset(self, seed: int) -> GameState:
        with contextlib.redirect_stdout(io.StringIO()):  # minigrid prints when it redraws a level
            state = super().reset(seed)
        if self.shaping:
            self._distance = goto_distance(self.env)
        return state

    def step(self, action: str) -> tuple[GameState, float, bool, bool]:
        state, reward, done, success = super().step(action)
        if self.shaping:
            before, self._distance = self._distance, goto_distance(self.env)
            if before is not None and self._distance is not None:
                reward += before - self._distance
        return state, reward, done, success

    def expert_reset(self) -> str:
        self._bot = None
        if not self.use_expert:
            return ""
        from minigrid.utils.baby_ai_bot import BabyAIBot

        try:
            self._bot = BabyAIBot(self.env)
            return _ACTION_NAMES[int(self._bot.replan())]
        except Exception:  # the bot cannot handle this mission: no expert for the episode
            self._bot = None
            return ""

    def expert_step(self, action: Any) -> str:
        if self._bot is None:
            return ""
        try:
            return _ACTION_NAMES[int(self._bot.replan(action))]
        except Exception:  # the bot gave up (e.g. the agent destroyed a needed object)
            self._bot = None
            return ""


class BabyAIEnv(TextEnv):
    """A batch of BabyAI episodes. See :class:`~torchrl_agent.envs.base.TextEnv` for the keys.

    Args:
        level: the BabyAI level id (default ``"BabyAI-GoToLocal-v0"``: one 8x8 room, go to an object among
            distractors).
        expert: fill ``expert_action`` from the BabyAI bot (default True).
        max_steps: steps per episode (default 64).
        actions: the moves the agent may use (default: all seven of :data:`BABYAI_ACTIONS`); any other
            answer is invalid. ``["turn left", "turn right", "go forward"]`` is enough for the GoTo levels.
        shaping, invalid_reward: as :class:`BabyAIGame`'s (``shaping="distance"``: GoTo levels only).
    """

    def __init__(self, *, level: str = "BabyAI-GoToLocal-v0", expert: bool = True, max_steps: int = 64,
                 actions: Sequence[str] | None = None, shaping: str | None = None, invalid_reward: float = 0.0,
                 **kwargs):
        try:
            import gymnasium
            import minigrid  # noqa: F401
        except ImportError as err:  # pragma: no cover - depends on the install
            raise ImportError("the babyai env needs the PyPI package 'minigrid' (pip install minigrid)") from err
        if level not in gymnasium.registry:
            raise ValueError(f"unknown BabyAI level {level!r}; e.g. 'BabyAI-GoToLocal-v0'")
        actions = None if actions is None else check_babyai_actions(list(actions))
        check_babyai_shaping(shaping)
        super().__init__(lambda: BabyAIGame(level, max(10 * max_steps, 1000), expert, actions, shaping, invalid_reward),
                         max_steps=max_steps, **kwargs)


# ------------------------------------------------------------------------------ prompts and parsing
register_template("babyai_short", (
    "{task}\n"
    "{observation}"
))
# babyai_short with the memory's lines between the task and the view (a policy that sees its last
# move can leave a left/right cycle that a memoryless one repeats; docs/learning.md)
register_template("babyai_history", (
    "{task}\n"
    "{history}\n"
    "{observation}"
))

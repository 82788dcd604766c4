"""Any Gymnasium environment as a :class:`~torchrl_agent.envs.base.TextGame`.

:class:`GymnasiumTextGame` wraps a Gymnasium env with two functions: ``render_observation(obs) ->
str`` (what the agent reads) and ``parse_action(text) -> action | None`` (what the env receives).
``TextEnv(lambda: GymnasiumTextGame(...))`` then gives a batched TorchRL env::

    game = lambda: GymnasiumTextGame(
        lambda: gymnasium.make("FrozenLake-v1"),
        render_observation=lambda obs: f"You are on cell {obs}.",
        parse_action={"left": 0, "down": 1, "right": 2, "up": 3}.get,
        admissible_actions=("left", "down", "right", "up"),
        task="Reach the goal without falling into a hole.",
    )
    env = TextEnv(game, num_groups=2, group_size=4, max_steps=20)

Conventions:

* **invalid actions**: when ``parse_action`` returns None (or raises), the Gymnasium env is *not*
  stepped: the game answers with the unchanged observation, the reward ``invalid_action_reward``
  (default 0.0), not terminated. The step still counts toward the :class:`TextEnv` ``max_steps``.
* **seeding**: ``reset(seed)`` calls ``env.reset(seed=seed)``; the whole episode derives from it.
* **success**: ``success_fn(reward, terminated, info)``, by default ``terminated and reward > 0``.
* **truncation**: a :class:`TextGame` has no truncation channel, so a Gymnasium ``truncated``
  ends the game as terminated (unsolved). Set the :class:`TextEnv` ``max_steps`` below the
  Gymnasium time limit (or lift that limit) to get TorchRL's ``truncated`` flag instead; the
  BabyAI env (:mod:`torchrl_agent.envs.games.babyai`) does so.
* **expert**: override :meth:`GymnasiumTextGame.expert_reset` / :meth:`expert_step`, or pass
  ``expert_fn(env, obs) -> str`` (called after every reset and env step).
* **task**: a string, or ``task(obs) -> str`` evaluated at reset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchrl_agent.envs.base import GameState, TextGame

__all__ = ["GymnasiumTextGame"]


class GymnasiumTextGame(TextGame):
    """One episode of a Gymnasium env, in text.

    Args:
        env_factory: returns a fresh ``gymnasium.Env`` (called once, in the constructor).
        render_observation: ``obs -> str``, the observation text.
        parse_action: ``str -> action | None``; None (or an exception) marks the text invalid.
        admissible_actions: the action texts to show (``()`` for free-form).
        task: the goal text, or ``obs -> str`` evaluated at reset.
        task_type: the label for per-type metrics.
        expert_fn: ``(env, obs) -> str``, the expert's next action text, or None for no expert.
        success_fn: ``(reward, terminated, info) -> bool``; default ``terminated and reward > 0``.
        invalid_action_reward: the reward of a step whose text does not parse.
    """

    def __init__(
        self,
        env_factory: Callable[[], Any],
        render_observation: Callable[[Any], str],
        parse_action: Callable[[str], Any],
        *,
        admissible_actions: tuple[str, ...] = (),
        task: str | Callable[[Any], str] = "",
        task_type: str = "",
        expert_fn: Callable[[Any, Any], str] | None = None,
        success_fn: Callable[[float, bool, dict], bool] | None = None,
        invalid_action_reward: float = 0.0,
    ):
        if not callable(render_observation) or not callable(parse_action):
            raise TypeError("render_observation and parse_action must be callables")
        self.env = env_factory()
        self.render_observation, self.parse_action = render_observation, parse_action
        self.admissible_actions, self.task, self.task_type = tuple(admissible_actions), task, task_type
        self.expert_fn, self.invalid_action_reward = expert_fn, float(invalid_action_reward)
        self.success_fn = success_fn or (lambda reward, terminated, info: bool(terminated and reward > 0))
        self.obs: Any = None
        self._task_text = task if isinstance(task, str) else ""
        self._expert = ""

    # -------------------------------------------------------------- expert hooks
    def expert_reset(self) -> str:
        """The expert's first action after a reset (``""`` when there is no expert)."""
        return self.expert_fn(self.env, self.obs) if self.expert_fn is not None else ""

    def expert_step(self, action: Any) -> str:
        """The expert's next action after the env took ``action``."""
        return self.expert_fn(self.env, self.obs) if self.expert_fn is not None else ""

    # -------------------------------------------------------------- TextGame
    def reset(self, seed: int) -> GameState:
        self.obs, _ = self.env.reset(seed=int(seed))
        self._task_text = self.task if isinstance(self.task, str) else str(self.task(self.obs))
        self._expert = self.expert_reset()
        return self._state()

    def step(self, action: str) -> tuple[GameState, float, bool, bool]:
        try:
            parsed = self.parse_action(action) if isinstance(action, str) else None
        except Exception:  # a parser that chokes on odd text: the text is invalid, not the program
            parsed = None
        if parsed is None:
            return self._state(), self.invalid_action_reward, False, False
        self.obs, reward, terminated, truncated, info = self.env.step(parsed)
        success = bool(self.success_fn(float(reward), bool(terminated), info))
        self._expert = "" if (terminated or truncated) else self.expert_step(parsed)
        return self._state(), float(reward), bool(terminated or truncated), success

    def _state(self) -> GameState:
        return GameState(
            observation=self.render_observation(self.obs),
            task=self._task_text,
            admissible_actions=self.admissible_actions,
            expert_action=self._expert,
            task_type=self.task_type,
        )

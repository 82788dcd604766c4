"""The small games: NumberLine, Sokoban, the Gym Cards (EZPoints, Points24, Blackjack) and BabyAI.

Each game is a :class:`~torchrl_agent.envs.base.TextGame` with a batched
:class:`~torchrl_agent.envs.base.TextEnv` around it, generated from a seed (no data files);
:class:`GymnasiumTextGame` turns any Gymnasium env into a text game (BabyAI goes through it).
"""

from torchrl_agent.envs.games.babyai import BabyAIEnv, BabyAIGame, render_babyai
from torchrl_agent.envs.games.gym_cards import (
    BlackjackEnv,
    BlackjackGame,
    EZPointsEnv,
    EZPointsGame,
    FormulaGame,
    Points24Env,
    Points24Game,
    evaluate_formula,
    solutions,
)
from torchrl_agent.envs.games.gymnasium_adapter import GymnasiumTextGame
from torchrl_agent.envs.games.numberline import NumberLineEnv, NumberLineGame
from torchrl_agent.envs.games.sokoban import SokobanEnv, SokobanGame, generate_room, render_room, solve

__all__ = ["BabyAIEnv", "BabyAIGame", "BlackjackEnv", "BlackjackGame", "EZPointsEnv", "EZPointsGame", "FormulaGame",
           "GymnasiumTextGame", "NumberLineEnv", "NumberLineGame", "Points24Env", "Points24Game", "SokobanEnv",
           "SokobanGame", "evaluate_formula", "generate_room", "render_babyai", "render_room", "solutions", "solve"]

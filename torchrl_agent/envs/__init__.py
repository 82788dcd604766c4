"""Text environments as TorchRL ``EnvBase`` s, created through one registry.

>>> from torchrl_agent.envs import make_env
>>> env = make_env("numberline", num_groups=2, group_size=4, seed=0)
>>> td = env.reset()   # batch [8]; games 0-3 share a start, and so do games 4-7
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torchrl_agent.envs.base import GameState, TextEnv, TextGame, stable_hash
from torchrl_agent.envs.games.numberline import NumberLineEnv, NumberLineGame

__all__ = ["ENV_REGISTRY", "GameState", "NumberLineEnv", "NumberLineGame", "TextEnv", "TextGame",
           "make_env", "register_env", "stable_hash"]

#: name -> a TextEnv subclass (or any callable taking TextEnv's keyword arguments), or its
#: ``"module:attribute"`` path, imported on first use so optional dependencies stay optional.
ENV_REGISTRY: dict[str, Callable[..., TextEnv] | str] = {
    "numberline": NumberLineEnv,
    "ezpoints": "torchrl_agent.envs.games.gym_cards:EZPointsEnv",
    "points24": "torchrl_agent.envs.games.gym_cards:Points24Env",
    "blackjack": "torchrl_agent.envs.games.gym_cards:BlackjackEnv",
    "sokoban": "torchrl_agent.envs.games.sokoban:SokobanEnv",
    "alfworld": "torchrl_agent.envs.alfworld:ALFWorldEnv",
    "search": "torchrl_agent.envs.search:SearchEnv",
    "babyai": "torchrl_agent.envs.games.babyai:BabyAIEnv",
    "webshop": "torchrl_agent.envs.webshop:WebShopEnv",
    "appworld": "torchrl_agent.envs.appworld:AppWorldEnv",
}


def register_env(name: str, constructor: Callable[..., TextEnv]) -> None:
    """Make ``constructor`` available to :func:`make_env` (and the Hydra configs) as ``name``."""
    ENV_REGISTRY[name] = constructor


def make_env(
    name: str, *, num_groups: int = 1, group_size: int = 1, seed: int = 0, num_workers: int = 0, **kwargs
) -> TextEnv:
    """Create the environment ``name`` with batch size ``[num_groups * group_size]``.

    Keyword arguments go to the environment (``max_steps``, ``split="eval"``, ...). With
    ``num_workers > 0`` the games step in that many processes
    (:class:`~torchrl_agent.envs.workers.ParallelTextEnv`, same keys plus ``worker_fault``).
    """
    if name not in ENV_REGISTRY:
        raise KeyError(f"unknown environment {name!r}; known: {sorted(ENV_REGISTRY)}")
    if num_workers:
        from torchrl_agent.envs.workers import ParallelTextEnv

        return ParallelTextEnv(name, num_workers=num_workers, num_groups=num_groups, group_size=group_size,
                               seed=seed, **kwargs)
    constructor = ENV_REGISTRY[name]
    if isinstance(constructor, str):
        module, attribute = constructor.split(":")
        constructor = ENV_REGISTRY[name] = getattr(importlib.import_module(module), attribute)
    return constructor(num_groups=num_groups, group_size=group_size, seed=seed, **kwargs)

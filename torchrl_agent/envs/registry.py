"""The environment registry: a name -> the ``TextEnv`` class (or its ``"module:attribute"`` path) that
:func:`torchrl_agent.envs.make_env` and the env worker processes build. An env's module also
registers its prompt templates and parsing rules
(:func:`~torchrl_agent.envs.transforms.templates.register_template`,
:func:`~torchrl_agent.envs.transforms.projection.register_format`): :func:`load_env_packages` imports it."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torchrl_agent.envs.base import TextEnv

__all__ = ["ENV_REGISTRY", "env_constructor", "load_env_packages", "register_env"]

#: name -> a TextEnv subclass (or any callable taking TextEnv's keyword arguments), or its
#: ``"module:attribute"`` path, imported on first use so optional dependencies stay optional.
ENV_REGISTRY: dict[str, Callable[..., TextEnv] | str] = {
    "numberline": "torchrl_agent.envs.games.numberline:NumberLineEnv",
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


def env_constructor(name: str) -> Callable[..., TextEnv]:
    """The constructor registered as ``name`` (a ``"module:attribute"`` path is imported on first use)."""
    if name not in ENV_REGISTRY:
        raise KeyError(f"unknown environment {name!r}; known: {sorted(ENV_REGISTRY)}")
    constructor = ENV_REGISTRY[name]
    if isinstance(constructor, str):
        module, attribute = constructor.split(":")
        constructor = ENV_REGISTRY[name] = getattr(importlib.import_module(module), attribute)
    return constructor


def load_env_packages(*names: str) -> None:
    """Import the modules of the registered environments ``names`` (every one when none is given), so
    that the prompt templates and parsing rules they register are there; unknown names are skipped."""
    for name in names or list(ENV_REGISTRY):
        if name in ENV_REGISTRY:
            env_constructor(name)

"""Text environments as TorchRL ``EnvBase`` s, created through one registry.

>>> from torchrl_agent.envs import make_env
>>> env = make_env("numberline", num_groups=2, group_size=4, seed=0)
>>> td = env.reset()   # batch [8]; games 0-3 share a start, and so do games 4-7
"""

from __future__ import annotations

from torchrl_agent.envs.base import GameState, TextEnv, TextGame, stable_hash
from torchrl_agent.envs.games.numberline import NumberLineEnv, NumberLineGame
from torchrl_agent.envs.registry import ENV_REGISTRY, env_constructor, register_env

__all__ = ["ENV_REGISTRY", "GameState", "NumberLineEnv", "NumberLineGame", "TextEnv", "TextGame",
           "make_env", "register_env", "stable_hash"]


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
    if num_workers:  # the env's module is imported in the workers only
        from torchrl_agent.envs.workers import ParallelTextEnv

        return ParallelTextEnv(name, num_workers=num_workers, num_groups=num_groups, group_size=group_size,
                               seed=seed, **kwargs)
    return env_constructor(name)(num_groups=num_groups, group_size=group_size, seed=seed, **kwargs)

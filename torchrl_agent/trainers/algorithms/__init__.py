"""Algorithms by name: the registry (:mod:`.registry`), one module per built-in algorithm, and the
hooks through which the trainer runs an algorithm's parts (:mod:`.hooks`).

Adding an algorithm is one module that calls :func:`register_algorithm` and one YAML under
``configs/algorithm/`` naming it (``docs/architecture.md`` has a worked example)."""

from torchrl_agent.trainers.algorithms import (  # noqa: F401
    gigpo,
    graphgpo,
    grpo,
    grpo_passk,
    hgpo,
    ppo,
    reinforce_pp,
    remax,
    rloo,
)
from torchrl_agent.trainers.algorithms.hooks import AlgorithmHooks, AlgorithmParts
from torchrl_agent.trainers.algorithms.registry import (
    ALGORITHM_REGISTRY,
    Algorithm,
    get_algorithm,
    register_algorithm,
)

__all__ = ["ALGORITHM_REGISTRY", "Algorithm", "AlgorithmHooks", "AlgorithmParts", "get_algorithm", "register_algorithm"]

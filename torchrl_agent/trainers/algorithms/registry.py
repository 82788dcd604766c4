"""The algorithm registry: ``algorithm.name`` -> :class:`Algorithm`, the one place that says what an
algorithm adds to the training loop.

An algorithm is one module that registers an :class:`Algorithm` (its advantage and its optional
parts) and one YAML under ``configs/algorithm/`` (its loss settings: clipping, aggregation, KL
term; and its options: dynamic sampling, KL in the reward). The trainer reads nothing else::

    register_algorithm(Algorithm("grpo", advantage=lambda cfg: GRPOAdvantage(
        invalid_penalty=cfg.algorithm.invalid_penalty, norm=cfg.algorithm.norm)))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchrl_agent.objectives import ClipPolicyLoss

__all__ = ["ALGORITHM_REGISTRY", "Algorithm", "clip_loss_kwargs", "get_algorithm", "register_algorithm"]


@dataclass(frozen=True)
class Algorithm:
    """What one ``algorithm.name`` adds to the training loop.

    Attributes:
        name: the ``algorithm.name`` value that selects it.
        advantage: ``cfg -> module``, the advantage estimator built from the run config: a
            TensorDict module taking the collected rows ``[N]`` and writing ``"advantage"``,
            ``[N, 1]`` per row or ``[N, T]`` per response token. ``None`` with a ``critic``:
            the advantage is GAE over the critic's values.
        loss: ``cfg -> loss module``, the policy loss; ``None``: :class:`~torchrl_agent.objectives.ClipPolicyLoss`
            with the ``algorithm`` section's settings (:func:`clip_loss_kwargs`), which covers
            PPO/GRPO/DAPO/GSPO clipping, the KL and entropy terms and the aggregations.
        critic: ``(cfg, parts) -> Critic`` (:class:`~torchrl_agent.trainers.critic.Critic`), a
            value model trained beside the policy (PPO); ``None``: no critic.
        baseline: ``(cfg, parts) -> baseline``, extra episodes collected with every batch whose
            returns the advantage uses (ReMax's greedy episode per group); the object has
            ``wrap(collector) -> collect``, ``state_dict()`` and ``load_state_dict(state)``.
            ``None``: no baseline episodes.
        check: ``cfg -> None``, raising :class:`~torchrl_agent.trainers.config.ConfigError` (the
            message starting with the key) on settings this algorithm cannot run with; called at
            start with the rest of the config's checks.
        summary: one line for the docs and for ``algorithm.name`` errors.
        group_relative: the advantage compares an episode with the other episodes of its group
            (GRPO, GiGPO, RLOO, ...): with ``env.group_size=1`` every advantage is 0 (nothing is
            learned), which the trainer warns about at start.
    """

    name: str
    advantage: Callable[[Any], Any] | None = None
    loss: Callable[[Any], Any] | None = None
    critic: Callable[[Any, Any], Any] | None = None
    baseline: Callable[[Any, Any], Any] | None = None
    check: Callable[[Any], None] | None = None
    summary: str = ""
    group_relative: bool = False

    def __post_init__(self) -> None:
        if (self.advantage is None) == (self.critic is None):
            raise ValueError(f"algorithm {self.name!r}: give an advantage, or a critic (GAE over its values), "
                             "exactly one")

    def build_loss(self, cfg):
        """The policy loss of this algorithm for the run config ``cfg``."""
        return self.loss(cfg) if self.loss is not None else ClipPolicyLoss(**clip_loss_kwargs(cfg))


def clip_loss_kwargs(cfg) -> dict:
    """The :class:`~torchrl_agent.objectives.ClipPolicyLoss` settings of the ``algorithm`` section
    (``loss_norm_length`` defaults to ``rollout.max_new_tokens``)."""
    a = cfg.algorithm
    return dict(eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip, aggregation=a.aggregation,
                kl_coef=a.kl_coef, entropy_coef=a.entropy_coef, ratio=a.ratio, max_log_ratio=a.max_log_ratio,
                kl_type=a.kl_type, norm_length=a.loss_norm_length or cfg.rollout.max_new_tokens)


#: every registered algorithm by ``algorithm.name``
ALGORITHM_REGISTRY: dict[str, Algorithm] = {}


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Adds ``algorithm`` under its name (replacing one of the same name) and returns it."""
    ALGORITHM_REGISTRY[algorithm.name] = algorithm
    return algorithm


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm ``name``; a ``ValueError`` naming ``algorithm.name`` and the valid names."""
    try:
        return ALGORITHM_REGISTRY[name]
    except KeyError:
        raise ValueError(f"algorithm.name: unknown algorithm {name!r}; valid: {', '.join(ALGORITHM_REGISTRY)}") \
            from None

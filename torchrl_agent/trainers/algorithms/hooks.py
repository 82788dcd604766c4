"""How the trainer runs an algorithm (:class:`~torchrl_agent.trainers.algorithms.registry.Algorithm`)
and the config's options, behind two hooks of the trainer.

- :meth:`AlgorithmHooks.collect`: one batch of rows; with ``algorithm.dynamic_sampling`` (DAPO,
  dynamic GiGPO) collections are repeated until ``env.num_groups`` informative groups are held or
  ``algorithm.max_sampling_tries`` (10) tries were made, the last try keeping everything, as the
  reference; with an algorithm's ``baseline`` (ReMax) every collection is followed by its
  baseline episodes;
- :meth:`AlgorithmHooks.prepare`: the KL-in-reward penalty (``algorithm.kl_in_reward``), then the
  algorithm's advantage, or with its ``critic`` (PPO) the critic's values, GAE and the critic update.

Every estimator, loss and option, with its reference counterpart: ``docs/algorithms.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from torchrl_agent.objectives import (
    AdaptiveKLController,
    DynamicSamplingAccumulator,
    FixedKLController,
    episode_scores,
    kl_in_reward,
)
from torchrl_agent.trainers.algorithms.registry import get_algorithm
from torchrl_agent.trainers.batching import fit_width, response_mask

__all__ = ["AlgorithmHooks", "AlgorithmParts", "build_kl_controller"]


@dataclass(frozen=True)
class AlgorithmParts:
    """What an algorithm's parts (its critic, its baseline episodes) are given of the run: no more.

    Attributes:
        tokenizer: the policy's tokenizer.
        device: the trainer's device.
        loss: the policy loss (PPO's critic trains with its value term).
        policy: the rollout engine.
        collector: the training collector.
    """

    tokenizer: Any
    device: torch.device
    loss: Any
    policy: Any
    collector: Any


def build_kl_controller(a) -> FixedKLController:
    """The KL-in-reward coefficient's controller of an ``algorithm`` config section."""
    if a.kl_ctrl == "adaptive":
        return AdaptiveKLController(a.kl_reward_coef, target=a.kl_target, horizon=a.kl_horizon)
    return FixedKLController(a.kl_reward_coef)


class AlgorithmHooks:
    """The per-algorithm parts of :class:`~torchrl_agent.trainers.Trainer` (every rank, on the same rows).

    Args:
        cfg: the run's :class:`~torchrl_agent.trainers.config.TrainConfig`.
        parts: the :class:`AlgorithmParts` the algorithm's critic and baseline are built from.
    """

    def __init__(self, cfg, parts: AlgorithmParts) -> None:
        a = cfg.algorithm
        self.cfg = cfg
        self.algorithm = get_algorithm(a.name)
        self.sampler = (DynamicSamplingAccumulator(cfg.env.num_groups, max_tries=a.max_sampling_tries, trim=False)
                        if a.dynamic_sampling else None)
        self.kl_ctrl = build_kl_controller(a) if a.kl_in_reward else None
        # the algorithm's optional parts (PPO's critic, ReMax's greedy baseline episodes)
        self.critic = self.algorithm.critic(cfg, parts) if self.algorithm.critic is not None else None
        self.baseline = self.algorithm.baseline(cfg, parts) if self.algorithm.baseline is not None else None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """What a resumed run needs: the critic (weights and optimizer), the KL controller's
        coefficient and the baseline episodes' place in their seed stream."""
        return {"critic": self.critic.state_dict() if self.critic is not None else None,
                "kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
                "baseline": self.baseline.state_dict() if self.baseline is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.critic is not None and state.get("critic"):
            self.critic.load_state_dict(state["critic"])
        if self.kl_ctrl is not None and state.get("kl_ctrl"):
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        baseline = state.get("baseline", state.get("remax"))  # "remax": checkpoints written before the registry
        if self.baseline is not None and baseline:
            self.baseline.load_state_dict(baseline)

    # ------------------------------------------------------------------ collection
    def collect(self, collector) -> tuple[TensorDictBase, dict[str, float]]:
        """One training batch of rows (see the module docstring) and its sampling metrics."""
        collect = collector.collect
        if self.baseline is not None:
            collect = self.baseline.wrap(collector)
        if self.sampler is None:
            return collect(), {}
        rows = self.sampler.fill(collect)
        groups = int(torch.unique(rows["group_id"].reshape(-1)).numel())
        return rows, {"sampling_tries": self.sampler.last_tries, "sampling_groups": groups}

    # ------------------------------------------------------------------ advantage
    def prepare(self, rows: TensorDictBase, advantage, iteration: int, keys) -> tuple[TensorDictBase, dict[str, float]]:
        """KL in the reward, values (PPO), the advantage (``advantage`` module, or GAE for PPO) and
        the critic update; writes ``rows["advantage"]`` and returns metrics. With ``kl_in_reward`` the
        rows hold their old and reference log-probs (``keys``: the loss's ``tensor_keys``, written by
        :meth:`Scorer.score <torchrl_agent.trainers.scoring.Scorer.score>`); ``iteration`` seeds the critic's mini-batches."""
        a = self.cfg.algorithm
        metrics: dict[str, float] = {}
        token_reward = None
        if self.kl_ctrl is not None:
            old, ref = rows.get(keys.old_log_prob), rows.get(keys.ref_log_prob)
            mask = response_mask(rows, old.shape[-1])
            token_reward, row_penalty, kl_metrics = kl_in_reward(old, ref, mask, self.kl_ctrl, a.kl_reward_type)
            metrics.update(kl_metrics)
            rows.set("kl_penalty", row_penalty.unsqueeze(-1).to(rows["reward"].dtype))
            rows.set("token_reward", token_reward)
        if self.critic is None:
            return advantage(rows), metrics
        values = self.critic.values(rows)
        scores = episode_scores(rows["reward"].reshape(-1), rows["traj_id"].reshape(-1),
                                rows.get("action_valid", None), invalid_penalty=a.invalid_penalty)
        gae = TensorDict({"old_state_value": values, "mask": response_mask(rows, values.shape[-1]),
                          "score": scores.float()}, batch_size=[values.shape[0]])
        if token_reward is not None:
            gae["token_reward"] = fit_width(token_reward, values.shape[-1])
        self.critic.loss.compute_advantage(gae)  # PPOLoss: GAE, whitened; the returns are the value targets
        rows.set("advantage", gae["advantage"])
        returns = gae["value_target"]
        generator = torch.Generator().manual_seed(self.cfg.seed * 7919 + 17 + iteration)
        metrics.update(self.critic.update(rows, values, returns, epochs=a.epochs, minibatch_size=a.minibatch_size,
                                          generator=generator))
        return rows, metrics

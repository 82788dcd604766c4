"""What each ``algorithm.name`` adds to the training loop, behind three small hooks of the trainer.

- :meth:`AlgorithmHooks.collect`: one batch of rows; with ``algorithm.dynamic_sampling`` (DAPO,
  dynamic GiGPO) collections are repeated until ``env.num_groups`` informative groups are held or
  ``algorithm.max_sampling_tries`` (10) tries were made, the last try keeping everything, as the
  reference; for ReMax every collection is followed by one greedy episode per group from the
  same initial states (the baseline);
- :meth:`AlgorithmHooks.prepare`: the KL-in-reward penalty (``algorithm.kl_in_reward``), the
  critic's values and GAE (PPO), the advantage, then the critic update (PPO).

Every estimator, loss and option, with its reference counterpart: ``docs/algorithms.md``.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch
from tensordict import TensorDictBase

from torchrl_agent.collectors import StepCollector
from torchrl_agent.envs.factory import build_env
from torchrl_agent.objectives import (
    KL_TYPES,
    AdaptiveKLController,
    DynamicSamplingAccumulator,
    FixedKLController,
    episode_scores,
    kl_in_reward,
    token_gae,
)
from torchrl_agent.trainers.batching import fit_width, pad_ragged, response_mask

__all__ = ["ALGORITHMS", "ESTIMATORS", "AlgorithmHooks", "check_algorithm"]

#: ``algorithm.name`` -> the advantage estimator it uses (DAPO and GSPO are GRPO's estimator with
#: another sampling / loss, as in the reference's recipes).
ESTIMATORS = {
    "grpo": "grpo", "gigpo": "gigpo", "dapo": "grpo", "gspo": "grpo", "ppo": "gae", "rloo": "rloo",
    "reinforce_pp": "reinforce_pp", "reinforce_pp_baseline": "reinforce_pp_baseline",
    "grpo_passk": "grpo_passk", "remax": "remax",
}
ALGORITHMS = tuple(ESTIMATORS)


def check_algorithm(cfg) -> None:
    """Fails at start, naming the key, on an algorithm setting that cannot run."""
    a = cfg.algorithm
    if a.name not in ESTIMATORS:
        raise ValueError(f"algorithm.name: unknown algorithm {a.name!r}; valid: {', '.join(ALGORITHMS)}")
    if a.kl_type not in KL_TYPES:
        raise ValueError(f"algorithm.kl_type: unknown KL estimator {a.kl_type!r}; valid: {', '.join(KL_TYPES)}")
    if a.kl_reward_type not in KL_TYPES:
        raise ValueError(f"algorithm.kl_reward_type: unknown KL estimator {a.kl_reward_type!r}; "
                         f"valid: {', '.join(KL_TYPES)}")
    if a.kl_ctrl not in ("fixed", "adaptive"):
        raise ValueError(f"algorithm.kl_ctrl: must be fixed or adaptive, got {a.kl_ctrl!r}")
    if a.kl_ctrl == "adaptive" and (a.kl_target <= 0 or a.kl_horizon <= 0):
        raise ValueError("algorithm.kl_target and algorithm.kl_horizon must be > 0 for kl_ctrl=adaptive")
    if a.max_sampling_tries < 1:
        raise ValueError(f"algorithm.max_sampling_tries must be >= 1, got {a.max_sampling_tries}")
    if a.similarity_threshold is not None and not 0.0 < a.similarity_threshold <= 1.0:
        raise ValueError(f"algorithm.similarity_threshold must be in (0, 1] or null, got {a.similarity_threshold}")
    if a.name == "grpo_passk" and cfg.env.group_size < 2:
        raise ValueError("env.group_size must be >= 2 for algorithm.name=grpo_passk")
    if a.name == "remax" and a.dynamic_sampling:
        raise ValueError("algorithm.dynamic_sampling is not supported with algorithm.name=remax")
    if a.kl_in_reward and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("algorithm.kl_in_reward is not supported under torchrun yet (the sharded reference "
                         "cannot run on rank 0 alone); use it in a single process or use algorithm.kl_coef")
    if a.critic_lr <= 0:
        raise ValueError(f"algorithm.critic_lr must be > 0, got {a.critic_lr}")


def build_kl_controller(a) -> FixedKLController:
    if a.kl_ctrl == "adaptive":
        return AdaptiveKLController(a.kl_reward_coef, target=a.kl_target, horizon=a.kl_horizon)
    return FixedKLController(a.kl_reward_coef)


class AlgorithmHooks:
    """The per-algorithm parts of :class:`~torchrl_agent.trainers.Trainer` (rank 0 only).

    Args:
        cfg: the run's :class:`~torchrl_agent.trainers.config.TrainConfig`.
        trainer: the trainer (its model, tokenizer, reference, policy and ``recompute``).
    """

    def __init__(self, cfg, trainer) -> None:
        a = cfg.algorithm
        self.cfg, self.trainer = cfg, trainer
        self.sampler = (DynamicSamplingAccumulator(cfg.env.num_groups, max_tries=a.max_sampling_tries, trim=False)
                        if a.dynamic_sampling else None)
        self.kl_ctrl = build_kl_controller(a) if a.kl_in_reward else None
        self.critic = None
        if a.name == "ppo":
            from torchrl_agent.models import model_path
            from torchrl_agent.trainers.critic import Critic, ValueModel

            # float32 weights (as the policy's master weights); the critic is small next to the policy
            value_model = ValueModel.from_pretrained(model_path(cfg.model), trainer.tokenizer.pad_token_id)
            self.critic = Critic(value_model.to(trainer.device), lr=a.critic_lr, weight_decay=a.weight_decay,
                                 value_clip=a.value_clip, grad_clip=a.grad_clip, aggregation=a.aggregation,
                                 norm_length=a.loss_norm_length or cfg.rollout.max_new_tokens)
        self.remax = _ReMaxBaseline(cfg, trainer) if a.name == "remax" else None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """What a resumed run needs: the critic (weights and optimizer), the KL controller's
        coefficient and the ReMax baseline collector's place in its stream."""
        return {"critic": self.critic.state_dict() if self.critic is not None else None,
                "kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
                "remax": self.remax.collector.state_dict() if self.remax is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.critic is not None and state.get("critic"):
            self.critic.load_state_dict(state["critic"])
        if self.kl_ctrl is not None and state.get("kl_ctrl"):
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.remax is not None and state.get("remax"):
            self.remax.collector.load_state_dict(state["remax"])

    # ------------------------------------------------------------------ collection
    def collect(self, collector) -> tuple[TensorDictBase, dict[str, float]]:
        """One training batch of rows (see the module docstring) and its sampling metrics."""
        collect = collector.collect
        if self.remax is not None:
            collect = self.remax.wrap(collector)
        if self.sampler is None:
            return collect(), {}
        rows = self.sampler.fill(collect)
        groups = int(torch.unique(rows["group_id"].reshape(-1)).numel())
        return rows, {"sampling_tries": self.sampler.last_tries, "sampling_groups": groups}

    # ------------------------------------------------------------------ advantage
    def prepare(self, rows: TensorDictBase, advantage) -> tuple[TensorDictBase, dict[str, float]]:
        """KL in the reward, values (PPO), the advantage (``advantage`` module, or GAE for PPO) and
        the critic update; writes ``rows["advantage"]`` and returns metrics."""
        a = self.cfg.algorithm
        metrics: dict[str, float] = {}
        token_reward = None
        if self.kl_ctrl is not None:
            old, ref = self._old_and_ref(rows)
            mask = response_mask(rows, old.shape[-1])
            token_reward, row_penalty, kl_metrics = kl_in_reward(old, ref, mask, self.kl_ctrl, a.kl_reward_type)
            metrics.update(kl_metrics)
            rows.set("kl_penalty", row_penalty.unsqueeze(-1).to(rows["reward"].dtype))
            rows.set("token_reward", token_reward)
        if self.critic is None:
            return advantage(rows), metrics
        values = self.critic.values(rows)
        mask = response_mask(rows, values.shape[-1])
        scores = episode_scores(rows["reward"].reshape(-1), rows["traj_id"].reshape(-1),
                                rows.get("action_valid", None), invalid_penalty=a.invalid_penalty)
        if token_reward is not None:
            token_reward = fit_width(token_reward, values.shape[-1])
        adv, returns = token_gae(values, mask, scores.float(), gamma=a.gamma, lmbda=a.lmbda, token_rewards=token_reward)
        rows.set("advantage", adv)
        generator = torch.Generator().manual_seed(self.cfg.seed * 7919 + 17 + self.trainer.iteration)
        metrics.update(self.critic.update(rows, values, returns, epochs=a.epochs, minibatch_size=a.minibatch_size,
                                          generator=generator))
        return rows, metrics

    def _old_and_ref(self, rows: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded ``[N, T]`` log-probs of the sampled responses under the current and the reference
        policy (the frozen copy, or the base model with the LoRA adapters disabled)."""
        t = self.trainer
        old = t.recompute(t.model, rows)
        if t.reference is not None:
            ref = t.recompute(t.reference, rows)
        else:  # LoRA: the reference is the base model
            with t.model.disable_adapter():
                ref = t.recompute(t.model, rows)
        width = max(1, max((len(x) for x in old), default=1))
        return pad_ragged(old, width, "cpu"), pad_ragged(ref, width, "cpu")


class _ReMaxBaseline:
    """ReMax's baseline: one greedy episode per group from the same initial state.

    A second environment (``group_size`` 1, the greedy policy) is given the training
    environment's seed-generator state before each training collection, so that it draws the
    same group seeds; they are checked equal after both collections."""

    def __init__(self, cfg, trainer) -> None:
        greedy = copy.copy(trainer.policy)
        greedy.temperature = 0.0
        one = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, group_size=1))
        self.env = build_env(one, trainer.tokenizer, policy=greedy)
        self.collector = StepCollector(self.env, greedy, seed=cfg.seed, lockstep=cfg.rollout.lockstep)

    def wrap(self, collector):
        def collect() -> TensorDictBase:
            train_base = getattr(collector.env, "base_env", collector.env)
            own_base = getattr(self.env, "base_env", self.env)
            own_base._rng = copy.deepcopy(train_base._rng)  # the same group seeds as the training batch
            rows = collector.collect()
            baseline = self.collector.collect()
            if own_base.group_seeds != train_base.group_seeds:
                raise RuntimeError("ReMax baseline episodes did not start from the training batch's states")
            g = self.collector.num_groups  # group ids are batch * num_groups + the group's index in the batch
            per_group = torch.zeros(g, dtype=torch.float64).index_add_(
                0, baseline["group_id"].reshape(-1) % g, baseline["reward"].reshape(-1).double())
            local = rows["group_id"].reshape(-1) % g
            rows.set("reward_baseline", per_group[local].unsqueeze(-1).to(rows["reward"].dtype))
            return rows

        return collect

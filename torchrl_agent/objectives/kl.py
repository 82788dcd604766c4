"""KL to the reference policy placed in the reward (the reference's ``use_kl_in_reward``).

Per token ``kl_t = kl_estimate(logp_old_t, logp_ref_t, kl_type)``; the token reward becomes
``r_t - beta * kl_t`` (the row's score still sits at its last token). Outcome estimators see the
row's score ``S_row - beta * sum_t kl_t``; token estimators (GAE, REINFORCE++) see the per-token
rewards. ``beta`` comes from a controller updated once per batch with the batch's KL (the mean
over rows of each row's token-mean KL):

- :class:`FixedKLController`: ``beta`` constant;
- :class:`AdaptiveKLController` (Ziegler et al. 2019): ``beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon``
  with ``n`` the number of rows of the batch.

Formulas and the mapping to the reference's options: ``docs/algorithms.md``.
"""

from __future__ import annotations

import torch

from torchrl_agent.objectives.clip_loss import kl_estimate

__all__ = ["FixedKLController", "AdaptiveKLController", "kl_in_reward"]


class FixedKLController:
    """A constant coefficient ``value``."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"`kl_coef` must be >= 0, got {kl_coef}.")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """``value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""

    def __init__(self, kl_coef: float, target: float, horizon: int) -> None:
        super().__init__(kl_coef)
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target} and {horizon}.")
        self.target, self.horizon = float(target), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def kl_in_reward(
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    mask: torch.Tensor,
    controller: FixedKLController,
    kl_type: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The KL penalty of a batch, then one controller update.

    Args: ``old_log_prob``, ``ref_log_prob`` [N, T] (padded), ``mask`` [N, T] bool.
    Returns ``(token_reward [N, T] = -beta * kl_t (0 off the mask), row_penalty [N] = beta * sum_t kl_t,
    metrics)`` with ``beta`` the coefficient *before* the update, as the reference.
    """
    mask = mask.bool()
    kl = torch.where(mask, kl_estimate(old_log_prob, ref_log_prob, kl_type), 0.0)
    beta = controller.value
    count = mask.sum(-1)
    has = count > 0
    current = float((kl.sum(-1)[has] / count[has]).mean()) if bool(has.any()) else 0.0
    controller.update(current_kl=current, n_steps=int(mask.shape[0]))
    return -beta * kl, beta * kl.sum(-1), {"reward_kl": current, "reward_kl_coef": beta}

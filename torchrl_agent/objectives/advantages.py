"""TensorDict advantage modules (GiGPO, GRPO, RLOO, REINFORCE++) over :mod:`.functional`.

Each module reads a TensorDict of **rows** (batch ``[N]``, one row per environment step, all
rows of finished groups) and writes ``advantage`` ``[N, 1]`` (same dtype as ``reward``).
Default keys (data contract, ``DESIGN.md``), all overridable with :meth:`set_keys`:

============== ============= ===========================================================
key            shape/dtype   meaning
============== ============= ===========================================================
``reward``     [N,1] float   env reward of the step
``group_id``   [N] int64     episode group (same initial state)
``traj_id``    [N] int64     trajectory
``step_count`` [N,1] int64   step index of the row (0 for the first step) -- GiGPO only
``anchor``     [N] int64     anchor-state hash -- GiGPO only
``action_valid`` [N,1] bool  response followed the format (missing: all valid)
``advantage``  [N,1] float   written
============== ============= ===========================================================

``[N]`` and ``[N, 1]`` are both accepted for every input.

They are TorchRL :class:`~torchrl.envs.transforms.Transform` s, usable two ways:

- called on a TensorDict of rows: ``rows = GiGPOAdvantage()(rows)``;
- as a replay-buffer transform: ``ReplayBuffer(..., transform=GiGPOAdvantage(write_only=True))``;
  the advantage is then computed when whole groups are written (``extend`` calls ``inv``),
  and sampling returns the stored advantages untouched. (Without ``write_only``, sampling would
  recompute group statistics on a random mini-batch, which is wrong.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import NestedKey, TensorDictBase
from torchrl.envs.transforms import Transform

from torchrl_agent.objectives import functional as F
from torchrl_agent.objectives._keys import KeysMixin

__all__ = ["GiGPOAdvantage", "GRPOAdvantage", "RLOOAdvantage", "ReinforcePlusPlusAdvantage"]


class _RowAdvantage(KeysMixin, Transform):
    """Base class: key handling (``_AcceptedKeys`` + ``set_keys``), shape checks, write."""

    @dataclass
    class _AcceptedKeys:
        """Configurable tensordict keys (see the module docstring for shapes).

        Attributes:
            reward, group_id, traj_id, step_count, anchor, action_valid: input keys.
            advantage: output key.
        """

        reward: NestedKey = "reward"
        group_id: NestedKey = "group_id"
        traj_id: NestedKey = "traj_id"
        step_count: NestedKey = "step_count"
        anchor: NestedKey = "anchor"
        action_valid: NestedKey = "action_valid"
        advantage: NestedKey = "advantage"

    default_keys = _AcceptedKeys
    _needs_steps: bool = False

    def __init__(self, *, invalid_penalty: float = 0.1, write_only: bool = False) -> None:
        super().__init__(in_keys=[], out_keys=[])
        if invalid_penalty < 0:
            raise ValueError(f"`invalid_penalty` must be >= 0, got {invalid_penalty}.")
        self.invalid_penalty = float(invalid_penalty)
        self.write_only = bool(write_only)
        self._tensor_keys = self._AcceptedKeys()

    def _get(self, td: TensorDictBase, name: str, required: bool = True) -> torch.Tensor | None:
        key = getattr(self.tensor_keys, name)
        value = td.get(key, None)
        if value is None and required:
            raise KeyError(f"{type(self).__name__}: key {key!r} (`{name}`) not found in the tensordict.")
        return value

    def _compute(self, reward, group_id, traj_id, valid, step, anchor) -> torch.Tensor:
        raise NotImplementedError

    def compute(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Writes ``advantage`` [N, 1] into ``tensordict`` (batch [N]) in place and returns it."""
        if tensordict.ndim != 1:
            raise ValueError(
                f"{type(self).__name__} expects a tensordict of rows with one batch dim [N], "
                f"got batch_size {tuple(tensordict.batch_size)}."
            )
        reward = self._get(tensordict, "reward")
        step = self._get(tensordict, "step_count") if self._needs_steps else None
        anchor = self._get(tensordict, "anchor") if self._needs_steps else None
        adv = self._compute(
            reward,
            self._get(tensordict, "group_id"),
            self._get(tensordict, "traj_id"),
            self._get(tensordict, "action_valid", required=False),
            step,
            anchor,
        )
        tensordict.set(self.tensor_keys.advantage, adv.unsqueeze(-1))
        return tensordict

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self.write_only:
            return tensordict
        return self.compute(tensordict)

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        # replay-buffer ``extend``: whole groups are written, compute their advantages
        return self.compute(tensordict)

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return next_tensordict

    def __repr__(self) -> str:
        return f"{type(self).__name__}(keys={self.tensor_keys})"


class GRPOAdvantage(_RowAdvantage):
    """GRPO advantage: ``norm(S_row, rows of the group)``, see :func:`~.functional.grpo_advantage`.

    Keyword Args:
        invalid_penalty (float): ``c`` subtracted from an invalid row's score. Defaults to 0.1.
        norm (str): ``"mean_std"`` (default) or ``"mean"``.
        eps (float): added to the std. Defaults to 1e-6.
        write_only (bool): replay-buffer mode, see the module docstring.
    """

    def __init__(self, *, invalid_penalty: float = 0.1, norm: F.Norm = "mean_std", eps: float = 1e-6,
                 write_only: bool = False) -> None:
        super().__init__(invalid_penalty=invalid_penalty, write_only=write_only)
        F._check_norm(norm)
        self.norm, self.eps = norm, eps

    def _compute(self, reward, group_id, traj_id, valid, step, anchor):
        return F.grpo_advantage(reward, group_id, traj_id, valid, invalid_penalty=self.invalid_penalty,
                                norm=self.norm, eps=self.eps)


class GiGPOAdvantage(GRPOAdvantage):
    """GiGPO advantage ``A_E + omega * A_S``, see :func:`~.functional.gigpo_advantage`.

    Also reads ``step_count`` [N,1] int64 (step index, 0 first; only the order inside a
    trajectory matters) and ``anchor`` [N] int64 (equal anchor = same state; for text anchors
    use :func:`~.functional.similarity_anchor_ids`).

    Keyword Args:
        gamma (float): step-return discount. Defaults to 0.95.
        omega (float): weight of the step term. Defaults to 1.0.
        invalid_penalty, norm, eps, write_only: as :class:`GRPOAdvantage`.
    """

    _needs_steps = True

    def __init__(self, *, gamma: float = 0.95, omega: float = 1.0, invalid_penalty: float = 0.1,
                 norm: F.Norm = "mean_std", eps: float = 1e-6, write_only: bool = False) -> None:
        super().__init__(invalid_penalty=invalid_penalty, norm=norm, eps=eps, write_only=write_only)
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"`gamma` must be in [0, 1], got {gamma}.")
        self.gamma, self.omega = float(gamma), float(omega)

    def _compute(self, reward, group_id, traj_id, valid, step, anchor):
        return F.gigpo_advantage(reward, group_id, traj_id, step, anchor, valid, gamma=self.gamma,
                                 omega=self.omega, invalid_penalty=self.invalid_penalty, norm=self.norm,
                                 eps=self.eps)


class RLOOAdvantage(_RowAdvantage):
    """RLOO advantage ``(S_row - mean_group) * n / (n - 1)``, see :func:`~.functional.rloo_advantage`."""

    def _compute(self, reward, group_id, traj_id, valid, step, anchor):
        return F.rloo_advantage(reward, group_id, traj_id, valid, invalid_penalty=self.invalid_penalty)


class ReinforcePlusPlusAdvantage(_RowAdvantage):
    """REINFORCE++ (baseline): ``S_row - mean_group`` whitened over the batch, see
    :func:`~.functional.reinforce_pp_advantage`."""

    def __init__(self, *, invalid_penalty: float = 0.1, eps: float = 1e-6, write_only: bool = False) -> None:
        super().__init__(invalid_penalty=invalid_penalty, write_only=write_only)
        self.eps = eps

    def _compute(self, reward, group_id, traj_id, valid, step, anchor):
        return F.reinforce_pp_advantage(reward, group_id, traj_id, valid, invalid_penalty=self.invalid_penalty,
                                        eps=self.eps)

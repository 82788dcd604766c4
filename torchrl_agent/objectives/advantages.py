"""TensorDict advantage modules over :mod:`.functional` (formulas: ``docs/algorithms.md``).

Each module reads a TensorDict of **rows** (batch ``[N]``, one row per environment step, all
rows of finished groups) and writes ``advantage`` ``[N, 1]`` (same dtype as ``reward``; the
token-level :class:`ReinforcePlusPlusAdvantage` writes ``[N, T]``).
Default keys (the data contract of the README), all overridable with :meth:`set_keys`:

============== ============= ===========================================================
key            shape/dtype   meaning
============== ============= ===========================================================
``reward``     [N,1] float   env reward of the step
``group_id``   [N] int64     episode group (same initial state)
``traj_id``    [N] int64     trajectory
``step_count`` [N,1] int64   step index of the row (0 for the first step) -- GiGPO, HGPO, GraphGPO
``anchor``     [N] int64     anchor-state hash -- GiGPO, HGPO, GraphGPO
``next_anchor`` [N] int64    optional: the anchor of the state the step led to -- GraphGPO only
``action_valid`` [N,1] bool  response followed the format (missing: all valid)
``kl_penalty`` [N,1] float   optional: subtracted from the row's score (KL in the reward)
``observation`` [N] str      anchor text -- GiGPO / GraphGPO with ``similarity_threshold`` only
``next_observation`` [N] str optional: text of the next state -- GraphGPO with ``similarity_threshold``
``response_tokens`` [N,1]    response length -- REINFORCE++ (token whitening / discounting)
``token_reward`` [N,T] float optional per-token reward (KL in the reward) -- REINFORCE++ only
``reward_baseline`` [N,1]    greedy episode reward of the row's group -- ReMax only
``advantage``  [N,1] float   written
============== ============= ===========================================================

``[N]``, ``[N, 1]`` and TorchRL's ``[N, 1, 1]`` are accepted for every per-row input (e.g.
``set_keys(reward=("next", "reward"))`` on collector data); a tensordict with several batch
dims (e.g. ``[B, T]``) is read as its ``B * T`` rows and ``advantage`` is written back as
``[B, T, 1]`` (see :mod:`._inputs`).

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
from torchrl_agent.objectives._inputs import as_rows
from torchrl_agent.objectives._keys import KeysMixin

__all__ = ["GiGPOAdvantage", "GraphGPOAdvantage", "GRPOAdvantage", "HGPOAdvantage", "GRPOPassKAdvantage", "RLOOAdvantage", "ReinforcePlusPlusAdvantage",
           "ReinforcePlusPlusBaselineAdvantage", "ReMaxAdvantage"]


class _RowAdvantage(KeysMixin, Transform):
    """Base class: key handling (``_AcceptedKeys`` + ``set_keys``), shape checks, write."""

    @dataclass
    class _AcceptedKeys:
        """Configurable tensordict keys (see the module docstring for shapes).

        Attributes:
            reward, group_id, traj_id, step_count, anchor, next_anchor, action_valid, kl_penalty,
            anchor_text, next_anchor_text, response_tokens, token_reward, reward_baseline: input keys.
            advantage: output key.
        """

        reward: NestedKey = "reward"
        group_id: NestedKey = "group_id"
        traj_id: NestedKey = "traj_id"
        step_count: NestedKey = "step_count"
        anchor: NestedKey = "anchor"
        next_anchor: NestedKey = "next_anchor"
        action_valid: NestedKey = "action_valid"
        kl_penalty: NestedKey = "kl_penalty"
        anchor_text: NestedKey = "observation"
        next_anchor_text: NestedKey = "next_observation"
        response_tokens: NestedKey = "response_tokens"
        token_reward: NestedKey = "token_reward"
        reward_baseline: NestedKey = "reward_baseline"
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
        self._td = None  # the rows being computed (optional keys are read from it)

    def _get(self, td: TensorDictBase, name: str, required: bool = True) -> torch.Tensor | None:
        key = getattr(self.tensor_keys, name)
        value = td.get(key, None)
        if value is None and required:
            raise KeyError(f"{type(self).__name__}: key {key!r} (`{name}`) not found in the tensordict.")
        return as_rows(value, td.numel()) if isinstance(value, torch.Tensor) else value

    def _compute(self, reward, group_id, traj_id, valid, step, anchor) -> torch.Tensor:
        raise NotImplementedError

    def _penalty(self) -> torch.Tensor | None:
        """The optional ``kl_penalty`` of the rows being computed (set by :meth:`compute`)."""
        return self._get(self._td, "kl_penalty", required=False)

    def compute(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Writes ``advantage`` [N, 1] into ``tensordict`` (batch [N]) in place and returns it.
        A batch of several dims ``[B, T]`` is read as ``B * T`` rows (written as ``[B, T, 1]``)."""
        if tensordict.ndim == 0:
            raise ValueError(
                f"{type(self).__name__} expects a tensordict of rows (batch [N] or [B, T]), "
                f"got batch_size {tuple(tensordict.batch_size)}."
            )
        if tensordict.ndim > 1:
            adv = self.compute(tensordict.reshape(-1)).get(self.tensor_keys.advantage)
            tensordict.set(self.tensor_keys.advantage, adv.reshape(*tensordict.batch_size, *adv.shape[1:]))
            return tensordict
        reward = self._get(tensordict, "reward")
        step = self._get(tensordict, "step_count") if self._needs_steps else None
        anchor = self._get(tensordict, "anchor") if self._needs_steps else None
        self._td = tensordict
        adv = self._compute(
            reward,
            self._get(tensordict, "group_id"),
            self._get(tensordict, "traj_id"),
            self._get(tensordict, "action_valid", required=False),
            step,
            anchor,
        )
        self._td = None
        tensordict.set(self.tensor_keys.advantage, adv.unsqueeze(-1) if adv.ndim == 1 else adv)
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
                                norm=self.norm, eps=self.eps, score_penalty=self._penalty())


class GiGPOAdvantage(GRPOAdvantage):
    """GiGPO advantage ``A_E + omega * A_S``, see :func:`~.functional.gigpo_advantage`.

    Also reads ``step_count`` [N,1] int64 (step index, 0 first; only the order inside a
    trajectory matters) and ``anchor`` [N] int64 (equal anchor = same state). With
    ``similarity_threshold`` set, anchors are instead the clusters of
    :func:`~.functional.similarity_anchor_ids` over the ``anchor_text`` strings (default key
    ``observation``), the reference's ``enable_similarity`` (used for Search, threshold 0.9).

    Keyword Args:
        gamma (float): step-return discount. Defaults to 0.95.
        omega (float): weight of the step term. Defaults to 1.0.
        similarity_threshold (float, optional): in (0, 1]; ``None`` (default): exact anchors.
        invalid_penalty, norm, eps, write_only: as :class:`GRPOAdvantage`.
    """

    _needs_steps = True

    def __init__(self, *, gamma: float = 0.95, omega: float = 1.0, invalid_penalty: float = 0.1,
                 norm: F.Norm = "mean_std", eps: float = 1e-6, similarity_threshold: float | None = None,
                 write_only: bool = False) -> None:
        super().__init__(invalid_penalty=invalid_penalty, norm=norm, eps=eps, write_only=write_only)
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"`gamma` must be in [0, 1], got {gamma}.")
        if similarity_threshold is not None and not 0.0 < similarity_threshold <= 1.0:
            raise ValueError(f"`similarity_threshold` must be in (0, 1] or None, got {similarity_threshold}.")
        self.gamma, self.omega = float(gamma), float(omega)
        self.similarity_threshold = similarity_threshold

    def _compute(self, reward, group_id, traj_id, valid, step, anchor):
        if self.similarity_threshold is not None:
            texts = self._get(self._td, "anchor_text")
            texts = texts.tolist() if hasattr(texts, "tolist") else list(texts)
            anchor = F.similarity_anchor_ids([str(t) for t in texts], group_id,
                                             threshold=self.similarity_threshold).to(group_id.device)
        return F.gigpo_advantage(reward, group_id, traj_id, step, anchor, valid, gamma=self.gamma,
                                 omega=self.omega, invalid_penalty=self.invalid_penalty, norm=self.norm,
                                 eps=self.eps, score_penalty=self._penalty())


def _texts(value) -> list[str]:
    """A non-tensor entry of strings as a list of str."""
    value = value.tolist() if hasattr(value, "tolist") else list(value)
    return [str(t) for t in value]


class HGPOAdvantage(GRPOAdvantage):
    """HGPO advantage: the step return normalised in history-context groups, see
    :func:`~.functional.hgpo_advantage`.

    Reads ``step_count`` and ``anchor`` as :class:`GiGPOAdvantage`. A row's history is the
    ``anchor`` s of the earlier rows of its trajectory (ordered by ``step_count``): the rows carry
    nothing more.

    Keyword Args:
        history_length (int): ``K``, the context groups have lengths ``1 .. K + 1``. Defaults to 2
            (the reference sets it to the memory's history length).
        gamma (float): step-return discount. Defaults to 0.95.
        alpha (float): length-weight exponent, ``w_k = (k + 1) ** alpha``. Defaults to 1.0.
        base_group (bool): add GRPO's episode term as an item of weight 1. Defaults to False.
        invalid_penalty, norm, eps, write_only: as :class:`GRPOAdvantage` (``norm``: ``"mean_std"``
            uses the population std here, as the reference).
    """

    _needs_steps = True

    def __init__(self, *, history_length: int = 2, gamma: float = 0.95, alpha: float = 1.0, base_group: bool = False,
                 invalid_penalty: float = 0.1, norm: F.Norm = "mean_std", eps: float = 1e-6,
                 write_only: bool = False) -> None:
        super().__init__(invalid_penalty=invalid_penalty, norm=norm, eps=eps, write_only=write_only)
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"`gamma` must be in [0, 1], got {gamma}.")
        if int(history_length) != history_length or history_length < 0:
            raise ValueError(f"`history_length` must be an int >= 0, got {history_length}.")
        self.history_length, self.gamma = int(history_length), float(gamma)
        self.alpha, self.base_group = float(alpha), bool(base_group)

    def _compute(self, reward, group_id, traj_id, valid, step, anchor):
        return F.hgpo_advantage(reward, group_id, traj_id, step, anchor, valid, history_length=self.history_length,
                                gamma=self.gamma, alpha=self.alpha, base_group=self.base_group,
                                invalid_penalty=self.invalid_penalty, norm=self.norm, eps=self.eps,
                                score_penalty=self._penalty())


class GraphGPOAdvantage(GRPOAdvantage):
    """GraphGPO advantage ``w_E * A_E + w_S * A_S`` over a state graph per group, see
    :func:`~.functional.graphgpo_advantage`.

    Reads ``step_count`` and ``anchor`` as :class:`GiGPOAdvantage`, and ``next_anchor`` [N] int64
    when the rows carry it (the anchor of the observation the step returned; the step collector
    writes it). Without it, a row's next state is the next row's anchor and the last row of a
    failed trajectory leads to a dead end, which differs from the reference only when that final
    observation is also some row's anchor in the group. With ``similarity_threshold`` set, the
    graph's states are clustered over the ``anchor_text`` strings (default key ``observation``;
    the final state of a failed trajectory by its ``next_anchor_text``, key ``next_observation``, if
    present), :func:`~.functional.graph_state_ids`; the step groups stay exact.

    Keyword Args:
        gamma (float): discount of the hop distance. Defaults to 0.95 (the reference's scripts: 0.1
            ALFWorld, 0.2 WebShop, 0.8 Sokoban).
        step_weight (float): ``w_S``. Defaults to 1.0.
        episode_weight (float): ``w_E``. Defaults to 1.0.
        normalize_distance (bool): ``10 * gamma ** (d(next) - d(anchor) + 1)`` instead of
            ``10 * gamma ** d(next)``. Defaults to False.
        similarity_threshold (float, optional): in (0, 1]; ``None`` (default): exact states (the
            reference's ``enable_similarity`` with ``similarity_thresh`` 0.95).
        invalid_penalty, norm, eps, write_only: as :class:`GRPOAdvantage`.
    """

    _needs_steps = True

    def __init__(self, *, gamma: float = 0.95, step_weight: float = 1.0, episode_weight: float = 1.0,
                 normalize_distance: bool = False, similarity_threshold: float | None = None,
                 invalid_penalty: float = 0.1, norm: F.Norm = "mean_std", eps: float = 1e-6,
                 write_only: bool = False) -> None:
        super().__init__(invalid_penalty=invalid_penalty, norm=norm, eps=eps, write_only=write_only)
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"`gamma` must be in (0, 1], got {gamma}.")
        if similarity_threshold is not None and not 0.0 < similarity_threshold <= 1.0:
            raise ValueError(f"`similarity_threshold` must be in (0, 1] or None, got {similarity_threshold}.")
        self.gamma, self.step_weight, self.episode_weight = float(gamma), float(step_weight), float(episode_weight)
        self.normalize_distance = bool(normalize_distance)
        self.similarity_threshold = similarity_threshold

    def _compute(self, reward, group_id, traj_id, valid, step, anchor):
        next_anchor = self._get(self._td, "next_anchor", required=False)
        node = None
        if self.similarity_threshold is not None:
            next_texts = self._td.get(self.tensor_keys.next_anchor_text, None)
            node = F.graph_state_ids(_texts(self._get(self._td, "anchor_text")), group_id, traj_id, step, anchor,
                                     reward, next_anchor, None if next_texts is None else _texts(next_texts),
                                     threshold=self.similarity_threshold)
        return F.graphgpo_advantage(reward, group_id, traj_id, step, anchor, valid, next_anchor=next_anchor, node=node,
                                    gamma=self.gamma, step_weight=self.step_weight,
                                    episode_weight=self.episode_weight, normalize_distance=self.normalize_distance,
                                    invalid_penalty=self.invalid_penalty, norm=self.norm, eps=self.eps,
                                    score_penalty=self._penalty())


class RLOOAdvantage(_RowAdvantage):
    """RLOO advantage ``(S_row - mean_group) * n / (n - 1)``, see :func:`~.functional.rloo_advantage`."""

    def _compute(self, reward, group_id, traj_id, valid, step, anchor):
        return F.rloo_advantage(reward, group_id, traj_id, valid, invalid_penalty=self.invalid_penalty,
                                score_penalty=self._penalty())


class GRPOPassKAdvantage(GRPOAdvantage):
    """GRPO pass@k: only the best row of a group gets ``(S_max - S_2nd) / (std + eps)``, see
    :func:`~.functional.grpo_passk_advantage`. Keyword arguments as :class:`GRPOAdvantage`."""

    def _compute(self, reward, group_id, traj_id, valid, step, anchor):
        return F.grpo_passk_advantage(reward, group_id, traj_id, valid, invalid_penalty=self.invalid_penalty,
                                      norm=self.norm, eps=self.eps, score_penalty=self._penalty())


class ReinforcePlusPlusBaselineAdvantage(_RowAdvantage):
    """REINFORCE++-baseline: ``S_row - mean_group`` whitened over the batch's **tokens** (each row
    weighs its ``response_tokens``), see :func:`~.functional.reinforce_pp_baseline_advantage`.
    Without a ``response_tokens`` key, rows weigh 1.

    Keyword Args:
        invalid_penalty (float): as :class:`GRPOAdvantage`.
        eps (float): added to the variance. Defaults to 1e-8.
    """

    def __init__(self, *, invalid_penalty: float = 0.1, eps: float = 1e-8, write_only: bool = False) -> None:
        super().__init__(invalid_penalty=invalid_penalty, write_only=write_only)
        self.eps = eps

    def _compute(self, reward, group_id, traj_id, valid, step, anchor):
        return F.reinforce_pp_baseline_advantage(reward, group_id, traj_id, valid,
                                                 self._get(self._td, "response_tokens", required=False),
                                                 invalid_penalty=self.invalid_penalty, eps=self.eps,
                                                 score_penalty=self._penalty())


class ReinforcePlusPlusAdvantage(_RowAdvantage):
    """REINFORCE++ (token-discounted, the reference's ``reinforce_plus_plus``): writes a per-token
    ``advantage`` [N, T] (``T`` the longest response), see :func:`~.ppo.token_reinforce_pp`.

    The row's score ``S_row`` sits at its last response token (``response_tokens`` [N,1] gives the
    length); returns are discounted over tokens with ``gamma`` and whitened over all tokens of
    the batch. An optional ``token_reward`` [N, T] (KL in the reward) is added at every token.

    Keyword Args:
        gamma (float): the token discount. Defaults to 1.0 (the reference's ``algorithm.gamma``).
        invalid_penalty (float): as :class:`GRPOAdvantage`.
    """

    def __init__(self, *, gamma: float = 1.0, invalid_penalty: float = 0.1, eps: float = 1e-8,
                 write_only: bool = False) -> None:
        super().__init__(invalid_penalty=invalid_penalty, write_only=write_only)
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"`gamma` must be in [0, 1], got {gamma}.")
        self.gamma, self.eps = float(gamma), eps

    def _compute(self, reward, group_id, traj_id, valid, step, anchor):
        from torchrl_agent.objectives.ppo import token_reinforce_pp

        scores = F.episode_scores(reward, traj_id, valid, invalid_penalty=self.invalid_penalty)
        lengths = F._as_1d("response_tokens", self._get(self._td, "response_tokens")).long()
        token_reward = self._get(self._td, "token_reward", required=False)
        width = token_reward.shape[-1] if token_reward is not None else max(1, int(lengths.max()) if len(lengths) else 1)
        mask = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
        if token_reward is None and self._penalty() is not None:
            scores = scores - F._as_1d("kl_penalty", self._penalty()).to(scores.dtype)
        adv, _ = token_reinforce_pp(scores, mask, gamma=self.gamma, token_rewards=token_reward, eps=self.eps)
        return adv


class ReMaxAdvantage(_RowAdvantage):
    """ReMax: ``S_row - reward_baseline`` (the greedy episode reward from the row's initial
    state), see :func:`~.functional.remax_advantage`."""

    def _compute(self, reward, group_id, traj_id, valid, step, anchor):
        return F.remax_advantage(reward, traj_id, self._get(self._td, "reward_baseline"), valid,
                                 invalid_penalty=self.invalid_penalty, score_penalty=self._penalty())

"""PPO's critic: a value model (the policy's backbone + a scalar head) and its own optimizer.

As the reference (verl's ``dp_critic``), the critic is a separate model initialised from the
policy's weights (``model.path``), with its own AdamW (``algorithm.critic_lr``, 1e-5), gradient
clipping and clipped value loss (:meth:`PPOLoss.value_loss <torchrl_agent.objectives.PPOLoss.value_loss>`,
the run's PPO loss); it is updated on the same mini-batches as the policy, before it.
The value of response token ``k`` is read at the position before it (the state from which token
``k`` is generated), as the reference's ``values[:, -response_length - 1:-1]``.

Under ``torchrun`` the critic lives on rank 0 only (unsharded) and is updated there, before the
rows are broadcast to the other ranks for the policy update.

Formulas (GAE, value loss): ``docs/algorithms.md``. GAE itself is TorchRL's functional
``vec_generalized_advantage_estimate`` (via :meth:`PPOLoss.compute_advantage
<torchrl_agent.objectives.PPOLoss.compute_advantage>` and :func:`~torchrl_agent.objectives.token_gae`); TorchRL's
``GAE`` value-estimator module is not used because it calls a value network on each step's
``(observation, ("next", observation))`` pair, while here all token values of a response come from one
forward over prompt + response (``values [N, T]``), with the value after the last token 0.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from torchrl_agent.modules.logprobs import pad_rows
from torchrl_agent.objectives.ppo import PPOLoss
from torchrl_agent.trainers.batching import fit_width

__all__ = ["ValueModel", "Critic"]


class ValueModel(nn.Module):
    """A transformer backbone (``AutoModel``) and a linear head to one value per position.

    :meth:`forward` takes a rows TensorDict ``[N]`` (ragged ``("tokens", "prompt")`` and
    ``("tokens", "response")``) and returns ``(values [N, T], mask [N, T])`` over the response
    tokens (``T`` the longest response; float32 values, 0 off the mask).
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, pad_token_id: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # V = 0 at the start: the first advantages are the (whitened) scores
        nn.init.zeros_(self.head.bias)
        self.pad_token_id = pad_token_id

    @classmethod
    def from_pretrained(cls, path: str, pad_token_id: int, dtype: torch.dtype = torch.float32) -> ValueModel:
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path, dtype=dtype)
        return cls(backbone, backbone.config.hidden_size, pad_token_id)

    def forward(self, rows: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.head.weight.device
        batch = {k: v.to(device) for k, v in pad_rows(rows, self.pad_token_id).items()}
        hidden = self.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        n, t_max = batch["response_mask"].shape
        positions = (batch["response_start"][:, None] - 1 + torch.arange(t_max, device=device)[None]).clamp(
            0, hidden.shape[1] - 1)
        picked = hidden.gather(1, positions[..., None].expand(n, t_max, hidden.shape[-1]))
        values = self.head(picked.to(self.head.weight.dtype)).squeeze(-1).float()
        mask = batch["response_mask"]
        return values * mask, mask


class Critic:
    """The value model, its optimizer and the clipped value-loss update.

    Args:
        model: a :class:`ValueModel`.
        loss: the run's :class:`~torchrl_agent.objectives.PPOLoss`: its :meth:`~.PPOLoss.value_loss`
            (``value_clip``, the reference's ``cliprange_value`` 0.5, and the policy's aggregation,
            as the reference) is the critic's loss.
        lr: AdamW learning rate (reference ``critic.optim.lr`` = 1e-5); weight decay 0.01.
        grad_clip: gradient-norm clip.
    """

    def __init__(self, model: ValueModel, loss: PPOLoss, *, lr: float = 1e-5, weight_decay: float = 0.01,
                 grad_clip: float = 1.0) -> None:
        self.model, self.loss = model, loss
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        self.grad_clip = grad_clip

    @torch.no_grad()
    def values(self, rows: TensorDictBase, chunk: int = 64) -> torch.Tensor:
        """Values of every response token, ``[N, T]`` (``T`` the batch's longest response), no grad."""
        self.model.eval()
        parts = [self.model(rows[s:s + chunk])[0].cpu() for s in range(0, rows.batch_size[0], chunk)]
        self.model.train()
        width = max(p.shape[-1] for p in parts)
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p in parts])

    def update(self, rows: TensorDictBase, old_values: torch.Tensor, returns: torch.Tensor, *, epochs: int,
               minibatch_size: int, generator: torch.Generator) -> dict[str, float]:
        """Epochs of mini-batch steps of the clipped value loss; ``old_values`` / ``returns`` [N, T].

        Returns the averaged ``value_loss``, ``value_clip_fraction``, ``value_mean`` and ``critic_grad_norm``."""
        n = rows.batch_size[0]
        totals = {"value_loss": 0.0, "value_clip_fraction": 0.0, "value_mean": 0.0, "critic_grad_norm": 0.0}
        steps = 0
        self.model.train()
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator)
            for start in range(0, n, minibatch_size):
                idx = order[start:start + minibatch_size]
                value, mask = self.model(rows[idx])
                width = value.shape[-1]
                old = fit_width(old_values[idx], width).to(value.device)
                target = fit_width(returns[idx], width).to(value.device)
                loss, frac = self.loss.value_loss(TensorDict(
                    state_value=value, old_state_value=old, value_target=target, mask=mask, batch_size=[len(idx)]))
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
                self.optimizer.step()
                steps += 1
                totals["value_loss"] += float(loss.detach())
                totals["value_clip_fraction"] += float(frac)
                totals["value_mean"] += float(value.detach()[mask].mean()) if bool(mask.any()) else 0.0
                totals["critic_grad_norm"] += float(grad_norm)
        return {k: v / max(steps, 1) for k, v in totals.items()}

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

"""Weight synchronisation for the rollout engines, as TorchRL ``WeightSyncScheme`` s.

A collector's :meth:`~torchrl.collectors.BaseCollector.update_policy_weights_` sends the trained
weights through the scheme registered for ``"policy"``:

- :class:`~torchrl.weight_update.NoWeightSyncScheme` (TorchRL's) when the engine *shares* the
  trainer's model (:class:`~torchrl_agent.modules.TransformersPolicy`): nothing to send.
- :class:`EngineReloadScheme` when the engine holds its own copy (vLLM, in this process or in an
  engine-server process): the weights are handed to the engine's ``reload_weights`` (on CPU: in
  memory for an in-process engine, through a safetensors file otherwise; see
  :meth:`~torchrl_agent.modules.VLLMPolicy.update_weights`). The transport is what differs:
  :class:`PolicyTransport` calls a local policy's ``update_weights``; the multi-process collector's
  engine server has its own transport (a request over a pipe, acknowledged once loaded).

Accepted weights: a ``dict`` name -> tensor (Hugging Face names), a ``TensorDict`` (flattened
with ``"."``) or an ``nn.Module`` (its ``state_dict()``).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.weight_update import NoWeightSyncScheme, WeightSyncScheme

__all__ = ["EngineReloadScheme", "PolicyTransport", "default_scheme", "as_state_dict"]


def as_state_dict(weights: Any) -> dict[str, torch.Tensor]:
    """``weights`` (dict, TensorDict or module) as a flat ``{name: tensor}`` dict."""
    if isinstance(weights, torch.nn.Module):
        return weights.state_dict()
    if isinstance(weights, TensorDictBase):
        return dict(weights.flatten_keys(".").items())
    if isinstance(weights, dict) and weights:
        return dict(weights)
    raise ValueError("update_policy_weights_ needs the trained weights: a state dict, a TensorDict or a module "
                     f"(got {type(weights).__name__})")


class PolicyTransport:
    """TorchRL ``TransportBackend`` that loads weights into a local engine (``policy.update_weights``)."""

    def __init__(self, policy):
        self.policy = policy

    def send_weights(self, weights: Any) -> None:
        self.policy.update_weights(as_state_dict(weights))

    def receive_weights(self, timeout=None, *, weights=None, model=None, strategy=None):
        return None  # the engine is the receiver; nothing comes back

    def check_connection(self) -> bool:
        return True

    def setup_connection_and_weights_on_sender(self) -> None:
        pass

    def setup_connection_and_weights_on_receiver(self, *, worker_idx=None, weights=None, model=None, strategy=None):
        return None


class EngineReloadScheme(WeightSyncScheme):
    """Sends the trainer's weights to an engine that keeps its own copy (``reload_weights``).

    Args:
        transport: how the weights reach the engine; :class:`PolicyTransport` (a policy in this
            process) or the engine server's transport. Set by the collector when ``None``.
    """

    def __init__(self, transport=None):
        super().__init__()  # prepare_weights below turns any weights into a state dict
        self._transport = transport

    def _init_on_sender_impl(self, *, model_id: str = "policy", context: Any = None, transport=None, **kwargs):
        self.model_id = model_id
        self.context = context
        self.shared_transport = transport or self._transport
        if self.shared_transport is None:
            raise ValueError("EngineReloadScheme needs a transport (a PolicyTransport or an engine server's)")

    def _init_on_receiver_impl(self, *, model_id: str, context: Any = None, **kwargs):
        self.model_id = model_id  # the engine applies the weights itself

    def create_transport(self, **kwargs):
        return self._transport

    def prepare_weights(self, weights, model_id, strategy, context=None):
        return as_state_dict(weights)


def default_scheme(policy) -> WeightSyncScheme:
    """TorchRL's ``NoWeightSyncScheme`` for an engine sharing the trainer's model, else an
    :class:`EngineReloadScheme` over the policy's ``update_weights``."""
    from torchrl_agent.modules.policy import LLMPolicy

    if type(policy).update_weights is LLMPolicy.update_weights:
        return NoWeightSyncScheme()
    return EngineReloadScheme(PolicyTransport(policy))


def register_policy_scheme(collector, scheme: WeightSyncScheme) -> None:
    """Register ``scheme`` as the collector's ``"policy"`` scheme, initialised and connected."""
    scheme.init_on_sender(model_id="policy", context=collector)
    scheme.connect()
    collector._weight_sync_schemes = {"policy": scheme}

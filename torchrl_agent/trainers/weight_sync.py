"""How the trained weights reach the rollout engines after every update, chosen once, when the
rollout is built (:func:`choose_weight_sync`); :meth:`Trainer.sync_weights
<torchrl_agent.trainers.Trainer.sync_weights>` calls what it returns.

The collectors send through their TorchRL ``WeightSyncScheme`` (:mod:`torchrl_agent.collectors.weight_sync`);
what is chosen here is what the trainer hands them, and which engine copy of its own it loads:

- ``shared``: the transformers engine generates with the training model itself (one float32
  process): nothing to do;
- ``copy``: the transformers engine's copy in the compute dtype (one process): loaded from the
  model's state, which the collector is also given;
- ``own``: an engine with its own weights (vLLM, one process, or every rank's under torchrun): the
  full weights in the compute dtype, through the collector;
- ``ranks``: under torchrun, every rank's transformers copy, loaded from the all-gathered full weights;
- ``collector``: a multi-process or Ray collector's engines, through the collector, and this
  process's own engine (the evaluation's) from the same full weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchrl_agent.trainers.distributed import full_weights

__all__ = ["choose_weight_sync"]


def choose_weight_sync(model: nn.Module, rollout_model: nn.Module | None, policy, collector, *,
                       compute_dtype: torch.dtype, sharded_collector: bool,
                       distributed: bool) -> tuple[str, Callable[[], None]]:
    """``(name, sync)``: the scheme of the module docstring for this run, and the call that runs it
    (every rank calls it under torchrun: the full weights are all-gathered)."""
    if sharded_collector:
        def sync() -> None:
            state = full_weights(model, compute_dtype)
            collector.update_policy_weights_(state)
            if rollout_model is None:
                policy.update_weights(state)
            elif rollout_model is not model:
                rollout_model.load_state_dict(state)

        return "collector", sync
    if rollout_model is None:
        return "own", lambda: collector.update_policy_weights_(full_weights(model, compute_dtype))
    if distributed:
        return "ranks", lambda: rollout_model.load_state_dict(full_weights(model, compute_dtype))
    if rollout_model is not model:
        def sync() -> None:
            state = model.state_dict()
            rollout_model.load_state_dict(state)  # cast into the engine's copy
            collector.update_policy_weights_(state)

        return "copy", sync
    return "shared", lambda: None

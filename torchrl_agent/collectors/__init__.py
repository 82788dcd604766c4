"""Collectors: the multi-step, step-row collector for LLM agents (a TorchRL ``BaseCollector``),
its sharded forms (processes over one shared vLLM engine; Ray actors, optional extra ``ray``),
and the weight-sync schemes."""

from torchrl_agent.collectors.distributed import DistributedStepCollector
from torchrl_agent.collectors.multiprocess import MultiProcessStepCollector
from torchrl_agent.collectors.shards import ConfigEnvFactory, TextEnvFactory
from torchrl_agent.collectors.step_collector import StepCollector, episode_metrics, request_seeds, token_ledger
from torchrl_agent.collectors.weight_sync import EngineReloadScheme, PolicyTransport

__all__ = ["ConfigEnvFactory", "DistributedStepCollector", "EngineReloadScheme", "MultiProcessStepCollector", "PolicyFactory", "PolicyTransport",
           "RayStepCollector", "StepCollector", "TextEnvFactory", "episode_metrics", "request_seeds", "token_ledger"]


def __getattr__(name: str):
    # the Ray collector's module is imported on first use only (importing Ray is slow; it is optional)
    if name in ("RayStepCollector", "PolicyFactory"):
        from torchrl_agent.collectors import ray as _ray

        return getattr(_ray, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

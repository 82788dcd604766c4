"""Collectors: the multi-step, step-row collector for LLM agents (a TorchRL ``BaseCollector``),
its multi-process form over one shared vLLM engine, and the weight-sync schemes."""

from torchrl_agent.collectors.multiprocess import MultiProcessStepCollector
from torchrl_agent.collectors.step_collector import StepCollector, episode_metrics, request_seeds, token_ledger
from torchrl_agent.collectors.weight_sync import EngineReloadScheme, PolicyTransport

__all__ = ["EngineReloadScheme", "MultiProcessStepCollector", "PolicyTransport", "StepCollector", "episode_metrics", "request_seeds",
           "token_ledger"]

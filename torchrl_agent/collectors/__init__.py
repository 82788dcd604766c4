"""Collectors: the multi-step, step-row collector for LLM agents."""

from torchrl_agent.collectors.step_collector import StepCollector, episode_metrics, token_ledger

__all__ = ["StepCollector", "episode_metrics", "token_ledger"]

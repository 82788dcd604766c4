"""torchrl-agent: training LLM agents with RL on long multi-turn text tasks, natively on TorchRL."""

__version__ = "0.1.0"

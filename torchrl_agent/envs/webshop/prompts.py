"""WebShop's prompt template, registered by name when the package is imported."""

from __future__ import annotations

from torchrl_agent.envs.transforms.templates import register_template

register_template("webshop", (
    "You are an expert autonomous agent operating in the WebShop e-commerce environment. "
    "First reason step by step about the current situation inside <think> </think>, then choose exactly one "
    "admissible action and give it inside <action> </action>.\n"
    "Your task is to: {task}\n"
    "{history}\n"
    "You have taken {step} steps. Your current observation is: {observation}\n"
    "Your admissible actions of the current situation are: [{admissible_actions}]"
))

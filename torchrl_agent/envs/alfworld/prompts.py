"""ALFWorld's prompt template and the reference's (verl-agent's) prompt and parsing rule, registered by name when the package is imported."""

from __future__ import annotations

import re

from torchrl_agent.envs.transforms.projection import reference_action_tags, register_format, response_tail
from torchrl_agent.envs.transforms.templates import TAGS_INSTRUCTION, ReferenceTemplate, register_template

register_template("alfworld", (
    "You are an expert agent operating in the ALFRED embodied household environment. " + TAGS_INSTRUCTION + "\n"
    "Your task: {task}\n"
    "{history}\n"
    "You have taken {step} steps. Your current observation is: {observation}\n"
    "Your admissible actions of the current situation are: [{admissible_actions}]"
))

# The reference's prompt texts (verl-agent, agent_system/environments/prompts/, upstream commit 796ed31), verbatim.
_ALFWORLD_TEMPLATE_NO_HIS = (
    "\n"
    "You are an expert agent operating in the ALFRED Embodied Environment.\n"
    "Your current observation is: {current_observation}\n"
    "Your admissible actions of the current situation are: [{admissible_actions}].\n"
    "\n"
    "Now it's your turn to take an action.\n"
    "You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and present it within <action> </action> tags.\n"
)
_ALFWORLD_TEMPLATE = (
    "\n"
    "You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {task_description}\n"
    "Prior to this step, you have already taken {step_count} step(s). Below are the most recent {history_length} observations and the corresponding actions you took: {action_history}\n"
    "You are now at step {current_step} and your current observation is: {current_observation}\n"
    "Your admissible actions of the current situation are: [{admissible_actions}].\n"
    "\n"
    "Now it's your turn to take an action.\n"
    "You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and present it within <action> </action> tags.\n"
)
register_template("reference_alfworld", ReferenceTemplate(
    _ALFWORLD_TEMPLATE_NO_HIS, _ALFWORLD_TEMPLATE,
    intro="-= Welcome to TextWorld, ALFRED! =-\n\n{observation}\n\nYour task is to: {task}"))


_CJK_REFERENCE = re.compile(r"[\u4e00-\u9fff]")


def _reference_alfworld(response: str) -> tuple[str, bool]:
    """verl-agent's ``alfworld_projection``: the ``<action>`` text; no tags: the response's tail, invalid."""
    action, think_ok = reference_action_tags(response)
    if action is None:
        return response_tail(response), False
    return action, think_ok and not _CJK_REFERENCE.search(response)


register_format("reference_alfworld", _reference_alfworld)

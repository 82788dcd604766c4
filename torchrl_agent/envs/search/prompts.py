"""Search's prompt template and the reference's (verl-agent's) prompt and parsing rule, registered by name when the package is imported."""

from __future__ import annotations

from torchrl_agent.envs.transforms.projection import count_tag, register_format, tag_block
from torchrl_agent.envs.transforms.templates import ReferenceTemplate, register_template

register_template("search", (
    "Answer the question. Reason inside <think> </think>. To look something up, write "
    "<search> query </search> and the top results come back inside <information> </information>. "
    "When you know the answer, write <answer> answer </answer>.\n"
    "Question: {task}\n"
    "{history}\n"
    "You have taken {step} turns. Latest information: {observation}"
))

# The reference's prompt texts (verl-agent, agent_system/environments/prompts/, upstream commit 796ed31), verbatim;
# the text without history and the one with it share their beginning and their end.
_SEARCH_HEAD = (
    "\n"
    "You are an expert agent tasked with answering the given question step-by-step.\n"
    "Your question: {task_description}\n"
    "\n"
)
_SEARCH_TAIL = (
    "Now it's your turn to respond for the current step.\n"
    "You should first conduct reasoning process. This process MUST be enclosed within <think> </think> tags. \n"
    "After completing your reasoning, choose only one of the following actions (do not perform both):\n"
    "(1) If you find you lack some knowledge, you can call a search engine to get more external information using format: <search> your query </search>.\n"
    "(2) If you have enough knowledge to answer the question confidently, provide your final answer within <answer> </answer> tags, without detailed illustrations. For example, <answer>Beijing</answer>.\n"
)
_SEARCH_TEMPLATE_NO_HIS = _SEARCH_HEAD + _SEARCH_TAIL
_SEARCH_TEMPLATE = _SEARCH_HEAD + (
    "Prior to this step, you have already taken {step_count} step(s). Below is the interaction history where <search> </search> wrapped your past search queries and <information> </information> wrapped the corresponding search results returned by the external search engine. History:\n"
    "{memory_context}\n"
    "\n"
) + _SEARCH_TAIL
register_template("reference_search", ReferenceTemplate(_SEARCH_TEMPLATE_NO_HIS, _SEARCH_TEMPLATE, history="search"))


def _reference_search(response: str) -> tuple[str, bool]:
    """verl-agent's ``search_projection``: the first ``<search>`` block of the text cut after the first
    closing tag, else the first ``<answer>`` block; both tags, or one twice: invalid."""
    cut = response
    for close in ("</search>", "</answer>"):  # the reference trims case-sensitively
        at = cut.find(close)
        if at != -1:
            cut = cut[:at + len(close)]
            break
    block, name = tag_block(cut, "search"), "search"
    if block is None:
        block, name = tag_block(cut, "answer"), "answer"
    action, valid = (f"<{name}>{block[1].strip()}</{name}>", True) if block else ("", False)
    searches, answers = count_tag(response, "<search>"), count_tag(response, "<answer>")
    if (searches and answers) or searches > 1 or answers > 1:
        valid = False
    return action, valid


register_format("reference_search", _reference_search, expert="search")

"""Prompt templates: ours (one per environment) and the reference's texts with the way it fills them.

Our templates are one user message with the stable part (instructions, task) first and the
changing part (history, step, observation, actions) last, so an engine's prefix cache can reuse
it. Fields: ``{task}``, ``{history}``, ``{step}`` (steps taken), ``{observation}``,
``{admissible_actions}`` (comma-joined, or ``"any"`` when free-form).

**Reference mode** (``template="reference"`` with the env name, or ``"reference_<env>"``): the
prompt texts of verl-agent (``agent_system/environments/prompts/*.py``) filled the way its
environment managers fill them (:class:`ReferenceTemplate`): the no-history text at the first step
(or without memory), the history lines ``[Observation n: '...', Action n: '...']`` (ALFWorld,
Sokoban) or ``Step n:<action> <information>`` (Search), ALFWorld's admissible actions quoted one a
line without ``help``. The reference's Gym Cards prompts carry the state in an image (``<image>``);
here the image is replaced by the observation text. These prompts put the changing part first, so
they share less prefix between steps than ours.

:func:`resolve_template` turns a config value into a template;
:class:`~torchrl_agent.envs.transforms.prompt.PromptTransform` renders it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PROMPT_TEMPLATES", "REFERENCE_TEMPLATES", "ReferenceTemplate", "resolve_template"]

_TAGS = ("First reason step by step inside <think> </think>, then give exactly one action inside "
         "<action> </action>.")

PROMPT_TEMPLATES: dict[str, str] = {
    "default": (
        "You are an agent acting in a text environment. " + _TAGS + "\n"
        "Your task: {task}\n"
        "{history}\n"
        "You have taken {step} steps. Current observation: {observation}\n"
        "Admissible actions: {admissible_actions}"
    ),
    "numberline": (
        "You move a marker on a number line. Answer '+' to move right or '-' to move left. " + _TAGS + "\n"
        "Your task: {task}\n"
        "{history}\n"
        "You have taken {step} steps. Current state: {observation}\n"
        "Admissible actions: {admissible_actions}"
    ),
    "alfworld": (
        "You are an expert agent operating in the ALFRED embodied household environment. " + _TAGS + "\n"
        "Your task: {task}\n"
        "{history}\n"
        "You have taken {step} steps. Your current observation is: {observation}\n"
        "Your admissible actions of the current situation are: [{admissible_actions}]"
    ),
    "sokoban": (
        "You are a Sokoban solver. Push every box (X) onto a target (O) without getting stuck. "
        "Symbols: # wall, _ floor, O target, X box, \u221a box on target, P player, S player on target. "
        + _TAGS + "\n"
        "{history}\n"
        "You have taken {step} steps. Current room:\n{observation}\n"
        "Admissible actions: {admissible_actions}"
    ),
    # short prompts for the small bundled models (the learning benchmark): the state, the moves, no prose
    "sokoban_grid": (
        "Sokoban: push the box X onto the target O. P is you.\n"
        "{history}\n"
        "{observation}\n"
        "Moves: {admissible_actions}"
    ),
    "numberline_short": (
        "Move the marker to the target: + right, - left.\n"
        "{observation}"
    ),
    "babyai_short": (
        "{task}\n"
        "{observation}"
    ),
    # babyai_short with the memory's lines between the task and the view (a policy that sees its last
    # move can leave a left/right cycle that a memoryless one repeats; docs/learning.md)
    "babyai_history": (
        "{task}\n"
        "{history}\n"
        "{observation}"
    ),
    "ezpoints_short": (
        "Write a formula equal to 12 using each card once, one token at a time, then =.\n"
        "{history}\n"
        "{observation}"
    ),
    "cards": (
        "You play a card game one token at a time. First reason step by step inside <think> </think>, "
        "then answer with a JSON object such as {{\"action\": \"+\"}}.\n"
        "Your task: {task}\n"
        "{history}\n"
        "You have taken {step} steps. Current state: {observation}\n"
        "Admissible actions: {admissible_actions}"
    ),
    "search": (
        "Answer the question. Reason inside <think> </think>. To look something up, write "
        "<search> query </search> and the top results come back inside <information> </information>. "
        "When you know the answer, write <answer> answer </answer>.\n"
        "Question: {task}\n"
        "{history}\n"
        "You have taken {step} turns. Latest information: {observation}"
    ),
    "webshop": (
        "You are an expert autonomous agent operating in the WebShop e-commerce environment. "
        "First reason step by step about the current situation inside <think> </think>, then choose exactly one "
        "admissible action and give it inside <action> </action>.\n"
        "Your task is to: {task}\n"
        "{history}\n"
        "You have taken {step} steps. Your current observation is: {observation}\n"
        "Your admissible actions of the current situation are: [{admissible_actions}]"
    ),
    "appworld": (
        "I am your supervisor and you are a super intelligent AI Assistant whose job is to achieve my day-to-day "
        "tasks completely autonomously. You interact with apps (e.g. spotify, venmo, simple_note) through their "
        "APIs in a Python REPL: write code, read its output, write the next code. Useful APIs: "
        "apis.api_docs.show_app_descriptions(), apis.api_docs.show_api_descriptions(app_name=...), "
        "apis.api_docs.show_api_doc(app_name=..., api_name=...); apis.supervisor.show_account_passwords() gives my "
        "passwords. When the task is done call apis.supervisor.complete_task() (with answer=... if it asks a "
        "question). First reason inside <think> </think>, then give exactly one code block inside <code> </code>.\n"
        "{task}\n"
        "{history}\n"
        "You have taken {step} steps. Output of your last code: {observation}"
    ),
}


# ------------------------------------------------------------------------------------------ reference mode
# The prompt texts of verl-agent (agent_system/environments/prompts/, upstream commit 796ed31), verbatim,
# so that prompts match in the reference mode. Fields are the reference's own names.
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
_SOKOBAN_TEMPLATE_NO_HIS = (
    "\n"
    "You are an expert agent operating in the Sokoban environment.\n"
    "\n"
    "# Symbols and Their Meaning\n"
    "- Walls (`#`): These block movement. You can't move through or push anything into walls.\n"
    "- Floor (`_`): Open spaces where you can walk and move boxes.\n"
    "- Targets (`O`): The spots where boxes need to go.\n"
    "- Boxes (`X`): These are what you need to push onto the targets.\n"
    "- Player (`P`): That's you! You'll move around the grid to push boxes.\n"
    "- Box on Target (`√`): A box successfully placed on a target.\n"
    "- Player on Target (`S`): You standing on a target.\n"
    "\n"
    "# Your Goal\n"
    "Your goal is to push all the boxes (`X`) onto the target spots (`O`). Once all boxes are on the targets, you win!\n"
    "\n"
    "# Rules\n"
    "You can only push boxes. You can't pull them, so plan ahead to avoid getting stuck.\n"
    "You can't walk through or push boxes into walls (`#`).\n"
    "To avoid traps, do not push boxes into corners or against walls where they can't be moved again.\n"
    "\n"
    "# Current Step\n"
    "Your current observation is:\n"
    "{current_observation}\n"
    "Your admissible actions are [\"up\", \"down\", \"left\", \"right\"].\n"
    "\n"
    "Now it's your turn to make a move (choose ONE action only for the current step).\n"
    "You should first reason step-by-step about the current situation — observe the positions of boxes and targets, plan a path to push a box toward a target, and avoid traps like corners or walls. This reasoning process MUST be enclosed within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and present it within <action> </action> tags.\n"
)
_SOKOBAN_TEMPLATE = (
    "\n"
    "You are an expert agent operating in the Sokoban environment.\n"
    "\n"
    "# Symbols and Their Meaning\n"
    "- Walls (`#`): These block movement. You can't move through or push anything into walls.\n"
    "- Floor (`_`): Open spaces where you can walk and move boxes.\n"
    "- Targets (`O`): The spots where boxes need to go.\n"
    "- Boxes (`X`): These are what you need to push onto the targets.\n"
    "- Player (`P`): That's you! You'll move around the grid to push boxes.\n"
    "- Box on Target (`√`): A box successfully placed on a target.\n"
    "- Player on Target (`S`): You standing on a target.\n"
    "\n"
    "# Your Goal\n"
    "Your goal is to push all the boxes (`X`) onto the target spots (`O`). Once all boxes are on the targets, you win!\n"
    "\n"
    "# Rules\n"
    "You can only push boxes. You can't pull them, so plan ahead to avoid getting stuck.\n"
    "You can't walk through or push boxes into walls (`#`).\n"
    "To avoid traps, do not push boxes into corners or against walls where they can't be moved again.\n"
    "\n"
    "# Current Step\n"
    "Prior to this step, you have already taken {step_count} step(s). Below are the most recent {history_length} observations and the corresponding actions you took: {action_history}\n"
    "You are now at step {current_step} and your current observation is:\n"
    "{current_observation}\n"
    "Your admissible actions are [\"up\", \"down\", \"left\", \"right\"].\n"
    "\n"
    "Now it's your turn to make a move (choose ONE action only for the current step).\n"
    "You should first reason step-by-step about the current situation — observe the positions of boxes and targets, plan a path to push a box toward a target, and avoid traps like corners or walls. This reasoning process MUST be enclosed within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and present it within <action> </action> tags.\n"
)
_SEARCH_TEMPLATE_NO_HIS = (
    "\n"
    "You are an expert agent tasked with answering the given question step-by-step.\n"
    "Your question: {task_description}\n"
    "\n"
    "Now it's your turn to respond for the current step.\n"
    "You should first conduct reasoning process. This process MUST be enclosed within <think> </think> tags. \n"
    "After completing your reasoning, choose only one of the following actions (do not perform both):\n"
    "(1) If you find you lack some knowledge, you can call a search engine to get more external information using format: <search> your query </search>.\n"
    "(2) If you have enough knowledge to answer the question confidently, provide your final answer within <answer> </answer> tags, without detailed illustrations. For example, <answer>Beijing</answer>.\n"
)
_SEARCH_TEMPLATE = (
    "\n"
    "You are an expert agent tasked with answering the given question step-by-step.\n"
    "Your question: {task_description}\n"
    "\n"
    "Prior to this step, you have already taken {step_count} step(s). Below is the interaction history where <search> </search> wrapped your past search queries and <information> </information> wrapped the corresponding search results returned by the external search engine. History:\n"
    "{memory_context}\n"
    "\n"
    "Now it's your turn to respond for the current step.\n"
    "You should first conduct reasoning process. This process MUST be enclosed within <think> </think> tags. \n"
    "After completing your reasoning, choose only one of the following actions (do not perform both):\n"
    "(1) If you find you lack some knowledge, you can call a search engine to get more external information using format: <search> your query </search>.\n"
    "(2) If you have enough knowledge to answer the question confidently, provide your final answer within <answer> </answer> tags, without detailed illustrations. For example, <answer>Beijing</answer>.\n"
)
_NUMBERLINE_TEMPLATE = (
    "\n"
    "<image>You are playing a game called number line. You will see a target number and a current number in the image. And your goal is to move the current number closer to the target by choosing either adding or subtracting one to the current number.\n"
    "\n"
    "Your response should be a valid json file in the following format: \n"
    "{{\n"
    "\"current number\": \"x\",\n"
    "\"target number\": \"x\",\n"
    "\"thoughts\": \"first read out the current and target number, then think carefully about which action to choose\",\n"
    "\"action\": \"-\" or \"+\" \n"
    "}}\n"
)
_BLACKJACK_TEMPLATE = (
    "\n"
    "<image>You are an expert blackjack player helping to decide the optimal action based on the current game state displayed in the image. \n"
    "\n"
    "From the image, you can see:\n"
    "- Dealer (top): one face-up card and one face-down card.  \n"
    "- Player (bottom): every card in your hand, laid left-to-right (wraps after five).\n"
    "\n"
    "Game Rules:\n"
    "- Your goal is to get as close to 21 as possible without going over.\n"
    "- Number cards (2–10) = their value. Face cards (J, Q, K) = 10. Aces (\"A\") = 1 or 11 (an ace is always counted as 11 (usable) unless it causes a bust).\n"
    "- After you choose \"stand\", the dealer reveals the hidden card and draws until the hand total is 17 or higher.\n"
    "- If a hand exceeds 21, it busts and loses immediately.\n"
    "- A natural blackjack (Ace+10) can get an extra reward.\n"
    "- The deck is infinite (with replacement).\n"
    "\n"
    "Admissible Actions:\n"
    "- \"hit\": take another card.\n"
    "- \"stand\": stop and let the dealer play.\n"
    "\n"
    "Your response should be a valid json file in the following format:\n"
    "{{\n"
    "\"thoughts\": \"Analyze the image to identify your cards and the dealer's visible card. Then, reason step-by-step based on optimal blackjack strategy under the above rules.\",\n"
    "\"action\": \"an admissible action\"\n"
    "}}\n"
)
_EZPOINTS_TEMPLATE = (
    "\n"
    "<image>You are an expert card game player helping to build a math formula that evaluates to **12**, using only the two numbers shown on the playing cards in the image. You may choose from the following actions: one of the two available card numbers, the operators '+' or '*', or the equals sign '='. You must build the formula step by step, adding only one character at a time to the end of the current formula.\n"
    "\n"
    "Card Rules:\n"
    "1. The image shows exactly two playing cards.\n"
    "2. Each card represents one number:\n"
    "   - Number cards (2–10) equal their face value.\n"
    "   - Face cards ('J', 'Q', 'K') are treated as the number 10.\n"
    "   - Ace ('A') is treated as 1.\n"
    "3. You can only use these two card numbers — no other numbers are allowed.\n"
    "4. Each number can be used only once in the formula.\n"
    "\n"
    "Formula Rules:\n"
    "1. At each step, you append only one character: a number (from the two card values), an operator ('+' or '*'), or '='.\n"
    "2. Once you add '=', the formula is evaluated and the game ends.\n"
    "\n"
    "Rewards:\n"
    "+10: if the formula evaluates exactly to 12.\n"
    "0: otherwise (e.g., using a number not shown on the cards, reusing a number, incorrect syntax, not evaluating to 12).\n"
    "\n"
    "Now, you are given two card numbers as shown in the image, and the current formula is: '{text_formula}'\n"
    "It's your turn to append the next character.\n"
    "\n"
    "Your response MUST be a valid JSON object in the following format:\n"
    "{{\n"
    "  \"thoughts\": \"Start by identifying the two card numbers shown in the image. Then review the current formula. Based on the remaining available characters and the goal of reaching 12, reason step-by-step to choose the next valid character to add.\",\n"
    "  \"action\": \"next character (number, '+', '*', or '=') to append\"\n"
    "}}\n"
)
_POINTS24_TEMPLATE = (
    "\n"
    "<image>You are an expert at solving the classic \"24 Game\", where you build an formula that evaluates exactly to **24**, using only the four numbers shown on the playing cards in the image. You may choose from the following actions: one of the four available card numbers, the operators ('+', '-', '*', '/'), the parentheses '(', ')', and the equals sign '='.\n"
    "\n"
    "Card Rules:\n"
    "1. The image shows exactly four playing cards.\n"
    "2. Each card represents one number:\n"
    "   - Number cards (2–10) equal their face value.\n"
    "   - Face cards ('J', 'Q', 'K') are treated as 10.\n"
    "   - Ace ('A') is treated as 1.\n"
    "3. You can only use these four card numbers — no other numbers are allowed.\n"
    "4. Each card can be used only once in the formula.\n"
    "\n"
    "Formula Rules:\n"
    "1. At each step, you append only one character: a number (from the four card values), an operator ('+', '-', '*', '/'), a parenthes ('(', ')'), or '='.\n"
    "2. Once you add '=', the formula is evaluated and the game ends.\n"
    "\n"
    "Rewards:\n"
    "+10: if the final formula is valid and equals 24, and all four card numbers are used.\n"
    "0: otherwise (e.g., using a number not shown on the cards, reusing a number, incorrect syntax, not evaluating to 24).\n"
    "\n"
    "----\n"
    "Here are three examples.\n"
    "\n"
    "Example 1:\n"
    "The current formula is: '8*'  \n"
    "Card numbers: '8', '3', '2', '1'  \n"
    "Since '8*3*(2-1)=24', the correct action is: '3'\n"
    "\n"
    "Example 2:\n"
    "The current formula is: '(10+2)*(4-2)'\n"
    "Card numbers are: '4', '10', '2', '2'\n"
    "Since '(10+2)*(4-2)=24', the correct action is: '='\n"
    "\n"
    "Example 3:\n"
    "The current formula is: ''\n"
    "Card numbers are: '6', '8', '1', '1'\n"
    "Since '6*8/(1+1)=24', the correct action is: '6'\n"
    "----\n"
    "\n"
    "Now, you are given four card numbers as shown in the image, and the current formula is: '{text_formula}'\n"
    "It's your turn to append the next character.\n"
    "\n"
    "Your response MUST be a valid JSON object in the following format:\n"
    "{{\n"
    "  \"thoughts\": \"Start by identifying the four card numbers shown in the image. Then analyze the current formula. Determine what characters (card numbers, operators, or parentheses) are still available. Reason step-by-step how to build a valid formula that equals 24 and figure out the next character to append.\",\n"
    "  \"action\": \"next character (number, '+', '-', '*', '/', '(', ')', or '=') to append\"\n"
    "}}\n"
)


def _window_lines(records: list[dict]) -> str:
    """The reference's ``SimpleMemory.fetch`` lines: one ``[Observation n: '...', Action n: '...']`` a step."""
    return "\n".join(f"[Observation {r['step'] + 1}: '{r['observation']}', Action {r['step'] + 1}: '{r['action']}']"
                     for r in records)


def _search_lines(records: list[dict], observation: str) -> str:
    """The reference's ``SearchMemory.fetch`` lines: ``Step n:<action> <what it returned>`` a step.

    The reference stores each action with the observation that *followed* it; a record here holds
    the observation *before* its action, so the one after is the next record's (or the current one).
    """
    after = [r["observation"] for r in records[1:]] + [observation]
    return "\n".join(f"Step {r['step'] + 1}:{r['action']} {obs}\n" for r, obs in zip(records, after))


def _formula(observation: str) -> str:
    """The formula typed so far, as the reference writes it (``''.join`` of the tokens), from a
    formula game's observation (``... Formula so far: 3 + 4`` or ``(empty)``)."""
    typed = observation.rpartition("Formula so far:")[2].strip()
    return "" if typed == "(empty)" else "".join(typed.split())


@dataclass(frozen=True)
class ReferenceTemplate:
    """One environment's reference prompt and how its environment manager fills it.

    Attributes:
        first: the text without history (the reference's ``*_TEMPLATE_NO_HIS``), used at the first
            step and when the memory keeps nothing.
        later: the text with history (``*_TEMPLATE``).
        history: ``"window"`` (ALFWorld, Sokoban lines), ``"search"`` (Search lines) or ``"none"``.
        image: the Gym Cards prompts start with ``<image>``; it is replaced by the observation text.
        intro: how the reference's environment shows the first observation, from ours (fields
            ``{observation}``, ``{task}``); ALFWorld's reset text holds a banner and the task, which
            our env splits into ``observation`` and ``task``. Empty: as it is.
    """

    first: str
    later: str
    history: str = "window"
    image: bool = False
    intro: str = ""

    def _observation(self, observation: str, step: int, task: str) -> str:
        return self.intro.format(observation=observation, task=task) if self.intro and step == 0 else observation

    def content(self, task: str, observation: str, actions: list[str], step: int,
                records: list[dict] | None, history_text: str, window: bool = True) -> str:
        """The user message. ``records``: the memory's records (``None``: no memory, or one that keeps
        nothing); ``window``: they are (observation, action) records of a window memory, written as the
        reference writes its history; otherwise the memory's own ``history_text`` is used."""
        use_history = records is not None and step > 0 and self.history != "none"
        if records:
            records = [{**r, "observation": self._observation(r["observation"], r["step"], task)}
                       if "observation" in r else r for r in records]
        observation = self._observation(observation, step, task)
        if not use_history:
            text = self.first
        else:
            if window:
                lines = _window_lines(records) if self.history == "window" else _search_lines(records, observation)
            else:  # e.g. a summary: the memory's own rendering
                lines = history_text
            text = self.later
        text = text.format(
            task_description=task, current_observation=observation, step_count=step, current_step=step + 1,
            history_length=len(records or []), action_history=lines if use_history else "",
            memory_context=lines if use_history else "", text_formula=_formula(observation),
            admissible_actions="\n ".join(f"'{a}'" for a in actions if a != "help"),
        )
        return text.replace("<image>", observation + "\n", 1) if self.image else text


#: ``reference_<env>`` -> the reference's prompt of that environment (Gym Cards have no history).
REFERENCE_TEMPLATES: dict[str, ReferenceTemplate] = {
    "reference_alfworld": ReferenceTemplate(
        _ALFWORLD_TEMPLATE_NO_HIS, _ALFWORLD_TEMPLATE,
        intro="-= Welcome to TextWorld, ALFRED! =-\n\n{observation}\n\nYour task is to: {task}"),
    "reference_sokoban": ReferenceTemplate(_SOKOBAN_TEMPLATE_NO_HIS, _SOKOBAN_TEMPLATE),
    "reference_search": ReferenceTemplate(_SEARCH_TEMPLATE_NO_HIS, _SEARCH_TEMPLATE, history="search"),
    "reference_numberline": ReferenceTemplate(_NUMBERLINE_TEMPLATE, _NUMBERLINE_TEMPLATE, "none", image=True),
    "reference_blackjack": ReferenceTemplate(_BLACKJACK_TEMPLATE, _BLACKJACK_TEMPLATE, "none", image=True),
    "reference_ezpoints": ReferenceTemplate(_EZPOINTS_TEMPLATE, _EZPOINTS_TEMPLATE, "none", image=True),
    "reference_points24": ReferenceTemplate(_POINTS24_TEMPLATE, _POINTS24_TEMPLATE, "none", image=True),
}


def resolve_template(template: str | None, env_name: str) -> str | ReferenceTemplate:
    """The template of a config value: ``None`` -> ours by env name (else ``"default"``);
    ``"reference"`` -> ``REFERENCE_TEMPLATES["reference_<env_name>"]``; a key of
    :data:`PROMPT_TEMPLATES` or :data:`REFERENCE_TEMPLATES`; else the string itself (a template)."""
    if template is None:
        return PROMPT_TEMPLATES.get(env_name, PROMPT_TEMPLATES["default"])
    if template == "reference":
        template = f"reference_{env_name}"
        if template not in REFERENCE_TEMPLATES:
            raise ValueError(f"template 'reference': the reference has no prompt for env {env_name!r}; it has one "
                             f"for {sorted(k.removeprefix('reference_') for k in REFERENCE_TEMPLATES)}")
    if template in REFERENCE_TEMPLATES:
        return REFERENCE_TEMPLATES[template]
    return PROMPT_TEMPLATES.get(template, template)

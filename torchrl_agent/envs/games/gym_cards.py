"""Gym Cards as text: EZPoints, Points24 and Blackjack (NumberLine lives in :mod:`~torchrl_agent.envs.games.numberline`).

Rules (the reference is RL4VLM's gym-cards as used by verl-agent):

* **EZPoints** (:class:`EZPointsEnv`): two cards are dealt; build a formula one token a step from the
  actions ``1 .. 10``, ``+``, ``*``, ``=`` (A counts 1, J/Q/K count 10). ``=`` finishes the formula
  and ends the episode: reward 10 (solved) when the formula is well formed, uses each card's value
  exactly once and equals 12, else 0. 8 steps at most.
* **Points24** (:class:`Points24Env`): the same with four cards, the actions ``1 .. 10``, ``+``,
  ``-``, ``*``, ``/``, ``(``, ``)``, ``=`` and the target 24 (exact rational arithmetic, so
  ``8 / (3 - 8 / 3)`` counts). 20 steps (tokens) at most.
* **Blackjack** (:class:`BlackjackEnv`): an infinite deck (every draw is uniform over the 13 ranks);
  the player holds two cards and sees one dealer card. ``hit`` draws a card (above 21: lost, the
  episode ends); ``stand`` lets the dealer draw until 17 or more (a usable ace counts 11), then the
  higher total wins. Reward 1 for a win, else 0; 15 steps at most.

Any other string (case and surrounding spaces ignored) is a no-op: the step is spent, the reward is
0 and nothing changes; the formula games do not append it. In the formula games a number that is not
the value of a card still unused (not on the cards, or all cards of that value already typed) is
rejected the same way, as gym-cards' ``_is_valid_action`` does. Formulas are evaluated by a small
recursive-descent parser over the typed tokens with :class:`fractions.Fraction` (never ``eval``).

Deals: ``solvable_only=True`` (the default) redraws a deal until a formula reaching the target
exists, so every episode can be won (as in gym-cards, whose deals are drawn to be solvable); with
``False`` any deal is kept and unsolvable ones have ``expert_action == ""``.

Experts: for the formula games a solver enumerates every formula over the cards (all orders,
operators and bracketings, written with minimal and with full brackets) that reaches the target and
gives the next token of the first one, in a fixed order, that extends what has been typed; ``""``
when none does (the typed prefix is a dead end). For Blackjack, the basic strategy without doubling
or splitting (hard totals: stand on 17+, on 13-16 against a dealer 2-6, on 12 against 4-6; soft
totals: stand on 19+, on 18 against a dealer 2-8; hit otherwise).

Frames (``modality="image"`` or ``"both"``): a 300x300x3 table of white cards with rank and suit
(:func:`~torchrl_agent.envs.games.images.card_table`): the formula games show the cards and, under
them, the formula typed so far; Blackjack shows the dealer's cards (the second face down until the
hand is over), yours, and the outcome once the hand is over. In image mode the observation text only
says where the image goes. The suits are drawn only: the formula games take them from the dealt
deck, Blackjack from a second generator of the seed (its ranks are those of text mode).
"""

from __future__ import annotations

import functools
import itertools
import operator
from fractions import Fraction
from typing import Any

import numpy as np

from torchrl_agent.envs.base import IMAGE_PLACEHOLDER, GameState, TextEnv, TextGame
from torchrl_agent.envs.games.images import CARD_TABLE_SIZE, SUITS, card_table
from torchrl_agent.envs.transforms.projection import gym_cards_rule, register_format
from torchrl_agent.envs.transforms.templates import ReferenceTemplate, register_template

__all__ = [
    "FormulaGame", "EZPointsGame", "Points24Game", "BlackjackGame",
    "EZPointsEnv", "Points24Env", "BlackjackEnv",
    "evaluate_formula", "solutions",
]

RANKS = ("A", "2", "3", "4", "5", "6", "7", "8", "9", "10", "J", "Q", "K")
NUMBER_TOKENS = tuple(str(v) for v in range(1, 11))


def card_value(rank: str) -> int:
    """A=1, 2..10 face value, J/Q/K=10 (the formula games' values)."""
    return 1 if rank == "A" else 10 if rank in ("J", "Q", "K") else int(rank)


# ---------------------------------------------------------------------------------------- formulas
class _ParseError(ValueError):
    pass


_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def evaluate_formula(tokens: list[str] | tuple[str, ...]) -> tuple[Fraction, list[int]]:
    """Evaluate a token list (numbers ``1..10``, ``+ - * /``, brackets) exactly.

    Returns ``(value, numbers used)``; raises ``ValueError`` on a malformed formula or a division
    by zero. Grammar: ``expr := term (('+'|'-') term)*``, ``term := atom (('*'|'/') atom)*``,
    ``atom := number | '(' expr ')'``.
    """
    tokens = list(tokens)
    pos = 0
    used: list[int] = []

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def atom() -> Fraction:
        nonlocal pos
        tok = peek()
        if tok == "(":
            pos += 1
            value = expr()
            if peek() != ")":
                raise _ParseError("missing ')'")
            pos += 1
            return value
        if tok in NUMBER_TOKENS:
            pos += 1
            used.append(int(tok))
            return Fraction(int(tok))
        raise _ParseError(f"expected a number or '(' at token {pos}")

    def chain(operand, ops: tuple[str, str]) -> Fraction:
        """``operand (op operand)*`` for the operators ``ops`` of one precedence level, left to right."""
        nonlocal pos
        value = operand()
        while peek() in ops:
            op = tokens[pos]
            pos += 1
            rhs = operand()
            if op == "/" and rhs == 0:
                raise _ParseError("division by zero")
            value = _OPERATORS[op](value, rhs)
        return value

    def term() -> Fraction:
        return chain(atom, ("*", "/"))

    def expr() -> Fraction:
        return chain(term, ("+", "-"))

    value = expr()
    if pos != len(tokens):
        raise _ParseError(f"unexpected token {tokens[pos]!r} at {pos}")
    return value, used


# An expression tree: an int leaf or (op, left, right).
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def _trees(values: tuple[int, ...], ops: tuple[str, ...], memo: dict) -> list[tuple[Any, float]]:
    """Every (tree, float value) over ``values`` in this order, with operators from ``ops`` (memoised)."""
    if values in memo:
        return memo[values]
    if len(values) == 1:
        out = [(values[0], float(values[0]))]
    else:
        out = []
        for split in range(1, len(values)):
            for left, lv in _trees(values[:split], ops, memo):
                for right, rv in _trees(values[split:], ops, memo):
                    for op in ops:
                        if op == "/":
                            if rv == 0:
                                continue
                            value = lv / rv
                        else:
                            value = lv + rv if op == "+" else lv - rv if op == "-" else lv * rv
                        out.append(((op, left, right), value))
    memo[values] = out
    return out


def _render(tree, full: bool, parent_op: str | None = None, right: bool = False) -> list[str]:
    """Tokens of ``tree``: with every bracket (``full``) or only the needed ones."""
    if isinstance(tree, int):
        return [str(tree)]
    op, left, rhs = tree
    tokens = _render(left, full, op, False) + [op] + _render(rhs, full, op, True)
    if parent_op is None:
        return tokens
    needed = full or _PRECEDENCE[op] < _PRECEDENCE[parent_op] or (
        right and _PRECEDENCE[op] == _PRECEDENCE[parent_op] and parent_op in "-/"
    )
    return ["(", *tokens, ")"] if needed else tokens


@functools.lru_cache(maxsize=4096)
def solutions(values: tuple[int, ...], target: int, ops: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Every token sequence (without ``=``) that uses each of ``values`` once and equals ``target``.

    Sorted: minimal-bracket formulas first, then by length and text, so the expert is deterministic.
    """
    found: set[tuple[int, tuple[str, ...]]] = set()
    arithmetic = tuple(op for op in ops if op in _PRECEDENCE)
    memo: dict = {}
    for order in set(itertools.permutations(values)):
        for tree, value in _trees(order, arithmetic, memo):
            if abs(value - target) > 1e-6:  # floats screen the candidates, the parser confirms exactly
                continue
            tokens = tuple(_render(tree, full=False))
            if evaluate_formula(tokens)[0] == target:
                found.add((0, tokens))
                if "(" in ops:
                    found.add((1, tuple(_render(tree, full=True))))
    if "(" not in ops:  # no brackets available: keep the formulas that read right without them
        found = {(k, f) for k, f in found if "(" not in f}
    return tuple(f for _, f in sorted(found, key=lambda kf: (kf[0], len(kf[1]), kf[1])))


class FormulaGame(TextGame):
    """Build a formula from the dealt cards, one token a step (EZPoints / Points24 rules).

    Args:
        num_cards: cards dealt.
        target: the value the formula must reach.
        operators: the operator and bracket tokens allowed besides the numbers and ``=``.
        solvable_only: redraw deals until a solution exists.
        expert: fill ``expert_action`` from the solver.
    """

    image_shape = (CARD_TABLE_SIZE, CARD_TABLE_SIZE, 3)
    VISUAL_OBSERVATION = f"The cards and the formula so far are shown in the image: {IMAGE_PLACEHOLDER}"

    def __init__(self, num_cards: int, target: int, operators: tuple[str, ...], solvable_only: bool = True,
                 expert: bool = True):
        self.num_cards, self.target, self.operators = num_cards, target, tuple(operators)
        self.solvable_only, self.expert = solvable_only, expert
        self.actions = (*NUMBER_TOKENS, *self.operators, "=")
        self._solver_ops = tuple(op for op in self.operators if op in _PRECEDENCE) + (
            ("(",) if "(" in self.operators else ()
        )
        self.cards: list[str] = []
        self.suits: list[str] = []  # drawn in the frame only
        self.formula: list[str] = []

    @property
    def values(self) -> tuple[int, ...]:
        return tuple(sorted(card_value(c) for c in self.cards))

    def _solutions(self) -> tuple[tuple[str, ...], ...]:
        return solutions(self.values, self.target, self._solver_ops)

    def reset(self, seed: int) -> GameState:
        rng = np.random.default_rng(seed)
        for _ in range(1000):
            deck = rng.permutation(52)[: self.num_cards]  # four suits of 13 ranks, drawn without replacement
            self.cards = [RANKS[int(i) % 13] for i in deck]
            self.suits = [SUITS[int(i) // 13] for i in deck]
            if not self.solvable_only or self._solutions():
                break
        self.formula = []
        return self._state()

    def step(self, action: str) -> tuple[GameState, float, bool, bool]:
        token = action.strip() if isinstance(action, str) else ""
        if token not in self.actions or (token in NUMBER_TOKENS and not self.available(token)):
            return self._state(), 0.0, False, False
        if token != "=":
            self.formula.append(token)
            return self._state(), 0.0, False, False
        solved = self.check(self.formula)
        self.formula.append("=")
        return self._state(), 10.0 if solved else 0.0, True, solved

    def available(self, number: str) -> bool:
        """Whether a card of value ``number`` is still unused by the formula typed so far."""
        return self.formula.count(number) < sum(card_value(c) == int(number) for c in self.cards)

    def check(self, formula: list[str]) -> bool:
        """True when ``formula`` is well formed, uses each card value once and equals the target."""
        try:
            value, used = evaluate_formula(formula)
        except ValueError:
            return False
        return value == self.target and sorted(used) == sorted(self.values)

    def expert_action(self) -> str:
        if self.formula and self.formula[-1] == "=":
            return ""
        typed = tuple(self.formula)
        for solution in self._solutions():
            if solution[: len(typed)] == typed:
                return solution[len(typed)] if len(solution) > len(typed) else "="
        return ""

    def render_image(self) -> np.ndarray:
        return card_table([("", list(zip(self.cards, self.suits)))], footer="Formula: " + " ".join(self.formula))

    def _state(self) -> GameState:
        formula = " ".join(self.formula) if self.formula else "(empty)"
        return GameState(
            observation=f"Cards: {', '.join(self.cards)}. Formula so far: {formula}",
            task=(
                f"Write a formula that uses the value of each card exactly once and equals {self.target}, "
                f"one token per step; finish it with '='. A counts 1, J, Q and K count 10. "
                f"Tokens: {' '.join(self.actions)}."
            ),
            admissible_actions=self.actions,
            expert_action=self.expert_action() if self.expert else "",
        )


class EZPointsGame(FormulaGame):
    """Two cards, ``+`` and ``*``, target 12."""

    def __init__(self, solvable_only: bool = True, expert: bool = True):
        super().__init__(2, 12, ("+", "*"), solvable_only, expert)


class Points24Game(FormulaGame):
    """Four cards, ``+ - * / ( )``, target 24."""

    def __init__(self, solvable_only: bool = True, expert: bool = True):
        super().__init__(4, 24, ("+", "-", "*", "/", "(", ")"), solvable_only, expert)


# ---------------------------------------------------------------------------------------- blackjack
def hand_value(values: list[int]) -> tuple[int, bool]:
    """``(total, usable ace)``: an ace counts 11 when that does not bust."""
    total = sum(values)
    if 1 in values and total + 10 <= 21:
        return total + 10, True
    return total, False


def basic_strategy(player: list[int], dealer_card: int) -> str:
    """Hit or stand by the basic strategy without doubling or splitting (dealer ace = 1 here)."""
    total, soft = hand_value(player)
    dealer = 11 if dealer_card == 1 else dealer_card
    if soft:
        if total >= 19 or (total == 18 and dealer <= 8):
            return "stand"
        return "hit"
    if total >= 17 or (13 <= total <= 16 and 2 <= dealer <= 6) or (total == 12 and 4 <= dealer <= 6):
        return "stand"
    return "hit"


class BlackjackGame(TextGame):
    """One Blackjack hand against a dealer who draws to 17 (infinite deck)."""

    ACTIONS = ("stand", "hit")
    image_shape = (CARD_TABLE_SIZE, CARD_TABLE_SIZE, 3)
    VISUAL_OBSERVATION = f"The dealer's cards and yours are shown in the image: {IMAGE_PLACEHOLDER}"
    TASK = (
        "Play one hand of Blackjack against the dealer. Get closer to 21 than the dealer without going over. "
        "'hit' draws a card, 'stand' ends your turn; the dealer then draws until reaching 17 or more. "
        "Number cards count their value, J, Q and K count 10, an ace counts 11 unless that makes you go over 21."
    )

    def __init__(self, expert: bool = True):
        self.expert = expert
        self.rng = np.random.default_rng(0)
        self.suit_rng = np.random.default_rng(0)  # the frame's suits: the ranks' draws stay those of text mode
        self.player: list[str] = []
        self.dealer: list[str] = []
        self.player_suits: list[str] = []
        self.dealer_suits: list[str] = []
        self.finished, self.outcome = False, ""

    def _draw(self, hand: list[str], suits: list[str]) -> None:
        hand.append(RANKS[int(self.rng.integers(13))])
        suits.append(SUITS[int(self.suit_rng.integers(4))])

    @staticmethod
    def _values(cards: list[str]) -> list[int]:
        return [card_value(c) for c in cards]

    def reset(self, seed: int) -> GameState:
        self.rng, self.suit_rng = np.random.default_rng(seed), np.random.default_rng([seed, 1])
        self.player, self.dealer, self.player_suits, self.dealer_suits = [], [], [], []
        for hand, suits in ((self.player, self.player_suits), (self.player, self.player_suits),
                            (self.dealer, self.dealer_suits), (self.dealer, self.dealer_suits)):
            self._draw(hand, suits)
        self.finished, self.outcome = False, ""
        return self._state()

    def step(self, action: str) -> tuple[GameState, float, bool, bool]:
        move = action.strip().lower() if isinstance(action, str) else ""
        if self.finished or move not in self.ACTIONS:
            return self._state(), 0.0, self.finished, self.outcome == "win"
        if move == "hit":
            self._draw(self.player, self.player_suits)
            if hand_value(self._values(self.player))[0] > 21:
                self.finished, self.outcome = True, "bust"
            return self._state(), 0.0, self.finished, False
        while hand_value(self._values(self.dealer))[0] < 17:
            self._draw(self.dealer, self.dealer_suits)
        mine, theirs = hand_value(self._values(self.player))[0], hand_value(self._values(self.dealer))[0]
        self.outcome = "win" if theirs > 21 or mine > theirs else "draw" if mine == theirs else "lose"
        self.finished = True
        won = self.outcome == "win"
        return self._state(), float(won), True, won

    def render_image(self) -> np.ndarray:
        def hand(cards, suits):  # a hand set by hand (tests) has no suits: spades
            return [(card, suits[k] if k < len(suits) else SUITS[0]) for k, card in enumerate(cards)]

        dealer = hand(self.dealer, self.dealer_suits)
        if not self.finished or self.outcome == "bust":
            dealer = [dealer[0], None]  # the hole card stays face down
        footer = {"bust": "Over 21: you lose", "win": "You win", "draw": "Draw", "lose": "You lose"}.get(self.outcome, "")
        return card_table([("Dealer", dealer), ("You", hand(self.player, self.player_suits))], footer=footer)

    def _state(self) -> GameState:
        total = hand_value(self._values(self.player))[0]
        text = f"Your cards: {', '.join(self.player)} (total {total}). "
        if self.finished and self.outcome != "bust":
            dealer_total = hand_value(self._values(self.dealer))[0]
            text += f"Dealer's cards: {', '.join(self.dealer)} (total {dealer_total}). "
        else:
            text += f"Dealer shows: {self.dealer[0]}. "
        if self.finished:
            text += {"bust": "You went over 21: you lose.", "win": "You win.", "draw": "It is a draw.",
                     "lose": "You lose."}[self.outcome]
        expert = ""
        if self.expert and not self.finished:
            expert = basic_strategy(self._values(self.player), card_value(self.dealer[0]))
        return GameState(observation=text.strip(), task=self.TASK, admissible_actions=self.ACTIONS,
                         expert_action=expert)


# ---------------------------------------------------------------------------------------- envs
class EZPointsEnv(TextEnv):
    """A batch of EZPoints games (8 steps). See :class:`~torchrl_agent.envs.base.TextEnv` for the keys."""

    def __init__(self, *, solvable_only: bool = True, expert: bool = True, max_steps: int = 8, **kwargs):
        super().__init__(lambda: EZPointsGame(solvable_only, expert), max_steps=max_steps, **kwargs)


class Points24Env(TextEnv):
    """A batch of Points24 games (20 steps). See :class:`~torchrl_agent.envs.base.TextEnv` for the keys."""

    def __init__(self, *, solvable_only: bool = True, expert: bool = True, max_steps: int = 20, **kwargs):
        super().__init__(lambda: Points24Game(solvable_only, expert), max_steps=max_steps, **kwargs)


class BlackjackEnv(TextEnv):
    """A batch of Blackjack hands (15 steps). See :class:`~torchrl_agent.envs.base.TextEnv` for the keys."""

    def __init__(self, *, expert: bool = True, max_steps: int = 15, **kwargs):
        super().__init__(lambda: BlackjackGame(expert), max_steps=max_steps, **kwargs)


# ------------------------------------------------------------------------------ prompts and parsing
register_template("ezpoints_short", (
    "Write a formula equal to 12 using each card once, one token at a time, then =.\n"
    "{history}\n"
    "{observation}"
))
register_template("cards", (
    "You play a card game one token at a time. First reason step by step inside <think> </think>, "
    "then answer with a JSON object such as {{\"action\": \"+\"}}.\n"
    "Your task: {task}\n"
    "{history}\n"
    "You have taken {step} steps. Current state: {observation}\n"
    "Admissible actions: {admissible_actions}"
))

# The reference's prompt texts (verl-agent, agent_system/environments/prompts/, upstream commit 796ed31), verbatim.
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
register_template("reference_blackjack", ReferenceTemplate(_BLACKJACK_TEMPLATE, _BLACKJACK_TEMPLATE, "none", image=True))
register_template("reference_ezpoints", ReferenceTemplate(_EZPOINTS_TEMPLATE, _EZPOINTS_TEMPLATE, "none", image=True))
register_template("reference_points24", ReferenceTemplate(_POINTS24_TEMPLATE, _POINTS24_TEMPLATE, "none", image=True))


register_format("reference_blackjack", gym_cards_rule(("stand", "hit")), expert="json")
_FORMULA_TOKENS = tuple(str(v) for v in range(1, 11))
register_format("reference_ezpoints", gym_cards_rule((*_FORMULA_TOKENS, "+", "*", "="), ten_first=True),
                expert="json")
register_format("reference_points24", gym_cards_rule((*_FORMULA_TOKENS, "+", "-", "*", "/", "(", ")", "="),
                                                     ten_first=True), expert="json")

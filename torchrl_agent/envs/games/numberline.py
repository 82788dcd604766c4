"""NumberLine (Gym Cards) as text: walk a marker to a target on the line ``0..max_position``.

Start and target are a distinct pair drawn from the seed (as gym-cards); ``min_distance`` and
``max_distance`` (ours, default: any pair) keep only pairs that far apart, which makes a long line a
task a random walk rarely solves (the learning benchmark's ``numberline`` task: 0..9,
distance 6..9, 12 steps).

Rules (as gym-cards' ``NumberLineEnv`` in verl-agent): actions ``-`` and ``+``; reward +1 on
reaching the target (the episode ends, solved), -1 for a move that does not get closer (also a
move into the end of the line), 0 otherwise; 10 steps at most. Any other action is a no-op with
reward ``invalid_reward`` (default 0: the reference's unparseable action, index -1).
``wrong_move_reward`` (ours, default the reference's -1) is the reward of a move that does not get
closer: 0 makes the reward sparse (+1 on arrival, nothing else), so a move's worth shows only in
the episode's end.

``stop_action`` (ours, default off) adds the action ``stop``: arriving no longer ends the episode, the
agent must say ``stop`` on the target (+1, solved); ``stop`` anywhere else ends the episode unsolved
with ``wrong_move_reward``, and a move off the target costs ``wrong_move_reward`` like any move that
does not get closer. A policy blind to the state then wins almost nothing: a constant move never
stops, where without ``stop`` it wins every game whose target lies on its side (about half).

``mirror`` (ours, default off) draws the line either way up, a fair coin each step (from the seed):
the moves are the view's (``+`` toward where the view's numbers grow: down the strip, right in the
relative text), so a move's effect on the line is the coin's. A policy that reads the view plays as
before; a policy blind to it moves the marker as a random walk whatever it answers, so no blind
policy, history-aware or not, wins more than the uniformly random policy (on the line it *is* one).
Needs ``observation="relative"`` and ``frame="strip"`` (an absolute position or the card table's
numbered ticks would not turn with the view).

``observation`` (ours) chooses how the state is written: ``"absolute"`` (the reference: "Position: 3.
Target: 8.", the move needs a comparison of two numbers) or ``"relative"`` ("The target is 5 steps to
your right.", the offset the way the BabyAI rendering gives its objects: a model reads the move off a
word). Both describe the same state; only the reading differs.

The frame (``modality="image"`` or ``"both"``), chosen by ``frame``: ``"table"`` (the reference's
card-table size, 300x300x3: the line with its ticks, the target a red flag and the position a blue
marker, :func:`~torchrl_agent.envs.games.images.numberline_frame`) or ``"strip"`` (ours: the line
seen from the marker, a column of one 28-pixel cell per offset, ``28(2 max_position + 1) x 28``: a few
image tokens, :func:`~torchrl_agent.envs.games.images.numberline_strip`). In image mode the
observation text only says where the image goes.
"""

from __future__ import annotations

import numpy as np

from torchrl_agent.envs.base import IMAGE_PLACEHOLDER, GameState, TextEnv, TextGame
from torchrl_agent.envs.games.images import CARD_TABLE_SIZE, STRIP_CELL, numberline_frame, numberline_strip
from torchrl_agent.envs.transforms.projection import gym_cards_rule, register_format
from torchrl_agent.envs.transforms.templates import TAGS_INSTRUCTION, ReferenceTemplate, register_template

__all__ = ["NumberLineGame", "NumberLineEnv"]


class NumberLineGame(TextGame):
    """One NumberLine episode. Start and target are distinct positions drawn from the seed."""

    ACTIONS = ("-", "+")
    STOP = "stop"

    OBSERVATIONS = ("absolute", "relative")
    FRAMES = ("table", "strip")
    image_shape = (CARD_TABLE_SIZE, CARD_TABLE_SIZE, 3)
    VISUAL_OBSERVATION = (f"The line is shown in the image, the target as a red flag and your position as a "
                          f"blue marker: {IMAGE_PLACEHOLDER}")
    STRIP_OBSERVATION = (f"The line is shown in the image as a column, its numbers growing downwards, seen from "
                         f"you: you are the blue cell in the middle, the target is the red cell: {IMAGE_PLACEHOLDER}")
    MIRROR_OBSERVATION = (f"The line is shown in the image as a column seen from you, drawn either way up: you are the "
                          f"blue cell in the middle, the target is the red cell; '+' moves you one cell down the column, "
                          f"'-' one cell up: {IMAGE_PLACEHOLDER}")

    def __init__(self, max_position: int = 5, min_distance: int = 1, max_distance: int | None = None,
                 invalid_reward: float = 0.0, observation: str = "absolute", frame: str = "table",
                 wrong_move_reward: float = -1.0, stop_action: bool = False, mirror: bool = False):
        if observation not in self.OBSERVATIONS:
            raise ValueError(f"NumberLine: observation must be one of {self.OBSERVATIONS}, got {observation!r}")
        if frame not in self.FRAMES:
            raise ValueError(f"NumberLine: frame must be one of {self.FRAMES}, got {frame!r}")
        if mirror and (observation, frame) != ("relative", "strip"):
            raise ValueError(f"NumberLine: mirror needs observation='relative' and frame='strip' (the views that turn "
                             f"with the line), got observation={observation!r}, frame={frame!r}")
        self.frame = frame
        if frame == "strip":
            self.image_shape = (STRIP_CELL * (2 * max_position + 1), STRIP_CELL, 3)
            self.VISUAL_OBSERVATION = self.MIRROR_OBSERVATION if mirror else self.STRIP_OBSERVATION
        if not 1 <= min_distance <= (max_distance or max_position) <= max_position:
            raise ValueError(f"NumberLine: need 1 <= min_distance ({min_distance}) <= max_distance "
                             f"({max_distance}) <= max_position ({max_position})")
        self.max_position, self.min_distance = max_position, min_distance
        self.max_distance = max_distance or max_position
        self.invalid_reward, self.observation = float(invalid_reward), observation
        self.wrong_move_reward = float(wrong_move_reward)
        self.stop_action = bool(stop_action)
        if self.stop_action:
            self.ACTIONS = (*self.ACTIONS, self.STOP)
            self.VISUAL_OBSERVATION = self.VISUAL_OBSERVATION.replace(
                f": {IMAGE_PLACEHOLDER}", f"; answer 'stop' on the target (it covers you and the line turns green): {IMAGE_PLACEHOLDER}")
        self.mirror = bool(mirror)
        self.orientation = 1  # the view's direction of growing numbers on the line: 1, or -1 under mirror half the steps
        self.position = self.target = 0
        self._rng = np.random.default_rng(0)

    def _turn(self) -> None:
        """``mirror``: a fair coin decides which way up the next view is drawn."""
        if self.mirror:
            self.orientation = 1 if self._rng.random() < 0.5 else -1

    def reset(self, seed: int) -> GameState:
        rng = np.random.default_rng(seed)
        while True:  # redraw until the distance is in [min_distance, max_distance] (the default: any pair)
            self.target, self.position = (int(x) for x in rng.choice(self.max_position + 1, size=2, replace=False))
            if self.min_distance <= abs(self.target - self.position) <= self.max_distance:
                self._rng = rng  # (start and target are drawn as without mirror: the same games)
                self._turn()
                return self._state()

    def step(self, action: str) -> tuple[GameState, float, bool, bool]:
        reward, done, success = self._move(action)
        self._turn()  # every step, a valid answer or not: a blind policy learns nothing from waiting
        return self._state(), reward, done, success

    def _move(self, action: str) -> tuple[float, bool, bool]:
        """The answer's reward, done and success; the marker moves by the view's direction."""
        before = abs(self.position - self.target)
        action = action.strip() if isinstance(action, str) else ""
        if self.stop_action and action == self.STOP:  # the episode ends here, solved only on the target
            return (1.0 if before == 0 else self.wrong_move_reward), True, before == 0
        move = {"-": -1, "+": 1}.get(action)
        if move is None:  # not an action: nothing happens (reward 0 in the reference)
            return self.invalid_reward, False, False
        self.position = min(max(self.position + move * self.orientation, 0), self.max_position)
        after = abs(self.position - self.target)
        if after == 0 and not self.stop_action:
            return 1.0, True, True
        return (0.0 if after < before else self.wrong_move_reward), False, False

    def render_image(self) -> np.ndarray:
        if self.frame == "strip":
            strip = numberline_strip(self.position, self.target, self.max_position)
            return strip if self.orientation == 1 else np.ascontiguousarray(strip[::-1])  # about the middle cell
        return numberline_frame(self.position, self.target, self.max_position)

    def _state(self) -> GameState:
        offset = (self.target - self.position) * self.orientation  # as the view shows it
        expert = "+" if offset > 0 else "-" if offset < 0 else self.STOP if self.stop_action else ""
        if self.observation == "absolute":
            text = f"Position: {self.position}. Target: {self.target}."
        elif offset:
            text = f"The target is {abs(offset)} step{'s' if abs(offset) != 1 else ''} to your {'right' if offset > 0 else 'left'}."
        else:
            text = "You are on the target."
        return GameState(
            observation=text,
            task=(f"Move the marker along the number line 0..{self.max_position} until it reaches the target"
                  + (", then answer 'stop'." if self.stop_action else ".")),
            admissible_actions=self.ACTIONS,
            expert_action=expert,
        )


class NumberLineEnv(TextEnv):
    """A batch of NumberLine games. See :class:`~torchrl_agent.envs.base.TextEnv` for the keys."""

    def __init__(self, *, max_position: int = 5, min_distance: int = 1, max_distance: int | None = None,
                 invalid_reward: float = 0.0, observation: str = "absolute", frame: str = "table",
                 wrong_move_reward: float = -1.0, stop_action: bool = False, mirror: bool = False,
                 max_steps: int = 10, **kwargs):
        args = (max_position, min_distance, max_distance, invalid_reward, observation, frame, wrong_move_reward,
                stop_action, mirror)
        NumberLineGame(*args)  # check the arguments now
        super().__init__(lambda: NumberLineGame(*args), max_steps=max_steps, **kwargs)


# ------------------------------------------------------------------------------ prompts and parsing
register_template("numberline", (
    "You move a marker on a number line. Answer '+' to move right or '-' to move left. " + TAGS_INSTRUCTION + "\n"
    "Your task: {task}\n"
    "{history}\n"
    "You have taken {step} steps. Current state: {observation}\n"
    "Admissible actions: {admissible_actions}"
))
register_template("numberline_short", (
    "Move the marker to the target: + right, - left.\n"
    "{observation}"
))

# The reference's prompt texts (verl-agent, agent_system/environments/prompts/, upstream commit 796ed31), verbatim.
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
register_template("reference_numberline", ReferenceTemplate(_NUMBERLINE_TEMPLATE, _NUMBERLINE_TEMPLATE, "none",
                                                     image=True))


register_format("reference_numberline", gym_cards_rule(("-", "+")), expert="json")

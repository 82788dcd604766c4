"""The text environment base: one batched TorchRL ``EnvBase`` over plain-Python games.

A :class:`TextGame` is one episode's rules, in plain Python with strings in and out. A
:class:`TextEnv` steps a batch of ``num_groups * group_size`` games and speaks the data
contract (the README's "The data contract"):

=====================  ===========  ==========================================================
key                    shape        meaning
=====================  ===========  ==========================================================
``task``               ``[B]`` str  the episode's goal text
``observation``        ``[B]`` str  the newest raw observation (no history, no template)
``admissible_actions`` ``[B]`` str  newline-joined list, ``""`` when free-form
``expert_action``      ``[B]`` str  a correct next action, ``""`` when no expert exists
``task_type``          ``[B]`` str  a label for per-type metrics (``""`` when the env has one type)
``anchor``             ``[B]``      int64 hash of the state for GiGPO grouping
``step_count``         ``[B, 1]``   int64 steps taken in the episode
``success``            ``[B, 1]``   bool, the episode is solved
``reward``             ``[B, 1]``   float32
``done``, ``terminated``, ``truncated``  ``[B, 1]`` bool, TorchRL conventions
``action``             ``[B]`` str  the env command (input)
``env_fault``          ``[B, 1]``   bool, the game raised in this step: its episode ends truncated
``pixels``             ``[B, H, W, 3]``  uint8 frame of the state (``modality="image"`` or ``"both"`` only)
=====================  ===========  ==========================================================

Modality: ``modality="text"`` (the default) writes the text keys only. ``"image"`` adds ``pixels``,
each game's frame drawn by :meth:`TextGame.render_image`, and the text says nothing about the state:
``observation`` is the game's :attr:`~TextGame.VISUAL_OBSERVATION`, a sentence with the image
placeholder ``<image>`` where the frame goes (the reference's visual templates), and ``task`` its
:attr:`~TextGame.VISUAL_TASK` where it has one (a sprite legend instead of the text symbols).
``"both"`` adds ``pixels`` and keeps the text: ``observation`` is the text observation followed by
the :attr:`~TextGame.VISUAL_OBSERVATION` line (so the prompt holds both the text and the frame's
placeholder), ``task`` the text mode's. The ``anchor`` is the hash of the text
state in every modality, so GiGPO groups the same states whatever the policy sees. (The option is
not called ``observation``: NumberLine's ``observation`` already chooses how its text is written.)
``blank_images=True`` is a control: every frame is black (same shape), so a policy that still
learns in image mode reads the state from somewhere else than the frame.

Group seeding: the ``group_size`` games of a group start from the same seed, so they share
their initial state. Training and evaluation seeds are disjoint: training episodes take even
seeds drawn from the env's generator, evaluation episodes take the odd seeds of a fixed panel
(episode ``j`` of the panel has seed ``2 * (base + j) + 1``), independent of the batch layout.

A game that is already done ignores further actions: the batch can be stepped as a whole while
the collector only generates for the games that still run.

Faults: a game whose ``step`` raises (a retrieval server that is down, a crashed simulator) or
returns a non-finite reward (NaN or infinite: :func:`checked_step`) does not stop the batch: that game's episode ends ``truncated`` with ``env_fault`` set, the reason is logged
and kept in ``fault_log``, and every other game goes on. The trainer leaves faulted episodes out
of the advantage groups and the loss.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, NonTensor, Unbounded
from torchrl.envs import EnvBase

__all__ = ["IMAGE_PLACEHOLDER", "MODALITIES", "TextGame", "GameState", "TextEnv", "checked_step", "clean_text",
           "stable_hash"]

logger = logging.getLogger(__name__)

#: The string keys a TextEnv writes at reset and step.
TEXT_KEYS = ("task", "observation", "admissible_actions", "expert_action", "task_type")
#: What a TextEnv shows: the text keys, ``pixels`` with a state-free text, or both.
MODALITIES = ("text", "image", "both")
#: Where the frame goes in an image-mode observation (the reference's placeholder).
IMAGE_PLACEHOLDER = "<image>"


def stable_hash(text: str) -> int:
    """A process-independent 63-bit hash of ``text`` (Python's ``hash`` is salted per process)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def clean_text(text) -> str:
    """``text`` as valid UTF-8 (lone surrogates become ``?``); a non-string becomes ``""``."""
    if not isinstance(text, str):
        return ""
    return text.encode("utf-8", "replace").decode("utf-8")


@dataclass
class GameState:
    """What a game shows after a reset or a step."""

    observation: str
    task: str = ""
    admissible_actions: tuple[str, ...] = ()
    expert_action: str = ""
    task_type: str = ""
    anchor: str | None = None  # text that identifies the state; defaults to ``observation``
    image: np.ndarray | None = None  # uint8 [H, W, 3], set by the env when it shows images


class TextGame(abc.ABC):
    """The rules of one episode, in plain Python.

    Subclasses implement :meth:`reset` and :meth:`step`. Any string is a legal input to
    :meth:`step`: an action the game does not understand is answered (usually as a no-op),
    never raised on.

    A game that can be seen sets :attr:`image_shape` and implements :meth:`render_image`; the env
    then offers ``modality="image"`` and ``"both"``.
    """

    #: ``(H, W, 3)`` of :meth:`render_image`'s frames; None: the game draws no image.
    image_shape: tuple[int, int, int] | None = None
    #: The observation text in image mode: where the frame goes, nothing about the state.
    VISUAL_OBSERVATION: str = f"The current state is shown in the image: {IMAGE_PLACEHOLDER}"
    #: The task text in image mode; None: the text mode's task.
    VISUAL_TASK: str | None = None

    @abc.abstractmethod
    def reset(self, seed: int) -> GameState:
        """Start a new episode whose whole randomness derives from ``seed``."""

    @abc.abstractmethod
    def step(self, action: str) -> tuple[GameState, float, bool, bool]:
        """Apply ``action``; return ``(state, reward, terminated, success)``."""

    def render_image(self) -> np.ndarray:
        """The current state as a uint8 ``[H, W, 3]`` RGB frame of :attr:`image_shape`."""
        raise NotImplementedError(f"{type(self).__name__} draws no image")


class TextEnv(EnvBase):
    """A batch of :class:`TextGame` s as one TorchRL environment.

    Args:
        game_factory: a callable returning a fresh :class:`TextGame`; called once per game.
        num_groups: number of groups ``G``.
        group_size: games per group ``n``; the batch size is ``[G * n]``.
        max_steps: an episode is truncated after this many steps.
        split: ``"train"`` (fresh even seeds every reset) or ``"eval"`` (the fixed odd panel).
        seed: seeds the training seed generator, and offsets the evaluation panel.
        modality: ``"text"``, ``"image"`` or ``"both"`` (see the module docstring); the images
            need a game with :attr:`TextGame.image_shape`.
        blank_images: every frame black (a control, see the module docstring); needs images.
    """

    batch_locked = True

    def __init__(
        self,
        game_factory: Callable[[], TextGame],
        *,
        num_groups: int = 1,
        group_size: int = 1,
        max_steps: int = 50,
        split: Literal["train", "eval"] = "train",
        seed: int = 0,
        modality: Literal["text", "image", "both"] = "text",
        blank_images: bool = False,
    ):
        if num_groups < 1 or group_size < 1:
            raise ValueError(f"num_groups and group_size must be >= 1, got {num_groups}, {group_size}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        super().__init__(batch_size=torch.Size([num_groups * group_size]))
        self.num_groups, self.group_size = num_groups, group_size
        self.max_steps, self.split = max_steps, split
        self.games = [game_factory() for _ in range(num_groups * group_size)]
        self.modality = modality
        self.image_shape, self.visual_task, self.visual_observation = visual_setup(self.games[0], modality)
        if blank_images and modality == "text":
            raise ValueError("blank_images=True blanks the frames of modality='image' or 'both'; modality is 'text'")
        self.blank_images = blank_images
        self._episodes_started = 0  # groups started so far (the eval panel's cursor)
        self._group_seeds = [0] * num_groups
        self._step_count = np.zeros(self.batch_size[0], dtype=np.int64)
        self._done = np.ones(self.batch_size[0], dtype=bool)
        self._success = np.zeros(self.batch_size[0], dtype=bool)
        self._states: list[GameState] = [GameState("")] * self.batch_size[0]
        self.fault_log: list[str] = []  # the reasons of the games' faults, oldest first
        self._make_specs()
        self.set_seed(seed)

    # ------------------------------------------------------------------ specs
    def _make_specs(self) -> None:
        B = self.batch_size

        def text():
            return NonTensor(shape=B, example_data="", dtype=None)

        self.observation_spec = Composite(
            **{key: text() for key in TEXT_KEYS},
            anchor=Unbounded(shape=B, dtype=torch.int64),
            step_count=Bounded(low=0, high=self.max_steps, shape=(*B, 1), dtype=torch.int64),
            success=Categorical(2, shape=(*B, 1), dtype=torch.bool),
            env_fault=Categorical(2, shape=(*B, 1), dtype=torch.bool),
            shape=B,
        )
        if self.modality != "text":
            self.observation_spec["pixels"] = Bounded(low=0, high=255, shape=(*B, *self.image_shape),
                                                      dtype=torch.uint8)
        self.action_spec = NonTensor(shape=B, example_data="", dtype=None)
        self.reward_spec = Unbounded(shape=(*B, 1), dtype=torch.float32)
        self.done_spec = Composite(
            {key: Categorical(2, shape=(*B, 1), dtype=torch.bool) for key in ("done", "terminated", "truncated")},
            shape=B,
        )

    # ------------------------------------------------------------------ seeding
    def _set_seed(self, seed: int | None) -> None:
        self._base_seed = int(seed or 0)
        self._rng = np.random.default_rng(self._base_seed)
        self._episodes_started = 0

    def _next_group_seed(self) -> int:
        if self.split == "eval":
            seed = 2 * (self._base_seed + self._episodes_started) + 1
        else:
            seed = 2 * int(self._rng.integers(0, 2**40))
        self._episodes_started += 1
        return seed

    def group_of(self, index: int) -> int:
        """The group of game ``index`` (games ``g*n .. g*n+n-1`` form group ``g``)."""
        return index // self.group_size

    @property
    def group_seeds(self) -> list[int]:
        """The seed each group's current episode started from."""
        return list(self._group_seeds)

    # ------------------------------------------------------------------ reset / step
    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        n = self.batch_size[0]
        mask = np.ones(n, dtype=bool)
        if tensordict is not None and "_reset" in tensordict.keys():
            mask = tensordict.get("_reset").reshape(n).cpu().numpy().astype(bool)
        for g in range(self.num_groups):
            members = slice(g * self.group_size, (g + 1) * self.group_size)
            if mask[members].all():  # a whole group restarts on a new task
                self._group_seeds[g] = self._next_group_seed()
            for i in np.flatnonzero(mask[members]) + g * self.group_size:
                self._states[i] = self.play(self.games[i], "reset", self._group_seeds[g])
                self._step_count[i] = 0
                self._done[i] = False
                self._success[i] = False
        td = self._observation_td(None, np.zeros(n, dtype=bool), np.zeros(n, dtype=bool))
        return td

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        n = self.batch_size[0]
        actions = _as_str_list(tensordict.get("action"), n)
        reward = np.zeros(n, dtype=np.float32)
        terminated = np.zeros(n, dtype=bool)
        truncated = np.zeros(n, dtype=bool)
        fault = np.zeros(n, dtype=bool)
        for i in range(n):
            if self._done[i]:  # finished earlier: the action is ignored, the state kept
                terminated[i] = True
                continue
            try:
                result = self.play(self.games[i], "step", actions[i])
            except Exception as err:  # the game failed: its episode ends here, the batch goes on
                self._fault(i, err)
                fault[i] = truncated[i] = self._done[i] = True
                continue
            self._record_step(i, result, reward, terminated, truncated)
        return self._observation_td(reward, terminated, truncated, fault)

    def play(self, game: TextGame, command: str, argument):
        """``game.reset(argument)`` (``command="reset"``, returns the state) or ``game.step(argument)``
        (returns ``(state, reward, terminated, success)``), the state with the game's frame when the
        env shows images. The env worker processes call it too, so the frame is drawn beside the game."""
        result = game.reset(argument) if command == "reset" else checked_step(game, argument)
        if self.modality == "text":
            return result
        image = np.zeros(self.image_shape, dtype=np.uint8) if self.blank_images else game.render_image()
        if command == "reset":
            return replace(result, image=image)
        return (replace(result[0], image=image), *result[1:])

    def _fault(self, i: int, err: BaseException) -> None:
        """Log and keep the reason game ``i`` failed (its episode is ended by the caller)."""
        reason = f"game {i}: {type(err).__name__}: {err}"
        self.fault_log.append(reason + "\n" + "".join(traceback.format_exception(err, limit=-3)))
        logger.warning("environment fault, episode truncated: %s", reason)

    def _record_step(self, i: int, result, reward, terminated, truncated) -> None:
        """Book game ``i``'s ``(state, reward, terminated, success)`` into the batch arrays."""
        state, r, term, success = result
        self._states[i] = state
        self._step_count[i] += 1
        reward[i] = r
        self._success[i] = bool(success)
        terminated[i] = bool(term)
        truncated[i] = not term and self._step_count[i] >= self.max_steps
        self._done[i] = terminated[i] or truncated[i]

    def _observation_td(self, reward, terminated, truncated, env_fault=None) -> TensorDictBase:
        B = self.batch_size
        states = self._states
        task, observation = [s.task for s in states], [s.observation for s in states]
        if self.modality == "image":  # the text says nothing about the state; the anchor below still does
            observation = [self.visual_observation] * B[0]
            task = [self.visual_task] * B[0] if self.visual_task else task
        elif self.modality == "both":  # the text state, then the sentence with the frame's placeholder
            observation = [f"{o}\n{self.visual_observation}" for o in observation]
        td = TensorDict(
            {
                "task": task,
                "observation": observation,
                "admissible_actions": ["\n".join(s.admissible_actions) for s in states],
                "expert_action": [s.expert_action for s in states],
                "task_type": [s.task_type for s in states],
                "anchor": torch.tensor(
                    [stable_hash(s.observation if s.anchor is None else s.anchor) for s in states],
                    dtype=torch.int64,
                ),
                "step_count": torch.from_numpy(self._step_count.copy()).unsqueeze(-1),
                "success": torch.from_numpy(self._success.copy()).unsqueeze(-1),
                "terminated": torch.from_numpy(terminated).unsqueeze(-1),
                "truncated": torch.from_numpy(truncated).unsqueeze(-1),
                "done": torch.from_numpy(terminated | truncated).unsqueeze(-1),
                "env_fault": torch.from_numpy(np.zeros(B[0], dtype=bool) if env_fault is None
                                              else env_fault).unsqueeze(-1),
            },
            batch_size=B,
        )
        if self.modality != "text":  # a game that never drew a frame (none so far) shows black
            blank = np.zeros(self.image_shape, dtype=np.uint8)
            td.set("pixels", torch.from_numpy(np.stack([blank if s.image is None else s.image for s in states])))
        if reward is not None:  # reset returns no reward (TorchRL convention)
            td.set("reward", torch.from_numpy(reward).unsqueeze(-1))
        else:  # a placeholder action (""): batched envs (ParallelEnv) expect every non-tensor key at reset
            td.set("action", [""] * B[0])
        return td

    @property
    def running(self) -> torch.Tensor:
        """Bool mask ``[B]`` of the games whose episode is still running."""
        return torch.from_numpy(~self._done)


def checked_step(game: TextGame, action: str) -> tuple:
    """``game.step(action)``; a reward that is not a finite number raises ``ValueError`` naming the
    game's class, so the episode ends as an env fault (a NaN reward would otherwise reach the
    advantages and the gradient)."""
    result = game.step(action)
    try:
        finite = math.isfinite(float(result[1]))
    except (TypeError, ValueError):
        finite = False
    if not finite:
        raise ValueError(f"{type(game).__name__}.step returned a non-finite reward {result[1]!r}")
    return result


def visual_setup(game: TextGame, modality: str) -> tuple[tuple[int, int, int] | None, str | None, str | None]:
    """``(image_shape, visual_task, visual_observation)`` of an env showing ``game`` in ``modality``
    (all None for ``"text"``); raises ``ValueError`` for an unknown modality or a game without images."""
    if modality not in MODALITIES:
        raise ValueError(f"modality must be one of {MODALITIES}, got {modality!r}")
    if modality == "text":
        return None, None, None
    if game.image_shape is None:
        raise ValueError(f"modality={modality!r}: {type(game).__name__} draws no image; use modality='text'")
    return tuple(game.image_shape), game.VISUAL_TASK, game.VISUAL_OBSERVATION


def _as_str_list(value, n: int) -> list[str]:
    """Read the ``action`` entry as ``n`` Python strings; anything else becomes ``""``."""
    if value is None:
        return [""] * n
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, str):
        value = [value] * n
    out = [clean_text(v) for v in list(value)]
    if len(out) != n:
        raise ValueError(f"expected {n} actions, got {len(out)}")
    return out

"""The text environments: specs, seeding, bad input, rules and rewards, experts."""

from __future__ import annotations

import math

import gymnasium
import numpy as np
import pytest
import torch
from torchrl.envs.utils import check_env_specs

from torchrl_agent.envs import TextEnv, make_env
from torchrl_agent.envs.games.babyai import BabyAIGame, parse_babyai_action, render_babyai
from torchrl_agent.envs.games.gym_cards import (
    BlackjackGame,
    EZPointsGame,
    Points24Game,
    basic_strategy,
    evaluate_formula,
    hand_value,
    solutions,
)
from torchrl_agent.envs.games.gymnasium_adapter import GymnasiumTextGame
from torchrl_agent.envs.games.numberline import NumberLineGame
from torchrl_agent.envs.games.sokoban import SokobanGame, generate_room, render_room, solve

ENVS = ["numberline", "ezpoints", "points24", "blackjack", "sokoban", "babyai", "webshop"]

GARBAGE = [
    "",
    "x" * 20_000,
    "\x00\x01\x7f\x1b[31m\r\n\t",
    "\ud800 lone surrogates \udfff",
    "inadmissible action please",
    "   UP   ",
    "🙂 =",
]


def _strings(td, key):
    return list(td[key]) if not isinstance(td[key], str) else [td[key]]


def _run_expert(env: TextEnv, max_steps: int) -> torch.Tensor:
    """Step ``env`` with its expert actions until every game is done; return the success mask."""
    td = env.reset()
    for _ in range(max_steps):
        td["action"] = _strings(td, "expert_action")
        td = env.step(td)["next"]
        if td["done"].all():
            break
    assert td["done"].all()
    return td["success"].squeeze(-1)


# ---------------------------------------------------------------------------------------- all envs
@pytest.mark.parametrize("name", ENVS)
def test_check_env_specs(name):
    env = make_env(name, num_groups=2, group_size=2, seed=3)
    check_env_specs(env)
    td = env.reset()
    for key in ("task", "observation", "admissible_actions", "expert_action", "task_type"):
        assert all(isinstance(s, str) for s in _strings(td, key)), key
    assert td["anchor"].dtype == torch.int64 and td["anchor"].shape == (4,)


@pytest.mark.parametrize("name", ENVS)
def test_garbage_actions_never_crash(name):
    env = make_env(name, num_groups=1, group_size=len(GARBAGE), seed=5)
    td = env.reset()
    for _ in range(3):
        td["action"] = GARBAGE
        td = env.step(td)["next"]
        assert torch.isfinite(td["reward"]).all()
        assert all(isinstance(s, str) and s for s in _strings(td, "observation"))


@pytest.mark.parametrize("name", ENVS)
def test_group_seeding(name):
    env = make_env(name, num_groups=4, group_size=3, seed=11)
    td = env.reset()
    obs = list(zip(_strings(td, "task"), _strings(td, "observation")))  # the initial state: task and page
    groups = [obs[g * 3 : (g + 1) * 3] for g in range(4)]
    for members in groups:
        assert len(set(members)) == 1  # a group shares its initial state
    assert len({members[0] for members in groups}) >= 2  # groups differ (4 fresh tasks)


@pytest.mark.parametrize("name", ENVS)
def test_train_eval_seeds_disjoint_and_panel_fixed(name):
    train = make_env(name, num_groups=3, group_size=1, seed=0)
    evaluation = make_env(name, num_groups=3, group_size=1, seed=0, split="eval")
    train_seeds, eval_seeds = set(), []
    for _ in range(2):
        train.reset()
        train_seeds.update(train.group_seeds)
        evaluation.reset()
        eval_seeds += evaluation.group_seeds
    assert all(s % 2 == 0 for s in train_seeds) and all(s % 2 == 1 for s in eval_seeds)
    assert eval_seeds == [1, 3, 5, 7, 9, 11]
    # the panel does not depend on the batch layout
    wide = make_env(name, num_groups=6, group_size=2, seed=0, split="eval")
    narrow = make_env(name, num_groups=3, group_size=1, seed=0, split="eval")
    wide_obs = _strings(wide.reset(), "observation")[::2]
    narrow_obs = _strings(narrow.reset(), "observation") + _strings(narrow.reset(), "observation")
    assert wide_obs == narrow_obs


def test_done_games_ignore_actions():
    env = make_env("ezpoints", num_groups=1, group_size=2, seed=0)
    td = env.reset()
    td["action"] = ["=", "1"]
    td = env.step(td)["next"]
    assert td["done"].squeeze(-1).tolist() == [True, False]
    frozen = _strings(td, "observation")[0]
    td["action"] = ["5", "1"]
    td = env.step(td)["next"]
    assert _strings(td, "observation")[0] == frozen and td["reward"][0].item() == 0.0


# ---------------------------------------------------------------------------------------- sokoban
def _room(rows: list[str]) -> SokobanGame:
    """A game in a hand-drawn room (the symbols of the text grid)."""
    game = SokobanGame(dim=(len(rows), len(rows[0])))
    walls, targets, boxes = set(), [], set()
    for r, row in enumerate(rows):
        for c, ch in enumerate(row):
            if ch == "#":
                walls.add((r, c))
            if ch in "O√S":
                targets.append((r, c))
            if ch in "X√":
                boxes.add((r, c))
            if ch in "PS":
                game.player = (r, c)
    game.walls, game.targets, game.boxes = frozenset(walls), tuple(sorted(targets)), frozenset(boxes)
    return game


def test_sokoban_rewards_by_hand():
    game = _room(["######",
                  "#P_XO#",
                  "#____#",
                  "######"])
    state, reward, term, success = game.step("up")  # into the wall: penalty, no move
    assert math.isclose(reward, -0.1) and not term and game.player == (1, 1)
    state, reward, *_ = game.step("jump")  # invalid
    assert math.isclose(reward, -0.1) and game.player == (1, 1)
    state, reward, *_ = game.step("right")  # walk
    assert math.isclose(reward, -0.1) and game.player == (1, 2)
    assert state.observation == "######\n#_PXO#\n#____#\n######" and state.anchor == state.observation
    state, reward, term, success = game.step(" RIGHT ")  # push onto the target: solved
    assert math.isclose(reward, -0.1 + 1 + 10) and term and success
    assert state.observation.splitlines()[1] == "#__P√#"

    game = _room(["#######",
                  "#P√__O#",
                  "#X____#",
                  "#######"])
    _, reward, term, _ = game.step("right")  # push the box off its target
    assert math.isclose(reward, -0.1 - 1) and not term
    _, reward, _, _ = game.step("right")  # floor to floor
    assert math.isclose(reward, -0.1)
    _, reward, term, success = game.step("right")  # onto the second target; the other box is still off
    assert math.isclose(reward, -0.1 + 1) and not success
    game2 = _room(["#####",
                   "#PX##",
                   "#__O#",
                   "#####"])
    _, reward, _, _ = game2.step("right")  # box against a wall: blocked
    assert math.isclose(reward, -0.1) and game2.player == (1, 1)


def test_sokoban_generation_is_deterministic_and_needs_moves():
    for seed in (0, 2, 4, 6, 8):
        room = generate_room(seed)
        assert room == generate_room(seed)
        walls, targets, boxes, player = room
        assert len(boxes) == 1 and boxes != frozenset(targets) and player not in walls | boxes
        grid = render_room(walls, targets, boxes, player, (6, 6)).splitlines()
        assert len(grid) == 6 and all(len(row) == 6 for row in grid)
        assert set("".join(grid)) <= set("#_OX√PS")
    assert generate_room(0) != generate_room(2)
    walls, targets, boxes, player = generate_room(1, dim=(8, 8), num_boxes=2)
    assert len(boxes) == 2 and len(targets) == 2
    assert solve(walls, targets, boxes, player) is not None  # reverse play only makes solvable rooms


def test_sokoban_expert_solves_rooms():
    env = make_env("sokoban", num_groups=6, group_size=1, seed=0)
    assert _run_expert(env, 15).all()
    game = SokobanGame()
    state = game.reset(10)
    plan = solve(game.walls, game.targets, game.boxes, game.player)
    assert state.expert_action == plan[0]
    # after a detour the expert replans from the new state
    state, *_ = game.step({"up": "down", "down": "up", "left": "right", "right": "left"}[plan[0]])
    replanned = solve(game.walls, game.targets, game.boxes, game.player)
    assert replanned is None or state.expert_action == replanned[0]


def test_sokoban_options_validated():
    with pytest.raises(ValueError, match="num_boxes"):
        make_env("sokoban", num_boxes=0)
    with pytest.raises(ValueError, match="dim"):
        make_env("sokoban", dim=(2, 6))


# ---------------------------------------------------------------------------------------- cards
def test_formula_parser():
    assert evaluate_formula("8 / ( 3 - 8 / 3 )".split()) == (24, [8, 3, 8, 3])
    assert evaluate_formula("2 + 3 * 4".split())[0] == 14
    assert evaluate_formula("10 - 2 - 3".split())[0] == 5
    for bad in ("", "( 3", "3 +", "3 4", "+ 3", "3 / ( 2 - 2 )", "3 )", "__import__('os')"):
        with pytest.raises(ValueError):
            evaluate_formula(bad.split())


def _play(game, cards, tokens):
    game.reset(0)
    game.cards, game.formula = list(cards), []
    total, out = 0.0, None
    for token in tokens:
        out = game.step(token)
        total += out[1]
    return total, out


def test_ezpoints_rewards_by_hand():
    game = EZPointsGame()
    assert _play(game, ["4", "8"], ["4", "+", "8", "="])[0] == 10.0
    reward, (state, _, term, success) = _play(game, ["4", "8"], ["4", "*", "8", "="])
    assert reward == 0.0 and term and not success
    assert _play(game, ["K", "2"], ["2", "+", "10", "="])[0] == 10.0  # K counts 10
    assert _play(game, ["6", "6"], ["6", "+", "6", "="])[0] == 10.0
    assert _play(game, ["3", "4"], ["12", "="])[0] == 0.0  # "12" is not a token: ignored, then "=" on empty
    reward, (state, _, term, _) = _play(game, ["3", "4"], ["3", "-", "*", "4"])  # "-" is not an EZPoints action
    assert reward == 0.0 and not term and state.observation.endswith("3 * 4")
    assert _play(game, ["3", "4"], ["3", "*", "4", "="])[0] == 10.0
    assert _play(game, ["2", "10"], ["10", "+", "2", "+", "=",])[0] == 0.0  # malformed formula


def test_formula_games_reject_numbers_not_on_the_cards_or_used_up():
    # gym-cards' _is_valid_action: a number must be the value of a card not yet typed
    game = EZPointsGame()
    reward, (state, _, term, _) = _play(game, ["3", "4"], ["5", "3", "3", "*", "4"])
    assert reward == 0.0 and not term and game.formula == ["3", "*", "4"]  # 5 not dealt, the second 3 used up
    assert _play(game, ["6", "6"], ["6", "+", "6", "="])[0] == 10.0  # two cards of one value: twice
    assert _play(game, ["A", "J"], ["1", "10", "+", "10"])[1][0].observation.endswith("Formula so far: 1 10 +")
    game24 = Points24Game()
    _play(game24, ["8", "3", "8", "3"], ["8", "8", "8", "2", "3"])
    assert game24.formula == ["8", "8", "3"]


def test_numberline_rewards_by_hand():
    game = NumberLineGame(max_position=5)
    game.reset(0)
    game.position, game.target = 2, 4
    assert game.step("+")[1:] == (0.0, False, False)  # closer
    assert game.step("-")[1:] == (-1.0, False, False)  # farther
    assert game.step("jump")[1:] == (0.0, False, False) and game.position == 2  # not an action: 0, no move
    assert game.step("")[1] == 0.0 and game.step(None)[1] == 0.0
    game.position, game.target = 0, 3
    assert game.step("-")[1] == -1.0 and game.position == 0  # into the end of the line: not closer
    game.position = 1
    assert game.step(" + ")[1] == 0.0 and game.step("+")[1:] == (1.0, True, True)
    # sparse (wrong_move_reward=0): only arriving pays, a move away or into the end costs nothing
    sparse = NumberLineGame(max_position=5, wrong_move_reward=0.0, invalid_reward=-1.0)
    sparse.reset(0)
    sparse.position, sparse.target = 0, 2
    assert sparse.step("-")[1:] == (0.0, False, False) and sparse.position == 0
    assert sparse.step("+")[1] == 0.0 and sparse.step("-")[1] == 0.0 and sparse.step("?")[1] == -1.0
    assert sparse.step("+")[1] == 0.0 and sparse.step("+")[1:] == (1.0, True, True)


def test_numberline_stop_action_by_hand():
    """stop_action=True: arriving does not end the episode, 'stop' does (solved only on the target); a
    move off the target costs like any move that does not get closer, and a blind constant move never
    wins (without 'stop' it wins every game whose target lies on its side)."""
    game = NumberLineGame(max_position=5, stop_action=True)
    assert game.reset(0).admissible_actions == ("-", "+", "stop")
    assert NumberLineGame(max_position=5).reset(0).admissible_actions == ("-", "+")  # the class keeps the reference's
    game.position, game.target = 2, 4
    assert game.step("stop")[1:] == (-1.0, True, False)  # off the target: lost
    game.position = 3
    state, reward, done, success = game.step("+")
    assert (reward, done, success) == (0.0, False, False) and state.expert_action == "stop"
    assert state.observation == "Position: 4. Target: 4."
    assert game.step("+")[1:] == (-1.0, False, False) and game.step("-")[1:] == (0.0, False, False)
    assert game.step(" stop ")[1:] == (1.0, True, True)
    for move in ("-", "+"):  # a constant move from any start never wins
        game.reset(1)
        assert not any(game.step(move)[3] for _ in range(12))


def test_numberline_mirror_draws_the_view_either_way_up_whatever_the_answers():
    """mirror=True: the same games (start, target) as without it; each step a coin from the seed draws
    the view either way up and '+' moves toward where the view's numbers grow, so the expert (who
    reads the view) still walks straight to the target. The coins do not depend on the answers: a
    policy blind to the view moves the marker by +-1 at random whatever it says."""
    kwargs = dict(max_position=9, min_distance=6, observation="relative", frame="strip")
    plain, mirrored = NumberLineGame(**kwargs), NumberLineGame(mirror=True, **kwargs)
    orientations = set()
    for seed in range(8):
        plain.reset(seed), mirrored.reset(seed)
        assert (mirrored.position, mirrored.target) == (plain.position, plain.target)
        coins = {}
        for answers in (["+"] * 12, ["-"] * 12, ["?", "+", "-"] * 4):  # the same seed, other answers
            mirrored.reset(seed)
            seen = [mirrored.orientation]
            for answer in answers:
                position = mirrored.position
                _, _, done, _ = mirrored.step(answer)
                step = {"+": 1, "-": -1}.get(answer, 0) * seen[-1]  # the move, turned by the view it was made in
                assert mirrored.position == min(max(position + step, 0), 9) or done
                if done:
                    break
                seen.append(mirrored.orientation)
            coins[tuple(answers)] = seen
        first, *others = coins.values()
        assert all(c == first[:len(c)] or first == c[:len(first)] for c in others)
        orientations.update(first)
        state = mirrored.reset(seed)
        for _ in range(9):  # the expert, reading the view, never moves away
            offset = int(state.observation.split()[3]) * (1 if state.observation.endswith("right.") else -1)
            assert state.expert_action == ("+" if offset > 0 else "-")
            assert offset == (mirrored.target - mirrored.position) * mirrored.orientation
            state, reward, done, success = mirrored.step(state.expert_action)
            assert reward >= 0
            if done:
                break
        assert success
    assert orientations == {1, -1}
    with pytest.raises(ValueError, match="mirror needs observation='relative' and frame='strip'"):
        NumberLineGame(mirror=True, observation="relative")  # the card table's numbered ticks would not turn


def test_points24_rewards_by_hand():
    game = Points24Game()
    assert _play(game, ["8", "3", "8", "3"], "8 / ( 3 - 8 / 3 ) =".split())[0] == 10.0
    assert _play(game, ["Q", "2", "A", "A"], "10 * 2 + 1 + 1 =".split())[0] == 0.0  # 22
    assert _play(game, ["6", "6", "6", "6"], "6 + 6 + 6 + 6 =".split())[0] == 10.0
    assert _play(game, ["6", "6", "6", "6"], "6 * 4 =".split())[0] == 0.0  # does not use the cards


def test_formula_experts_solve_solvable_deals():
    assert solutions((3, 3, 8, 8), 24, ("+", "-", "*", "/", "("))[0] == tuple("8 / ( 3 - 8 / 3 )".split())
    assert solutions((1, 1, 1, 1), 24, ("+", "-", "*", "/", "(")) == ()
    for name, steps in (("ezpoints", 8), ("points24", 20)):
        env = make_env(name, num_groups=8, group_size=1, seed=1)
        assert _run_expert(env, steps).all(), name
    # the expert follows what has been typed, and gives up on a dead end
    game = Points24Game()
    game.reset(0)
    game.cards, game.formula = ["8", "3", "8", "3"], ["8", "/"]
    assert game.expert_action() == "("
    game.formula = ["3", "+", "3"]
    assert game.expert_action() == ""


def test_unsolvable_deals_allowed_when_asked():
    game = Points24Game(solvable_only=False)
    unsolvable = 0
    for seed in range(0, 120, 2):
        state = game.reset(seed)
        unsolvable += not solutions(game.values, 24, game._solver_ops)
        assert state.expert_action != "" or not solutions(game.values, 24, game._solver_ops)
    assert unsolvable > 0


def test_blackjack_rules_by_hand():
    assert hand_value([1, 6]) == (17, True) and hand_value([1, 6, 10]) == (17, False)
    assert basic_strategy([10, 6], 10) == "hit" and basic_strategy([10, 6], 5) == "stand"
    assert basic_strategy([1, 7], 9) == "hit" and basic_strategy([1, 7], 8) == "stand"
    assert basic_strategy([10, 2], 3) == "hit" and basic_strategy([10, 2], 4) == "stand"
    game = BlackjackGame()
    game.reset(0)
    game.player, game.dealer = ["10", "9"], ["10", "8"]  # dealer stands on 18, player 19 wins
    state, reward, term, success = game.step("stand")
    assert (reward, term, success) == (1.0, True, True) and "You win" in state.observation
    game.reset(0)
    game.player, game.dealer = ["10", "7"], ["10", "8"]
    assert game.step("STAND ")[1:] == (0.0, True, False)
    game.reset(0)
    game.player, game.dealer = ["10", "9"], ["10", "9"]  # a draw is not a win
    assert game.step("stand")[1:] == (0.0, True, False)
    game.reset(0)
    game.player = ["10", "Q", "A"]  # 21: any hit busts
    state, reward, term, success = game.step("hit")
    assert (reward, term, success) == (0.0, True, False) and "over 21" in state.observation
    game.reset(0)
    assert game.step("double down")[1:] == (0.0, False, False)  # not an action: no-op


def test_blackjack_expert_beats_random():
    def win_rate(policy) -> float:
        game, wins = BlackjackGame(), 0
        rng = np.random.default_rng(0)
        for seed in range(0, 800, 2):
            state = game.reset(seed)
            for _ in range(15):
                state, reward, term, _ = game.step(policy(state, rng))
                if term:
                    break
            wins += reward
        return wins / 400

    expert = win_rate(lambda state, rng: state.expert_action)
    random = win_rate(lambda state, rng: ("stand", "hit")[int(rng.integers(2))])
    assert expert > random + 0.05 and 0.35 < expert < 0.5


# ---------------------------------------------------------------------------------------- gymnasium / BabyAI
def test_gymnasium_adapter_frozenlake():
    moves = {"left": 0, "down": 1, "right": 2, "up": 3}

    def game():
        return GymnasiumTextGame(
            lambda: gymnasium.make("FrozenLake-v1", is_slippery=False),
            render_observation=lambda obs: f"You are on cell {int(obs)} of a 4x4 lake.",
            parse_action=lambda text: moves.get(text.strip().lower()),
            admissible_actions=tuple(moves),
            task="Reach the goal (cell 15) without falling into a hole.",
            invalid_action_reward=-0.5,
        )

    env = TextEnv(game, num_groups=1, group_size=2, max_steps=10)
    check_env_specs(env)
    td = env.reset()
    td["action"] = ["fly", "right"]
    td = env.step(td)["next"]
    assert td["reward"].squeeze(-1).tolist() == [-0.5, 0.0]
    assert _strings(td, "observation") == ["You are on cell 0 of a 4x4 lake.", "You are on cell 1 of a 4x4 lake."]
    # the shortest path on the non-slippery 4x4 map: down, down, right, down, right, right... solved
    g = game()
    g.reset(0)
    for action in ["down", "down", "right", "right", "down"]:
        _, reward, term, success = g.step(action)
        assert not term
    _, reward, term, success = g.step("right")
    assert (reward, term, success) == (1.0, True, True)


def test_babyai_text_and_actions():
    game = BabyAIGame("BabyAI-GoToLocal-v0")
    state = game.reset(0)
    assert state.task.startswith("go to the ")
    assert state.observation.startswith("You are facing ") and "You see a " in state.observation
    color, kind = state.task.split()[-2:]
    assert f"a {color} {kind} " in state.observation  # this seed's target is in view
    assert parse_babyai_action(" Turn   LEFT ") == 0 and parse_babyai_action("fly") is None
    before = state.observation
    state, reward, term, success = game.step("\ud800" * 3)  # invalid: no env step
    assert (reward, term, success) == (0.0, False, False) and state.observation == before
    state, *_ = game.step("turn left")
    assert state.observation != before
    # rendering of a hand-made view: a red ball two ahead, a wall beyond
    image = np.ones((7, 7, 3), dtype=np.uint8)
    image[:, :, 1:] = 0
    image[3, 4] = (6, 0, 0)
    image[3, 2] = (2, 5, 0)
    text = render_babyai({"image": image, "direction": 3})
    assert "facing north" in text and "a red ball 2 steps forward" in text
    assert "Cells ahead: 1 free, then a red ball" in text and "carrying nothing" in text


def test_babyai_bot_solves_levels():
    env = make_env("babyai", num_groups=4, group_size=1, seed=0)
    assert _run_expert(env, 64).all()
    env = make_env("babyai", num_groups=2, group_size=1, seed=0, level="BabyAI-PickupLoc-v0")
    assert _run_expert(env, 64).all()
    with pytest.raises(ValueError, match="level"):
        make_env("babyai", level="BabyAI-NoSuchLevel-v0")


def test_babyai_action_subset():
    """``actions``: only those moves are admissible and valid; the bot still solves GoToObj with the
    three navigation moves; an unknown move name fails at construction."""
    moves = ["turn left", "turn right", "go forward"]
    env = make_env("babyai", num_groups=8, group_size=1, seed=0, level="BabyAI-GoToObj-v0", actions=moves)
    td = env.reset()
    assert list(td["admissible_actions"]) == ["\n".join(moves)] * 8
    assert _run_expert(env, 32).all()
    game = BabyAIGame("BabyAI-GoToObj-v0", actions=moves)
    before = game.reset(0).observation
    for outside in ("pick up", "done", "toggle"):  # moves of the level, not of this agent: invalid, no env step
        state, reward, term, success = game.step(outside)
        assert (reward, term, success) == (0.0, False, False) and state.observation == before
    assert game.step("left")[0].observation != before  # the short name of an allowed move still parses
    with pytest.raises(ValueError, match="fly"):
        make_env("babyai", actions=["turn left", "fly"])


def test_babyai_distance_shaping_telescopes_to_the_start_distance():
    """``shaping="distance"``: over any episode that reaches the goal the shaping terms add up to
    the start's BFS distance (a potential difference); the bot never beats that distance; a turn and
    the turn back cancel out; an invalid answer costs ``invalid_reward``; a non-GoTo level is refused."""
    from torchrl_agent.envs.games.babyai import goto_distance

    game = BabyAIGame("BabyAI-GoToObj-v0", shaping="distance", invalid_reward=-1.0)
    plain = BabyAIGame("BabyAI-GoToObj-v0")
    for seed in range(12):
        state = game.reset(seed)
        plain.reset(seed)
        start, total, level_total, moves = goto_distance(game.env), 0.0, 0.0, 0
        while True:
            action = state.expert_action
            state, reward, done, success = game.step(action)
            total += reward
            level_total += plain.step(action)[1]
            moves += 1
            if done:
                break
        assert success and moves >= start
        assert abs(total - level_total - start) < 1e-9
    state = game.reset(0)
    assert game.step("fly")[1] == -1.0  # invalid: the configured reward, no env step, no shaping
    d = goto_distance(game.env)
    _, away, *_ = game.step("turn left")
    _, back, *_ = game.step("turn right")
    assert away + back == 0.0 and {away, back} <= {-1.0, 0.0, 1.0}
    assert goto_distance(game.env) == d
    with pytest.raises(ValueError, match="GoTo"):
        BabyAIGame("BabyAI-PickupLoc-v0", shaping="distance").reset(0)
    with pytest.raises(ValueError, match="shaping"):
        make_env("babyai", shaping="manhattan")

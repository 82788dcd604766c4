"""ALFWorld through the real TextWorld engine: the one real game, garbage actions, group seeding, the generator."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from conftest import SHARED_DATA
from torchrl.envs.utils import check_env_specs

pytest.importorskip("alfworld", reason="needs the 'alfworld' extra")  # installed in CI: never skipped there

from torchrl_agent.envs import make_env  # noqa: E402
from torchrl_agent.envs.alfworld import (  # noqa: E402
    TASK_TYPES,
    ALFWorldEnv,
    ALFWorldGame,
    find_game_files,
    task_type_of,
)

REAL_DATA = str(SHARED_DATA / "alfworld")
REAL_GAME = "json_2.1.1/train/pick_heat_then_place_in_recep-Potato-None-SinkBasin-14/trial_T20190908_231731_054988"


@pytest.fixture(scope="module")
def real_data_dir(tmp_path_factory):
    """A writable copy of the real game, in ALFWorld's layout (the shared data is read-only)."""
    source = os.environ.get("ALFWORLD_REAL_DATA", REAL_DATA)
    if not os.path.isdir(os.path.join(source, REAL_GAME)):
        pytest.fail(f"the real ALFWorld game is missing: {os.path.join(source, REAL_GAME)}")
    root = tmp_path_factory.mktemp("alfworld_real")
    shutil.copytree(os.path.join(source, REAL_GAME), root / REAL_GAME)
    return str(root)


def _step(env, td, actions):
    td = td.clone(False)
    td["action"] = list(actions)
    return env.step(td)["next"]


def test_real_game_expert_wins(real_data_dir):
    env = make_env("alfworld", data_dir=real_data_dir, num_groups=1, group_size=2, seed=0)
    td = env.reset()
    # known facts of this game: 23 admissible commands at the start (22 listed: "help" is left out, as the
    # reference does), the hand-coded expert wins in 16 steps
    assert [len(a.split("\n")) for a in td["admissible_actions"]] == [22, 22]
    assert all("help" not in a.split("\n") for a in td["admissible_actions"])
    assert td["observation"][0].startswith("You are in the middle of a room. Looking quickly around you, you see")
    assert "a microwave 1" in td["observation"][0] and "Welcome" not in td["observation"][0]
    assert td["task"][0] == "put a hot potato in sinkbasin."
    assert list(td["task_type"]) == ["pick_heat_then_place_in_recep"] * 2
    assert td["observation"][0] == td["observation"][1]
    assert td["anchor"][0] == td["anchor"][1]
    assert sys.argv[0] != "translate.py"  # the engine's sys.argv hack is undone
    steps = 0
    while not td["done"].all():
        expert = list(td["expert_action"])
        assert all(e in a.split("\n") for e, a in zip(expert, td["admissible_actions"]))
        td = _step(env, td, expert)
        steps += 1
        assert steps <= 50
    assert steps == 16
    assert td["success"].all() and td["terminated"].all() and not td["truncated"].any()
    assert td["reward"].flatten().tolist() == [10.0, 10.0]
    assert td["step_count"].flatten().tolist() == [16, 16]
    assert td["observation"][0] == "You move the potato 1 to the sinkbasin 1."


def test_real_game_specs_and_garbage(real_data_dir):
    env = make_env("alfworld", data_dir=real_data_dir, num_groups=1, group_size=2, seed=1)
    check_env_specs(env)
    td = env.reset()
    start_actions = td["admissible_actions"][0]
    garbage = ["", "x" * 20_000, "\x00\x01\x1b[31m\n\t\x7f", "🤖 ünïcödé 中文 \u202e", "go to", "take potato 1 from", "open"]
    for action in garbage:
        td = _step(env, td, [action, "inventory"])
        assert td["observation"][0] == "Nothing happens."
        assert td["observation"][1] == "You are not carrying anything."
        assert td["admissible_actions"][0] == start_actions
        assert td["reward"].sum() == 0 and not td["done"].any()
    assert td["step_count"].flatten().tolist() == [len(garbage)] * 2
    # the game still plays after the garbage (surrounding spaces are ignored by the engine)
    td = _step(env, td, ["  go to microwave 1 ", "look"])
    assert td["observation"][0] == "You arrive at microwave 1. The microwave 1 is closed."
    assert td["expert_action"][0] in td["admissible_actions"][0].split("\n")


def test_truncation_at_max_steps(real_data_dir):
    env = ALFWorldEnv(data_dir=real_data_dir, max_steps=3, expert=False)
    td = env.reset()
    assert td["expert_action"][0] == ""
    for _ in range(3):
        td = _step(env, td, ["look"])
    assert td["truncated"].all() and td["done"].all() and not td["success"].any()


def test_explicit_game_files_and_bad_arguments(real_data_dir, tmp_path):
    files = find_game_files(real_data_dir, "train")
    assert len(files) == 1 and files[0].endswith("game.tw-pddl")
    assert find_game_files(real_data_dir, "train", task_types=["pick_and_place_simple"]) == []
    env = ALFWorldEnv(game_files=files, split="eval", num_groups=2, group_size=1)
    td = env.reset()
    assert td["task"][0] == td["task"][1] == "put a hot potato in sinkbasin."
    with pytest.raises(FileNotFoundError, match="valid_unseen"):
        ALFWorldEnv(data_dir=real_data_dir, split="eval")
    with pytest.raises(ValueError, match="task_types"):
        ALFWorldEnv(data_dir=real_data_dir, task_types=["make_coffee"])
    with pytest.raises(ValueError, match="no ALFWorld game"):
        ALFWorldEnv(data_dir=real_data_dir, task_types=["pick_and_place_simple"])
    with pytest.raises(FileNotFoundError, match="game_files"):
        ALFWorldEnv(game_files=[str(tmp_path / "missing.tw-pddl")])
    with pytest.raises(ValueError, match="empty"):
        ALFWorldGame([])


def test_group_seeding_picks_one_game_per_group(real_data_dir, tmp_path):
    # two copies of the real game under different names: groups pick games by seed, members share one
    root = tmp_path / "two"
    for name in ("pick_heat_then_place_in_recep-Potato-None-SinkBasin-14", "pick_heat_then_place_in_recep-Potato-None-SinkBasin-15"):
        shutil.copytree(os.path.join(real_data_dir, REAL_GAME), root / "json_2.1.1" / "train" / name / "trial_T0")
    env = ALFWorldEnv(data_dir=str(root), num_groups=4, group_size=3, seed=3, expert=False)
    env.reset()
    played = env.current_game_files
    for g in range(4):
        assert len(set(played[3 * g: 3 * g + 3])) == 1
    seeds = env.group_seeds
    assert all(s % 2 == 0 for s in seeds)
    assert [played[3 * g] for g in range(4)] == [env.game_files[(s // 2) % 2] for s in seeds]
    assert torch.equal(env.reset()["step_count"], torch.zeros(12, 1, dtype=torch.int64))


# ------------------------------------------------------------------------------------- generator
GEN_SEED = 0


@pytest.fixture(scope="module")
def generated_root(tmp_path_factory):
    from torchrl_agent.envs.alfworld.generator import generate_games

    root = tmp_path_factory.mktemp("alfworld_gen")
    generate_games(root, split="train", games_per_type=1, seed=GEN_SEED)
    generate_games(root, split="valid_unseen", task_types=["pick_and_place_simple", "look_at_obj_in_light"],
                   games_per_type=1, seed=GEN_SEED)
    return str(root)


def _floor_plan(game_file):
    with open(os.path.join(os.path.dirname(game_file), "traj_data.json")) as f:
        return json.load(f)["scene"]["scene_num"]


def test_generated_games_layout_and_splits(generated_root):
    import alfworld.gen.constants as constants
    from alfworld.info import ALFRED_PDDL_PATH

    train = find_game_files(generated_root, "train")
    valid = find_game_files(generated_root, "valid_unseen")
    assert len(train) == 6 and len(valid) == 2
    assert sorted(task_type_of(f) for f in train) == sorted(TASK_TYPES)
    with open(ALFRED_PDDL_PATH) as f:
        domain = f.read()
    for game_file in train + valid:
        relative = os.path.relpath(game_file, generated_root).split(os.sep)
        assert relative[:2] == ["json_2.1.1", relative[1]] and relative[-1] == "game.tw-pddl" and len(relative) == 5
        with open(game_file) as f:
            game = json.load(f)
        assert game["pddl_domain"] == domain and game["solvable"] is True
        assert 1 <= len(game["walkthrough"]) <= 50
        assert "UNKNOWN GOAL" not in game["grammar"] and "(:goal" in game["pddl_problem"]
        with open(os.path.join(os.path.dirname(game_file), "traj_data.json")) as f:
            traj = json.load(f)
        assert traj["task_type"] == task_type_of(game_file)
        assert set(traj["pddl_params"]) >= {"object_target", "parent_target", "toggle_target", "mrecep_target"}
    train_scenes = {_floor_plan(f) for f in train}
    valid_scenes = {_floor_plan(f) for f in valid}
    assert train_scenes <= set(constants.TRAIN_SCENE_NUMBERS)
    assert valid_scenes <= set(constants.TEST_SCENE_NUMBERS)
    assert not train_scenes & valid_scenes


def test_generated_games_are_won_by_the_expert_through_the_env(generated_root):
    # the evaluation panel walks the games in order: 6 groups play the 6 training games once each
    env = ALFWorldEnv(data_dir=generated_root, split="eval", eval_split="train", num_groups=6, group_size=1)
    td = env.reset()
    assert sorted(td["task_type"]) == sorted(TASK_TYPES)
    assert len(set(env.current_game_files)) == 6
    walkthroughs = []
    for game_file in env.current_game_files:
        with open(game_file) as f:
            walkthroughs.append(json.load(f)["walkthrough"])
    for i in range(6):
        assert td["observation"][i].startswith("You are in the middle of a room.")
        assert td["task"][i] and td["expert_action"][i] == "look"
    steps, returns = 0, torch.zeros(6)
    while not td["done"].all():
        td = _step(env, td, td["expert_action"])
        returns += td["reward"].flatten()
        steps += 1
        assert steps <= 50
    assert td["success"].all() and returns.tolist() == [10.0] * 6
    # the stored walkthroughs (the expert's commands at generation) replay to a win, step for step
    env.set_seed(0)
    td = env.reset()
    for t in range(max(len(w) for w in walkthroughs)):
        td = _step(env, td, [w[t] if t < len(w) else "look" for w in walkthroughs])
        for i, w in enumerate(walkthroughs):
            if t == len(w) - 1:
                assert td["success"][i].item() and td["reward"][i].item() == 10.0
    assert td["step_count"].flatten().tolist() == [len(w) for w in walkthroughs]


def test_generator_writes_an_in_distribution_valid_seen_split(tmp_path):
    import alfworld.gen.constants as constants

    from torchrl_agent.envs.alfworld.generator import generated_data_dir

    kwargs = dict(task_types=["pick_and_place_simple"], cache_dir=tmp_path)
    train = ALFWorldEnv(expert=False, generated_games_per_type=1, **kwargs)
    # the eval env asks for valid_seen: it is added to the cached root
    seen = ALFWorldEnv(split="eval", eval_split="valid_seen", expert=False, generated_games_per_type=1, **kwargs)
    root = generated_data_dir(games_per_type=1, **kwargs)
    assert os.path.isfile(os.path.join(root, "DONE-valid_seen"))
    assert seen.game_files == find_game_files(root, "valid_seen") and len(seen.game_files) == 1
    assert _floor_plan(seen.game_files[0]) in constants.TRAIN_SCENE_NUMBERS  # a training scene ...
    with open(seen.game_files[0]) as f, open(train.game_files[0]) as g:
        assert json.load(f)["pddl_problem"] != json.load(g)["pddl_problem"]  # ... but not a training game
    assert train.game_files == find_game_files(root, "train")  # the training games are unchanged
    td = seen.reset()
    assert td["task_type"][0] == "pick_and_place_simple" and td["task"][0]


def test_generator_is_deterministic_and_cached(tmp_path):
    from torchrl_agent.envs.alfworld.generator import generated_data_dir, make_game, scene

    assert scene(14) == scene(14)
    a, b = make_game(14, "pick_heat_then_place_in_recep", seed=5), make_game(14, "pick_heat_then_place_in_recep", seed=5)
    assert a == b
    c = make_game(14, "pick_heat_then_place_in_recep", seed=6)
    assert c["game"]["pddl_problem"] != a["game"]["pddl_problem"]
    assert make_game(301, "pick_heat_then_place_in_recep", seed=5) is None  # a bedroom has no microwave
    with pytest.raises(ValueError, match="task_type"):
        make_game(14, "make_coffee", seed=0)
    # no data_dir: games are generated on first use, then read from the cache
    env = ALFWorldEnv(cache_dir=tmp_path, generated_games_per_type=1, task_types=["pick_and_place_simple"],
                      expert=False)
    root = generated_data_dir(games_per_type=1, task_types=["pick_and_place_simple"], cache_dir=tmp_path)
    assert os.path.isfile(os.path.join(root, "DONE"))
    assert env.game_files == find_game_files(root, "train")
    first = os.path.getmtime(env.game_files[0])
    again = ALFWorldEnv(cache_dir=tmp_path, generated_games_per_type=1, task_types=["pick_and_place_simple"],
                        split="eval", expert=False)
    assert os.path.getmtime(env.game_files[0]) == first
    assert again.game_files == find_game_files(root, "valid_unseen") and again.game_files != env.game_files
    td = again.reset()
    assert td["task_type"][0] == "pick_and_place_simple" and td["task"][0]


def test_generated_splits_are_cached_one_by_one_and_a_killed_generation_is_cleaned(tmp_path, monkeypatch):
    # the cache's bookkeeping alone: generate_games is replaced by a writer of one file per split
    # (the games themselves: the tests above), and fails once, as a generation killed midway
    from torchrl_agent.envs.alfworld import generator

    calls, fail = [], {"valid_seen"}

    def fake_generate(out_dir, *, split, task_types, games_per_type, seed):
        calls.append(split)
        folder = os.path.join(out_dir, "json_2.1.1", split, "task", "trial")
        os.makedirs(folder)
        open(os.path.join(folder, "game.tw-pddl"), "w").close()
        if split in fail:
            raise KeyboardInterrupt
        return [os.path.join(folder, "game.tw-pddl")]

    monkeypatch.setattr(generator, "generate_games", fake_generate)
    kwargs = dict(games_per_type=1, task_types=["pick_and_place_simple"], cache_dir=tmp_path)
    root = generator.generated_data_dir(splits=("train",), **kwargs)  # the training env's split alone
    parent, name = os.path.split(root)
    assert calls == ["train"] and os.path.isfile(os.path.join(root, "DONE-train"))
    os.makedirs(os.path.join(parent, name + ".killed", "json_2.1.1"))  # a SIGKILLed generation's folder
    with pytest.raises(KeyboardInterrupt):  # valid_unseen is done, then valid_seen is interrupted
        generator.generated_data_dir(splits=("valid_seen", "valid_unseen"), **kwargs)
    assert calls == ["train", "valid_unseen", "valid_seen"]
    assert all(os.path.isfile(os.path.join(root, m)) for m in ("DONE-train", "DONE-valid_unseen", "DONE"))
    assert not os.path.exists(os.path.join(root, "DONE-valid_seen"))
    assert not os.path.exists(os.path.join(root, "json_2.1.1", "valid_seen"))
    assert not os.path.exists(os.path.join(parent, name + ".killed"))  # removed under the lock
    assert sorted(e for e in os.listdir(parent) if e.startswith(name)) == [name, name + ".lock"]  # no temporary left
    fail.clear()
    assert generator.generated_data_dir(**kwargs) == root and len(calls) == 3  # train and valid_unseen: cached
    assert generator.generated_data_dir(splits=("valid_seen",), **kwargs) == root and calls[3:] == ["valid_seen"]
    assert sorted(os.listdir(os.path.join(root, "json_2.1.1"))) == sorted(generator.SPLITS)

"""Agents that see: image observations (``pixels``) of the games, and the offline tiny VLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrl.envs.utils import check_env_specs

from torchrl_agent.envs import GameState, TextEnv, TextGame, make_env
from torchrl_agent.envs.base import IMAGE_PLACEHOLDER
from torchrl_agent.envs.games.images import TILE, _tiles

# name -> the frame's shape (the reference's: Sokoban's 6x6 room of 16-px tiles, Gym Cards' 300x300)
IMAGE_ENVS = {"sokoban": (96, 96, 3), "ezpoints": (300, 300, 3), "points24": (300, 300, 3),
              "blackjack": (300, 300, 3), "numberline": (300, 300, 3)}


def _expert_step(env, td):
    td["action"] = [a or "up" for a in td["expert_action"]]
    return env.step(td)["next"]


@pytest.mark.parametrize("name", IMAGE_ENVS)
def test_image_env_specs_and_state_free_text(name):
    env = make_env(name, num_groups=3, group_size=1, seed=0, modality="image")
    check_env_specs(env)
    spec = env.observation_spec["pixels"]
    assert spec.dtype == torch.uint8 and spec.shape == (3, *IMAGE_ENVS[name])
    td = env.reset()
    assert td["pixels"].shape == (3, *IMAGE_ENVS[name]) and td["pixels"].dtype == torch.uint8
    states = len(set(td["anchor"].tolist()))
    assert states >= 2  # different states (two deals may share their ranks) ...
    assert len({bytes(p.numpy()) for p in td["pixels"]}) >= states  # ... different frames ...
    observations, tasks = list(td["observation"]), list(td["task"])
    assert len(set(observations)) == 1 and IMAGE_PLACEHOLDER in observations[0]  # ... and one text
    assert len(set(tasks)) == 1


@pytest.mark.parametrize("name", IMAGE_ENVS)
def test_anchor_and_frames_agree_across_modalities(name):
    envs = {m: make_env(name, num_groups=2, group_size=2, seed=3, modality=m) for m in ("text", "image", "both")}
    tds = {m: env.reset() for m, env in envs.items()}
    for _ in range(3):
        assert "pixels" not in tds["text"].keys()
        assert torch.equal(tds["image"]["anchor"], tds["text"]["anchor"])
        assert torch.equal(tds["both"]["anchor"], tds["text"]["anchor"])
        # both: the text observation, then the image's sentence with its placeholder; the text's task
        assert list(tds["both"]["observation"]) == [f"{o}\n{envs['image'].visual_observation}"
                                                    for o in tds["text"]["observation"]]
        assert list(tds["both"]["task"]) == list(tds["text"]["task"])
        assert torch.equal(tds["both"]["pixels"], tds["image"]["pixels"])
        tds = {m: _expert_step(envs[m], td) for m, td in tds.items()}


def test_numberline_strip_shows_the_offset_and_blank_images_hide_it():
    """frame="strip" (the learning benchmark's vision task): the line seen from the marker, a column
    of one 28-px cell per offset; the marker is the blue middle cell and the target's red cell lies at
    the text state's offset (below: right), step after step. blank_images=True: the same episodes,
    every frame black."""
    from torchrl_agent.envs.games.images import STRIP_CELL

    kwargs = dict(num_groups=4, group_size=1, seed=5, max_position=9, min_distance=6, observation="relative")
    env = make_env("numberline", modality="image", frame="strip", **kwargs)
    text = make_env("numberline", **kwargs)
    blank = make_env("numberline", modality="image", frame="strip", blank_images=True, **kwargs)
    for e in (env, text, blank):  # (each draws its next training seeds the same way)
        check_env_specs(e)
    for e in (env, blank):
        assert e.observation_spec["pixels"].shape == (4, STRIP_CELL * 19, STRIP_CELL, 3)
    tds = [env.reset(), text.reset(), blank.reset()]
    for _ in range(3):
        td, td_text, td_blank = tds
        assert torch.equal(td["anchor"], td_text["anchor"]) and torch.equal(td_blank["anchor"], td["anchor"])
        assert not td_blank["pixels"].any() and td["pixels"].any()
        assert len(set(td["observation"])) == 1 and "red cell" in td["observation"][0]  # the text says nothing
        for frame, observation in zip(td["pixels"], td_text["observation"]):
            cells = frame[STRIP_CELL // 2::STRIP_CELL, STRIP_CELL // 2].tolist()  # one pixel per cell, top to bottom
            assert len(cells) == 19 and cells[9] == [30, 80, 230]  # the marker: the middle cell
            words = observation.split()  # "The target is K steps to your right." / "... left."
            offset = int(words[3]) * (1 if words[-1] == "right." else -1) if words[1] == "target" else 0
            assert cells[9 + offset] == [200, 20, 20] or offset == 0
            assert all(c != [200, 20, 20] for k, c in enumerate(cells) if k != 9 + offset)
        for t in tds:
            t["action"] = ["+"] * 4
        tds = [e.step(t)["next"] for e, t in zip((env, text, blank), tds)]
    # with stop_action the frame on the target shows it: the middle cell red, no other
    on_target = make_env("numberline", modality="image", frame="strip", stop_action=True, **kwargs)
    td = on_target.reset()
    for _ in range(9):  # walk game 0 to its target (6 to 9 moves)
        if td["expert_action"][0] == "stop":
            break
        td["action"] = [a if a != "stop" else "+" for a in td["expert_action"]]
        td = on_target.step(td)["next"]
    cells = td["pixels"][0, STRIP_CELL // 2::STRIP_CELL, STRIP_CELL // 2].tolist()
    assert td["expert_action"][0] == "stop" and cells[9] == [200, 20, 20] and cells.count([200, 20, 20]) == 1
    assert [60, 190, 60] in cells and [200, 200, 200] not in cells  # the line lights up green
    assert "answer 'stop' on the target" in td["observation"][0]
    with pytest.raises(ValueError, match="frame must be one of"):
        make_env("numberline", modality="image", frame="table2")
    with pytest.raises(ValueError, match="blank_images=True"):
        make_env("numberline", blank_images=True)


def test_tiny_vl_reads_the_strip_as_one_token_per_cell():
    """The vision task's strip at model.min_pixels=0: 532 x 28 pixels, 38 x 2 patches of 14, merged
    2x2: 19 image tokens, one per cell of the line."""
    from torchrl_agent.models.tiny_vl import build_tiny_vl, load_tiny_vl
    from torchrl_agent.modules.vision import prompt_with_image

    _, processor = load_tiny_vl(build_tiny_vl(seed=0))
    frame = make_env("numberline", modality="image", frame="strip", max_position=9, seed=0).reset()["pixels"][0]
    prompt, inputs = prompt_with_image(processor, "Move: <image>", frame.numpy(), min_pixels=0)
    assert inputs["image_grid_thw"].tolist() == [[1, 38, 2]] and prompt.count("<|image_pad|>") == 19


def test_sokoban_frame_draws_the_room():
    env = make_env("sokoban", num_groups=1, group_size=1, seed=1, modality="image")
    td = env.reset()
    game, tiles = env.games[0], _tiles()

    def tile(frame, cell):
        r, c = cell
        return frame[r * TILE:(r + 1) * TILE, c * TILE:(c + 1) * TILE]

    def player_tile():
        return tiles["player_on_target" if game.player in game.targets else "player"]

    before = td["pixels"][0].numpy()
    assert np.array_equal(tile(before, game.player), player_tile())
    assert all(np.array_equal(tile(before, w), tiles["wall"]) for w in game.walls)
    (box,) = game.boxes
    assert np.array_equal(tile(before, box), tiles["box"])
    player = game.player
    td = _expert_step(env, td)
    after = td["pixels"][0].numpy()
    assert game.player != player and np.array_equal(tile(after, game.player), player_tile())
    assert np.array_equal(tile(after, player), tiles["target" if player in game.targets else "floor"])


def test_sokoban_prompts_show_what_the_policy_sees(tokenizer):
    """The sokoban template takes the env's task: the text symbols' legend in text mode, the tiles'
    legend in image mode; ``both`` prompts hold the text room and the frame's placeholder."""
    from torchrl_agent.envs.transforms import PromptTransform

    prompts = {}
    for modality in ("text", "image", "both"):
        env = make_env("sokoban", num_groups=1, group_size=1, seed=2, modality=modality)
        td = PromptTransform(tokenizer, "sokoban")._call(env.reset())
        prompts[modality] = td["text", "prompt"][0]
    game = env.games[0]
    assert game.TASK in prompts["text"] and IMAGE_PLACEHOLDER not in prompts["text"]
    assert game.VISUAL_TASK in prompts["image"] and "# wall" not in prompts["image"]
    assert prompts["image"].count(IMAGE_PLACEHOLDER) == 1
    assert game.TASK in prompts["both"] and game.render() in prompts["both"]
    assert prompts["both"].count(IMAGE_PLACEHOLDER) == 1


def test_modality_errors():
    class Blind(TextGame):
        def reset(self, seed):
            return GameState("x")

        def step(self, action):
            return GameState("x"), 0.0, False, False

    with pytest.raises(ValueError, match="Blind draws no image"):
        TextEnv(Blind, modality="image")
    with pytest.raises(ValueError, match="modality must be one of"):
        make_env("sokoban", modality="video")
    assert "pixels" not in TextEnv(Blind).reset().keys()


def test_frames_through_worker_processes():
    kwargs = dict(num_groups=2, group_size=2, seed=5, modality="image")
    local = make_env("blackjack", **kwargs)  # first: a forked worker must still build its big `pixels` spec
    parallel = make_env("blackjack", num_workers=2, startup_timeout=30, **kwargs)
    try:
        assert parallel.observation_spec["pixels"].shape == local.observation_spec["pixels"].shape
        a, b = local.reset(), parallel.reset()
        for _ in range(2):
            assert torch.equal(a["pixels"], b["pixels"]) and torch.equal(a["anchor"], b["anchor"])
            assert list(a["observation"]) == list(b["observation"])
            a, b = _expert_step(local, a), _expert_step(parallel, b)
    finally:
        parallel.close()


def test_tiny_vl_processes_a_frame_and_generates():
    from torchrl_agent.models.tiny_vl import build_tiny_vl, load_tiny_vl, process_image

    model, processor = load_tiny_vl(build_tiny_vl(seed=0))
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"  # torchvision-free
    frame = make_env("sokoban", modality="image", seed=0).reset()["pixels"][0].numpy()
    messages = [{"role": "user", "content": [{"type": "text", "text": "The current room is shown in the image: "},
                                             {"type": "image"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    image_id = model.config.image_token_id

    def inputs(image):
        batch = processor(text=[prompt], images=[image], return_tensors="pt")
        return batch, int((batch["input_ids"] == image_id).sum())

    # the raw 96x96 frame: 84x84, 6x6 patches of 14, merged 2x2: 9 image tokens
    batch, tokens = inputs(process_image(frame, min_pixels=0))
    assert batch["image_grid_thw"].tolist() == [[1, 6, 6]] and tokens == 9
    # the reference's rescale to 256x256: 252x252, 18x18 patches: 81; a 300x300 card table: 22x22, 121
    batch, tokens = inputs(process_image(frame))
    assert batch["image_grid_thw"].tolist() == [[1, 18, 18]] and tokens == 81
    cards = make_env("ezpoints", modality="image", seed=0).reset()["pixels"][0].numpy()
    assert inputs(process_image(cards))[1] == 121
    assert batch["pixel_values"].shape == (18 * 18, 3 * 2 * 14 * 14)  # patches x (channels * temporal * 14 * 14)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, batch["input_ids"].shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, batch["input_ids"].shape[1] + 4)
    # the image reaches the logits: another frame, another next-token distribution
    other, _ = inputs(process_image(np.zeros_like(frame)))
    with torch.no_grad():
        assert not torch.allclose(model(**other).logits[0, -1], logits[0, -1])


def test_numberline_mirror_frames_turn_with_the_view():
    """mirror=True in image mode (the vision task's control game): the strip is drawn either way up
    (the unturned strip, or it upside down), the red cell at the offset the view's text names (the
    text env of the same seeds, same coins), and the fixed sentence says which way '+' moves."""
    from torchrl_agent.envs.games.images import STRIP_CELL, numberline_strip

    kwargs = dict(num_groups=4, group_size=1, seed=3, max_position=9, min_distance=6, observation="relative",
                  frame="strip", mirror=True)
    env, text = make_env("numberline", modality="image", **kwargs), make_env("numberline", **kwargs)
    for e in (env, text):  # (each draws its next training seeds the same way)
        check_env_specs(e)
    td, td_text = env.reset(), text.reset()
    assert "'+' moves you one cell down the column" in td["observation"][0]
    orientations = set()
    for _ in range(4):
        for frame, observation, game in zip(td["pixels"], td_text["observation"], env.games):
            cells = frame[STRIP_CELL // 2::STRIP_CELL, STRIP_CELL // 2].tolist()
            words = observation.split()
            offset = int(words[3]) * (1 if words[-1] == "right." else -1)
            assert cells[9] == [30, 80, 230] and cells[9 + offset] == [200, 20, 20]
            unturned = numberline_strip(game.position, game.target, 9)
            assert np.array_equal(frame.numpy(), unturned if game.orientation == 1 else unturned[::-1])
            orientations.add(game.orientation)
        td["action"] = td_text["action"] = ["+"] * 4
        td, td_text = env.step(td)["next"], text.step(td_text)["next"]
        assert torch.equal(td["anchor"], td_text["anchor"])
    assert orientations == {1, -1}


def test_the_vision_tasks_blank_control_is_one_override_away():
    """``benchmarks/learning.py --tasks vision --set env.kwargs.blank_images=true`` (the documented
    control) composes, and the env it builds draws every frame black; without it, the frames show
    the line."""
    from torchrl_agent.trainers.cli import compose_config

    for blank in (False, True):
        cfg = compose_config(["experiment=learning_vision", f"env.kwargs.blank_images={str(blank).lower()}"])
        env = make_env(cfg.env.name, num_groups=1, group_size=2, seed=0, **cfg.env.kwargs)  # as the trainer builds it
        pixels = env.reset()["pixels"]
        assert pixels.shape[-3:] == (532, 28, 3) and bool((pixels == 0).all()) == blank
        env.close()


def test_the_vision_task_is_the_long_numberline_seen_as_an_image():
    """``experiment=learning_vision_upright`` takes its game, rewards, batch, warm start and RL settings
    from ``learning_numberline`` and changes only what seeing it needs: the model, the frame, the
    longer RL (iterations, lr) and the longer format warm start; ``experiment=learning_vision`` (the
    benchmark's task ``vision``) is that, the view drawn either way up and twice the groups per
    iteration. A setting changed in the
    text task reaches both vision tasks; one that differs must be named here."""
    from omegaconf import OmegaConf

    from torchrl_agent.trainers.cli import compose_config

    def flat(cfg, prefix=""):
        out = {}
        for key, value in cfg.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return out

    text, vision, mirrored = (flat(OmegaConf.to_container(OmegaConf.structured(compose_config([f"experiment=learning_{t}"]))))
                              for t in ("numberline", "vision_upright", "vision"))
    assert {key for key in vision.keys() | mirrored.keys() if vision.get(key) != mirrored.get(key)} == {
        "env.kwargs.mirror", "env.num_groups"}
    assert mirrored["env.kwargs.mirror"] is True and mirrored["env.num_groups"] == 2 * vision["env.num_groups"] == 32
    differ = {key for key in text.keys() | vision.keys() if text.get(key, "absent") != vision.get(key, "absent")}
    assert {key for key in differ if not key.startswith("model.")} == {
        "env.kwargs.modality", "env.kwargs.frame", "env.kwargs.blank_images", "iterations", "warm_start.steps",
        "algorithm.lr"}
    assert vision["model.name"] == "tiny-vl" and vision["model.min_pixels"] == 0
    assert vision["env.max_steps"] == 12 and vision["env.kwargs.min_distance"] == 6 and vision["algorithm.max_update_kl"] == 0.3

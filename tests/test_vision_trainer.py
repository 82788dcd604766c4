"""The Trainer on a VLM: the tiny VLM (``model=tiny-vl``) trained with GiGPO on Sokoban's image
observations (``experiment=sokoban_vl_tiny``: 2 groups of 2, 3 steps, 9 image tokens a frame) in one
process and under torchrun (2 ranks, gloo, FSDP2): the engine is ``VisionPolicy``, the scorer
``VisionResponseLogProbs``, their log-probs agree after every update, and a run resumed from its
periodic checkpoint continues exactly.

The torchrun half (``worker``) runs under ``python -m torch.distributed.run --standalone
--nproc_per_node 2 tests/test_vision_trainer.py OUT`` (the ``torchrun_vl`` fixture)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchrl_agent.trainers.cli import compose_config, main

BASE = ["experiment=sokoban_vl_tiny", "progress=false", "checkpoint_every=1"]
TOL = 1e-4  # engine sampling log-probs against the trainer's recomputation (float32 on both sides)


def _weights(trainer) -> dict[str, torch.Tensor]:
    from torchrl_agent.trainers.distributed import full_state_dict

    return full_state_dict(trainer.model)  # every rank calls it; rank 0 gets the full weights


def _resumed(run_dir: Path, straight_dir: Path, *extra: str):
    """A run resumed from ``straight_dir``'s checkpoint after iteration 0 (it trains iteration 1)."""
    from torchrl_agent.trainers import Trainer

    checkpoint = straight_dir / "checkpoints" / "iteration_00000.pt"
    return Trainer(compose_config([*BASE, *extra, f"run_dir={run_dir}", f"resume={checkpoint}"]))


def _record(history: list[dict], iteration: int) -> dict:
    return [h for h in history if h["iteration"] == iteration and "loss" in h][0]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Two GiGPO iterations of the tiny VLM on frames, a checkpoint after each, and what the trainer
    held before training (its weights) and after (one more batch, scored)."""
    from torchrl_agent.trainers import Trainer

    run_dir = tmp_path_factory.mktemp("vl") / "straight"
    trainer = Trainer(compose_config([*BASE, f"run_dir={run_dir}"]))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    rows = trainer.collector.collect()  # sampled after the last update's weight sync
    trainer.scorer.score(rows)
    return trainer, run_dir, before, rows


def test_trainer_trains_a_vlm_on_frames_and_its_scorer_matches_the_engine(straight):
    from torchrl_agent.modules import VisionPolicy, VisionResponseLogProbs

    trainer, _, before, rows = straight
    assert isinstance(trainer.policy, VisionPolicy) and isinstance(trainer.scorer.actor, VisionResponseLogProbs)
    assert trainer.policy.min_pixels == trainer.scorer.actor.min_pixels == 0  # the experiment's model.min_pixels
    assert trainer.weight_sync == "shared"  # float32, one process: the engine samples with the trained weights
    # the rows carry their frames and the prompts their 9 image tokens (96x96 frame, 6x6 patches, 2x2 merged)
    assert rows["pixels"].shape[1:] == (96, 96, 3) and rows["pixels"].dtype == torch.uint8
    assert set(rows["image_tokens"].reshape(-1).tolist()) == {9}
    for it in (0, 1):  # iteration 1's rows were sampled after iteration 0's update
        record = _record(trainer.history, it)
        assert record["logprob_diff_max"] < TOL and record["prompt_tokens_per_step"] > 9
        assert torch.isfinite(torch.tensor(record["loss"])) and record["grad_norm"] > 0
    assert _record(trainer.history, 1)["kl_ref"] > 0  # the reference (the initial VLM) scored from the frames too
    # after the last update: the engine's log-probs of the new batch equal the scorer's recomputation
    assert trainer.scorer.logprob_consistency(rows)["logprob_diff_max"] < TOL
    # the scorer reads the frames: other frames give other log-probs
    old = rows.get("old_log_prob").clone()
    blank = rows.clone()
    blank["pixels"] = torch.zeros_like(rows["pixels"])
    trainer.scorer.score(blank)
    assert (blank.get("old_log_prob") - old).abs().max() > 1e-4
    # the updates reached the vision tower and both language layers
    after = trainer.model.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    for part in ("visual.patch_embed", "visual.blocks.0", "visual.merger", "language_model.layers.0",
                 "language_model.layers.1"):
        assert any(part in k for k in changed), part


def test_vlm_run_resumed_from_its_checkpoint_continues_exactly(straight, tmp_path):
    trainer, run_dir, _, _ = straight
    resumed = _resumed(tmp_path / "resumed", run_dir)
    resumed.train()
    a, b = _record(trainer.history, 1), _record(resumed.history, 1)
    for key in ("episode_reward", "loss", "kl_ref", "logprob_diff_max", "grad_norm"):
        assert a[key] == b[key], key
    for (name, x), y in zip(trainer.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(x, y), name


def test_frozen_vision_tower_does_not_change_while_the_language_layers_train(tmp_path):
    from torchrl_agent.trainers import Trainer

    trainer = Trainer(compose_config([*BASE, "iterations=1", "checkpoint_every=0", "model.freeze_vision=true",
                                      f"run_dir={tmp_path}"]))
    assert not any(p.requires_grad for n, p in trainer.model.named_parameters() if ".visual." in f".{n}")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rows, _ = trainer.collect_rows()
    metrics = trainer.update(rows)
    assert metrics["logprob_diff_max"] < TOL
    after = trainer.model.state_dict()
    vision = [k for k in after if "visual." in k]
    assert vision and all(torch.equal(after[k], before[k]) for k in vision)
    assert any(not torch.equal(after[k], before[k]) for k in after if "language_model.layers" in k)


def test_lora_on_a_vlm_trains_adapters_of_its_language_part_only(tmp_path):
    """``model.lora_rank > 0``: adapters on the language model's projections, none in the vision
    tower; the reference is the base VLM (adapters disabled), scored from the frames too."""
    from torchrl_agent.modules import VisionPolicy
    from torchrl_agent.trainers import Trainer

    trainer = Trainer(compose_config([*BASE, "iterations=1", "checkpoint_every=0", "model.lora_rank=4",
                                      "algorithm.kl_coef=0.05", "algorithm.lr=1e-2", f"run_dir={tmp_path}"]))
    assert isinstance(trainer.policy, VisionPolicy) and trainer.reference is None
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 7 * 2  # 2 layers x (q, k, v, o, gate, up, down) x (A, B)
    assert all("lora_" in n and "language_model" in n for n in trainable)
    assert not any("lora_" in n for n, _ in trainer.model.named_parameters() if ".visual." in n)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rows, _ = trainer.collect_rows()
    assert trainer.update(rows)["logprob_diff_max"] < TOL
    after = trainer.model.state_dict()
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert changed and all("lora_" in k for k in changed)
    rows = trainer.collector.collect()  # sampled with the adapters
    trainer.scorer.score(rows)
    assert trainer.scorer.logprob_consistency(rows)["logprob_diff_max"] < TOL
    assert (rows.get("ref_log_prob") - rows.get("old_log_prob")).abs().max() > 1e-3  # the base VLM differs


@pytest.mark.parametrize("override, needle", [
    ("rollout.engine=vllm", "rollout.engine=vllm with a vision-language model"),
    ("model.min_pixels=100", "model.min_pixels=100: must be <= model.max_pixels=1"),
    ("algorithm=ppo", "algorithm.name=ppo"),
])
def test_vlm_settings_it_cannot_run_fail_at_start_naming_the_key(override, needle, tmp_path, capsys):
    extra = ["model.max_pixels=1"] if "min_pixels" in override else []
    assert main(["train", *BASE, override, *extra, f"run_dir={tmp_path}"]) == 2
    assert needle in capsys.readouterr().err


def test_sharded_collectors_get_the_vlm_engine_and_its_image_bounds_from_the_config():
    """The multi-process collector's engine server and the Ray actors' factory (their processes are
    tested in tests/test_vision_collectors.py and tests/test_collector_ray.py): the transformers
    engine of the VLM folder with ``model.min_pixels`` / ``model.max_pixels``."""
    from torchrl_agent.modules import VisionPolicy
    from torchrl_agent.trainers.engines import get_engine, transformers_engine_kwargs

    cfg = compose_config([*BASE, "model.max_pixels=20000"])
    engine = transformers_engine_kwargs(cfg)
    assert (engine["engine"], engine["min_pixels"], engine["max_pixels"]) == ("transformers", 0, 20000)
    factory = get_engine("transformers").ray_factory(cfg, None)
    assert factory.engine == "transformers" and factory.model_path == engine["model_path"]
    policy = factory()  # what each Ray actor builds
    assert isinstance(policy, VisionPolicy) and (policy.min_pixels, policy.max_pixels) == (0, 20000)
    assert policy.max_new_tokens == cfg.rollout.max_new_tokens and policy.accepts_request_seeds
    # a text model, or a VLM on text observations: the text engine, no bounds
    assert "min_pixels" not in transformers_engine_kwargs(compose_config(["experiment=smoke"]))
    assert "min_pixels" not in transformers_engine_kwargs(compose_config([*BASE, "env.kwargs.modality=text"]))


def test_a_text_model_on_image_observations_is_warned(tiny_model, tokenizer, caplog):
    from torchrl_agent.modules import TransformersPolicy
    from torchrl_agent.trainers.builders import build_policy

    cfg = compose_config(["experiment=smoke", "env=sokoban", "+env.kwargs.modality=image"])
    with caplog.at_level("WARNING", logger="torchrl_agent"):
        policy = build_policy(cfg, tiny_model, tokenizer)
    assert type(policy) is TransformersPolicy and "never sees the frames" in caplog.text


def test_freeze_vision_on_a_text_model_fails_at_start(tmp_path, capsys):
    assert main(["train", "experiment=smoke", "model.freeze_vision=true", f"run_dir={tmp_path}"]) == 2
    assert "model.freeze_vision=true" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- torchrun
def worker(out: str) -> None:
    """Each of 2 ranks: the straight run (2 iterations, a sharded checkpoint after each), a run
    resumed from its checkpoint after iteration 0, and one iteration with ``model.freeze_vision``;
    rank 0 writes what they hold into OUT."""
    from torchrl_agent.modules import VisionPolicy
    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.distributed import all_gather_object, cleanup, get_rank

    torch.set_num_threads(1)
    out_dir = Path(out)
    straight = Trainer(compose_config([*BASE, "device=cpu", f"run_dir={out_dir / 'straight'}"]))
    engine = isinstance(straight.policy, VisionPolicy)
    straight.train()
    resumed = _resumed(out_dir / "resumed", out_dir / "straight", "device=cpu")
    resumed.train()
    a, b = _weights(straight), _weights(resumed)
    engines = all_gather_object({"rank": get_rank(), "engine": engine, "sync": straight.weight_sync,
                                 "collector": type(straight.collector).__name__})
    # one iteration with the vision tower frozen (FSDP2 over frozen and trained parameters in one group)
    frozen = Trainer(compose_config([*BASE, "device=cpu", "iterations=1", "checkpoint_every=0",
                                     "model.freeze_vision=true", f"run_dir={out_dir / 'frozen'}"]))
    start = _weights(frozen)
    frozen.train()
    end = _weights(frozen)
    if get_rank() == 0:
        vision = [k for k in start if "visual." in k]
        language = [k for k in start if "language_model.layers" in k]
        (out_dir / "result.json").write_text(json.dumps({
            "engines": engines, "straight": straight.history, "resumed": resumed.history,
            "weights_equal": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
            "frozen": frozen.history, "frozen_vision_kept": bool(vision) and all(torch.equal(start[k], end[k])
                                                                                 for k in vision),
            "frozen_language_changed": any(not torch.equal(start[k], end[k]) for k in language)}))
    cleanup()


@pytest.fixture(scope="module")
def torchrun_vl(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun_vl")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def test_vlm_trains_under_torchrun_and_resumes_from_its_sharded_checkpoint(torchrun_vl):
    result = torchrun_vl
    assert [e["engine"] for e in result["engines"]] == [True, True]  # a VisionPolicy per rank
    assert {e["sync"] for e in result["engines"]} == {"ranks"}
    assert {e["collector"] for e in result["engines"]} == {"DistributedStepCollector"}
    for it in (0, 1):
        record = _record(result["straight"], it)
        assert record["logprob_diff_max"] < TOL, (it, record["logprob_diff_max"])
        assert record["logprob_diff_max/engine0"] < TOL and record["logprob_diff_max/engine1"] < TOL
    a, b = _record(result["straight"], 1), _record(result["resumed"], 1)
    for key in ("episode_reward", "loss", "kl_ref", "grad_norm"):
        assert a[key] == b[key], key
    assert result["weights_equal"]
    # model.freeze_vision=true under FSDP2: the vision tower kept, the language layers trained
    assert result["frozen_vision_kept"] and result["frozen_language_changed"]
    assert _record(result["frozen"], 0)["logprob_diff_max"] < TOL


# ------------------------------------------------------------------------------------------ GPU recipes
VL_RECIPES = {"sokoban_vl_gigpo": dict(env="sokoban", groups=32, steps=15, iterations=150, minibatch=64, image_tokens=81),
              "ezpoints_vl_gigpo": dict(env="ezpoints", groups=16, steps=8, iterations=100, minibatch=128,
                                        image_tokens=121)}


@pytest.mark.parametrize("recipe", list(VL_RECIPES))
def test_vl_recipes_validate_and_their_rehearsal_runs_the_tiny_vlm_on_the_recipes_frames(recipe):
    """The Qwen2.5-VL-3B recipes at the reference's settings compose and validate; the rehearsal's
    overrides (``benchmarks/recipe_rehearsal.py``) give the tiny VLM with the transformers engine and
    the recipe's image bounds, whose env sends one image a prompt of the reference's token count."""
    import importlib.util

    from torchrl_agent.envs.factory import build_env
    from torchrl_agent.models import is_vision_config, load_processor, model_path
    from torchrl_agent.modules.vision import image_inputs
    from torchrl_agent.trainers.engines import image_bounds
    from torchrl_agent.trainers.validate import validate_config

    want = VL_RECIPES[recipe]
    cfg = compose_config([f"experiment={recipe}"])
    validate_config(cfg, check_files=False)
    assert (cfg.model.path, cfg.model.dtype, cfg.rollout.engine) == ("Qwen/Qwen2.5-VL-3B-Instruct", "bfloat16",
                                                                     "transformers")
    assert cfg.env.name == want["env"] and cfg.env.kwargs["modality"] == "image" and cfg.memory.kind == "none"
    assert (cfg.env.num_groups, cfg.env.group_size, cfg.env.max_steps) == (want["groups"], 8, want["steps"])
    assert (cfg.memory.max_prompt_tokens, cfg.rollout.max_new_tokens, cfg.iterations) == (1024, 512, want["iterations"])
    a = cfg.algorithm
    assert (a.name, a.norm, a.gamma, a.lr, a.kl_coef, a.invalid_penalty, a.minibatch_size) == (
        "gigpo", "mean", 0.95, 1e-6, 0.01, 0.1, want["minibatch"])
    assert (cfg.model.min_pixels, cfg.model.max_pixels) == (256**2, 2048**2)

    spec = importlib.util.spec_from_file_location(
        "recipe_rehearsal", Path(__file__).resolve().parents[1] / "benchmarks" / "recipe_rehearsal.py")
    rehearsal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rehearsal)
    assert recipe in rehearsal.GPU_RECIPES
    overrides = rehearsal.overrides(recipe)
    assert len({o.split("=", 1)[0] for o in overrides}) == len(overrides)  # each key once: Hydra takes them all
    tiny = compose_config([f"experiment={recipe}", *overrides])
    validate_config(tiny, check_files=False)
    assert (tiny.model.name, tiny.model.path, tiny.rollout.engine) == ("tiny-vl", None, "transformers")
    assert is_vision_config(tiny.model) and image_bounds(tiny) == {"min_pixels": 256**2, "max_pixels": 2048**2}
    assert (tiny.env.num_groups, tiny.iterations, tiny.algorithm.minibatch_size) == (2, 2, want["minibatch"])
    text = compose_config(["experiment=sokoban_gigpo", *rehearsal.overrides("sokoban_gigpo")])
    assert (text.model.name, text.rollout.engine) == ("smollm2-135m", "vllm")  # the text recipes' cuts stay

    processor = load_processor(model_path(tiny.model))
    td = build_env(tiny, processor.tokenizer).reset()
    assert all(p.count("<image>") == 1 for p in td["text", "prompt"])  # the current frame, once (no formula text)
    grid = image_inputs(processor, td["pixels"], **image_bounds(tiny))["image_grid_thw"]
    assert (grid.prod(-1) // 4).tolist() == [want["image_tokens"]] * len(td["pixels"])  # 2x2 merge


if __name__ == "__main__":
    worker(sys.argv[1])

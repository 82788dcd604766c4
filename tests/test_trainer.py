"""The `torchrl-agent train` entry point end to end on a small config, and config validation."""

from __future__ import annotations

import json

import pytest

from torchrl_agent.trainers.cli import compose_config, main

SMALL = ["experiment=smoke", "iterations=2", "eval_every=1", "env.num_groups=2", "env.group_size=2", "env.eval_episodes=4",
         "env.max_steps=3", "warm_start.steps=2", "warm_start.episodes=4", "rollout.max_new_tokens=8",
         "progress=false"]


def test_train_runs_end_to_end_and_writes_its_logs(tmp_path, capsys):
    assert main(["train", *SMALL, f"run_dir={tmp_path}", "algorithm=gigpo", "algorithm.kl_coef=0.01"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["iterations"] == 2 and summary["algorithm"] == "gigpo"
    assert 0.0 <= summary["eval_success_first"] <= 1.0 and 0.0 <= summary["eval_success_last"] <= 1.0
    assert [it for it, _ in summary["eval_curve"]] == [-1, 0, 1, 2]
    assert sum(line.startswith("metrics ") for line in lines) == 3
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    for r in records[:2]:
        for key in ("success", "episode_reward", "loss", "loss_objective", "loss_kl", "tokens_per_s", "grad_norm",
                    "logprob_diff_max", "prompt_tokens_per_step"):
            assert key in r, key
        assert (r["episodes"], r["groups"]) == (4, 2)  # 2 groups of 2 games: the draws sharp_fall counts
    peaks = [r["peak_rss_gb"] for r in records[:2]]  # this process's largest resident memory so far
    assert 0.05 < peaks[0] <= peaks[1] < 64, peaks
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "learning_curve.png").stat().st_size > 1000


def test_training_changes_the_weights_and_rewards_move_the_loss(tmp_path):
    import torch

    from torchrl_agent.trainers import Trainer

    cfg = compose_config([*SMALL, f"run_dir={tmp_path}", "algorithm.lr=1e-2", "algorithm.kl_coef=0"])
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rows = trainer.advantage(trainer.collector.collect())
    assert rows["advantage"].shape == rows["reward"].shape
    metrics = trainer.update(rows)
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert metrics["logprob_diff_max"] < 1e-3  # the engine sampled from the distribution being trained
    changed = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed  # a real optimizer step happened


@pytest.mark.parametrize("override, needle", [
    ("env.num_grups=2", "num_grups"),
    ("algorithm.lr=fast", "lr"),
    ("+env.color=blue", "color"),
    ("memory=forgetful", "forgetful"),
])
def test_broken_config_fails_at_start_naming_the_key(override, needle, capsys):
    assert main(["train", "experiment=smoke", override]) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err and needle in err


def test_unknown_names_fail_at_start(tmp_path, capsys):
    assert main(["train", "experiment=smoke", "env.name=chess", f"run_dir={tmp_path}"]) == 2
    assert "chess" in capsys.readouterr().err
    assert main(["train", "experiment=smoke", "algorithm.name=magic", f"run_dir={tmp_path}"]) == 2
    assert "algorithm.name" in capsys.readouterr().err


def test_resumed_run_continues_exactly_like_the_uninterrupted_one(tmp_path):
    """With a warm start and a KL term: the reference (the warm-started policy, not the loaded
    model) comes back from the checkpoint too."""
    import torch

    from torchrl_agent.trainers import Trainer

    base = [*SMALL, "eval_every=0", "env.eval_episodes=2", "algorithm.lr=1e-3", "algorithm.kl_coef=0.05"]
    straight = Trainer(compose_config([*base, "iterations=2", f"run_dir={tmp_path / 'a'}"]))
    straight.train()
    first = Trainer(compose_config([*base, "iterations=1", f"run_dir={tmp_path / 'b'}"]))
    first.train()
    checkpoint = tmp_path / "b" / "checkpoints" / "last.pt"
    assert checkpoint.exists()
    resumed = Trainer(compose_config([*base, "iterations=2", f"run_dir={tmp_path / 'c'}", f"resume={checkpoint}"]))
    resumed.train()
    a = [h for h in straight.history if h["iteration"] == 1 and "loss" in h][0]
    c = [h for h in resumed.history if h["iteration"] == 1 and "loss" in h][0]
    assert a["episode_reward"] == c["episode_reward"] and a["loss"] == c["loss"]
    assert a["kl_ref"] == c["kl_ref"] > 0
    for part in ("model", "reference"):
        for (name, x), y in zip(getattr(straight, part).state_dict().items(), getattr(resumed, part).state_dict().values()):
            assert torch.equal(x, y), (part, name)


def test_eval_runs_a_checkpoint_on_the_fixed_panel(tmp_path, capsys):
    assert main(["train", *SMALL, "iterations=1", "eval_every=0", f"run_dir={tmp_path}"]) == 0
    capsys.readouterr()
    checkpoint = tmp_path / "checkpoints" / "last.pt"
    args = ["eval", "experiment=smoke", "env.eval_episodes=4", "env.max_steps=3", "rollout.max_new_tokens=8", "progress=false",
            f"eval.checkpoint={checkpoint}"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["episodes"] == 4 and 0.0 <= first["success"] <= 1.0 and first["policy"] == str(checkpoint)
    transcripts = tmp_path / "eval" / "steps.jsonl"
    assert main([*args, f"eval.transcripts={transcripts}"]) == 0  # the same panel and seed: the same result
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["success"] == first["success"] and again["episode_reward"] == first["episode_reward"]
    # eval.transcripts: every step of the panel, one JSON object a step, agreeing with the result
    steps = [json.loads(line) for line in transcripts.read_text().splitlines()]
    assert again["transcript_steps"] == len(steps) == first["episode_length"] * 4
    assert len({s["episode"] for s in steps}) == 4 and all(isinstance(s["response"], str) for s in steps)
    assert sum(s["action_valid"] for s in steps) / len(steps) == pytest.approx(first["action_valid"])
    ends = [s for s in steps if s["done"]]
    assert len(ends) == 4 and sum(s["success"] for s in ends) / 4 == first["success"]
    assert main(["eval", "experiment=smoke", "eval.checkpoint=/nonexistent.pt"]) == 2
    assert "eval.checkpoint" in capsys.readouterr().err
    assert main([*args, f"eval.transcripts={tmp_path}"]) == 2  # a folder: refused before the panel runs
    assert "eval.transcripts" in capsys.readouterr().err


def test_eval_runs_a_checkpoint_with_the_vllm_engine(tmp_path, capsys):
    """``torchrl-agent eval rollout.engine=vllm``: the checkpoint's weights, loaded into a vLLM engine,
    play the panel as the transformers engine plays it (greedy: the same responses, the same result)."""
    assert main(["train", *SMALL, "iterations=1", "eval_every=0", "warm_start.steps=0", "algorithm.lr=1e-2",
                 f"run_dir={tmp_path}"]) == 0
    capsys.readouterr()
    args = ["eval", "experiment=smoke", "env.eval_episodes=4", "env.max_steps=3", "rollout.max_new_tokens=8",
            "progress=false", "rollout.eval_temperature=0", f"eval.checkpoint={tmp_path / 'checkpoints' / 'last.pt'}"]
    results = {}
    for engine in ("transformers", "vllm"):
        assert main([*args, f"rollout.engine={engine}"]) == 0
        results[engine] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (results["transformers"]["engine"], results["vllm"]["engine"]) == ("transformers", "vllm")
    for key in ("episodes", "success", "episode_reward", "response_tokens_total", "action_valid"):
        assert results["vllm"][key] == results["transformers"][key], key


def test_lora_trains_only_adapters_and_uses_the_base_model_as_reference(tmp_path):
    import torch

    from torchrl_agent.trainers import Trainer

    cfg = compose_config([*SMALL, f"run_dir={tmp_path}", "model.lora_rank=4", "algorithm.kl_coef=0.05",
                          "algorithm.lr=1e-2"])
    trainer = Trainer(cfg)
    assert trainer.reference is None  # no second copy of the weights
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    rows = trainer.advantage(trainer.collector.collect())
    metrics = trainer.update(rows)
    assert "loss_kl" in metrics
    for name, p in trainer.model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    # after the update the adapters moved the policy away from the base model (the reference)
    with trainer.model.disable_adapter():
        base = trainer.scorer.recompute(trainer.model, rows[:4])
    tuned = trainer.scorer.recompute(trainer.model, rows[:4])
    assert any(not torch.allclose(a, b) for a, b in zip(base, tuned))


def test_train_with_the_vllm_engine_syncs_weights_into_it(tmp_path):
    import torch

    from torchrl_agent.modules import ResponseLogProbs, VLLMPolicy
    from torchrl_agent.trainers import Trainer

    cfg = compose_config([*SMALL, f"run_dir={tmp_path}", "rollout.engine=vllm", "algorithm.lr=1e-2",
                          "algorithm.kl_coef=0", "warm_start.steps=0"])
    trainer = Trainer(cfg)
    assert isinstance(trainer.policy, VLLMPolicy) and trainer.eval_policy.temperature == cfg.rollout.eval_temperature
    rows = trainer.advantage(trainer.collector.collect())
    trainer.update(rows)  # the update ends with update_weights into the engine
    fresh = trainer.collector.collect()
    with torch.no_grad():
        recomputed = ResponseLogProbs(trainer.model, trainer.tokenizer.pad_token_id)(fresh[:6])
    sampled = fresh[:6].get(("log_probs", "response"), as_padded_tensor=True)
    torch.testing.assert_close(recomputed["log_prob"], sampled * recomputed["mask"], atol=2e-3, rtol=0)


def test_a_fall_by_more_than_half_in_one_iteration_is_warned_in_one_line(tmp_path, caplog):
    """The run log warns in one line when ``action_valid`` or training success falls by more than half
    from one iteration to the next (quoting that update's largest approx_kl); not for a smaller fall,
    nor from below the floor, nor for a fall that two batches of one policy make by chance."""
    import logging

    from torchrl_agent.trainers.loggers import beyond_chance, sharp_fall

    before = {"iteration": 3, "success": 0.8, "action_valid": 0.98, "approx_kl_max": 1.24}
    line = sharp_fall(before, {"iteration": 4, "success": 0.5, "action_valid": 0.0})
    assert line.startswith("iteration 4: action_valid 0.98 -> 0.00 after one update")
    assert "success" not in line.split("after")[0] and "1.24" in line and "\n" not in line
    assert sharp_fall(before, {"iteration": 4, "success": 0.39, "action_valid": 0.9}).startswith(
        "iteration 4: success 0.80 -> 0.39")
    assert sharp_fall({"iteration": 3, "success": 0.05, "action_valid": 0.5},
                      {"iteration": 4, "success": 0.0, "action_valid": 0.3}) is None  # a small fall; success under the floor
    assert sharp_fall(None, {"iteration": 0, "success": 0.0}) is None
    # where the records count their groups, only a fall beyond chance is warned: 14 wins of 64 games in 16
    # groups, then 2, is two batches of one policy (z 1.6: a group's games win or lose together); 1.00
    # then 0.45, or 0.98 valid then 0.20, is not
    noise = sharp_fall({"iteration": 5, "success": 14 / 64, "groups": 16, "action_valid": 0.99},
                       {"iteration": 6, "success": 2 / 64, "groups": 16, "action_valid": 0.98})
    assert noise is None
    fell = sharp_fall({"iteration": 5, "success": 1.0, "groups": 16, "action_valid": 0.98},
                      {"iteration": 6, "success": 0.45, "groups": 16, "action_valid": 0.2})
    assert fell.startswith("iteration 6: action_valid 0.98 -> 0.20, success 1.00 -> 0.45 after one update")
    assert beyond_chance(0.5, 0.2, 32, 32) and not beyond_chance(0.3, 0.12, 32, 32)
    assert not beyond_chance(0.0, 0.0, 10, 10) and beyond_chance(0.5, 0.2, None, 32)  # no spread; no count

    from torchrl_agent.trainers.loggers import MetricsLog

    log = MetricsLog(None, tmp_path)
    with open(tmp_path / "m.jsonl", "w") as log.file, caplog.at_level(logging.WARNING, logger="torchrl_agent"):
        log.log(dict(before))
        log.log({"iteration": 4, "success": 0.7, "action_valid": 0.2})
    falls = [r.getMessage() for r in caplog.records if "after one update" in r.getMessage()]
    assert falls == ["iteration 4: action_valid 0.98 -> 0.20 after one update (that update's largest approx_kl: "
                     "1.24): the policy may have left its answer format; algorithm.max_kl bounds how far one "
                     "update moves it"]

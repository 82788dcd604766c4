"""The learning setup: the tiny-large model, short expert responses, the benchmark's statistics."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys

import torch
from tensordict import TensorDict

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _learning_module():
    spec = importlib.util.spec_from_file_location("learning_bench", os.path.join(ROOT, "benchmarks", "learning.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["learning_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_tiny_large_model_reads_grids_and_tags():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchrl_agent.envs.transforms.projection import project_action
    from torchrl_agent.models import build_tiny_model
    from torchrl_agent.trainers.warm_start import expert_response

    path = build_tiny_model(seed=0, size="tiny-large")
    assert path.name.startswith("tiny-large-") and path != build_tiny_model(seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) > 1_000_000
    assert model.config.hidden_size // model.config.num_attention_heads >= 32  # vLLM CPU attention
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.tokenize("#_P__#") == ["#", "_", "P", "_", "_", "#"]  # one token per grid cell
    response = expert_response("up", "tags", think="")
    assert response == "<think></think><action>up</action>"
    assert tok.tokenize(response) == ["<think>", "</think>", "<action>", "up", "</action>"]
    assert project_action(response) == ("up", True)
    assert project_action(expert_response("3", "json", think=""), "json") == ("3", True)


def test_advantage_stats_counts_groups_without_signal():
    learning = _learning_module()
    # group 0: two episodes with the same return (no episode signal); group 1: a win and a loss
    rows = TensorDict(
        reward=torch.tensor([0.0, 1.0, 0.0, 1.0, 10.0, 0.0]).unsqueeze(-1),
        group_id=torch.tensor([0, 0, 0, 0, 1, 1]),
        traj_id=torch.tensor([0, 0, 1, 1, 2, 3]),
        done=torch.tensor([False, True, False, True, True, True]).unsqueeze(-1),
        success=torch.tensor([False, False, False, False, True, False]).unsqueeze(-1),
        advantage=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.7, -0.7]).unsqueeze(-1),
        batch_size=[6],
    )
    stats = learning.advantage_stats(rows)
    assert stats["groups_equal_return"] == 0.5
    assert stats["groups_same_outcome"] == 0.5
    assert abs(stats["rows_zero_advantage"] - 4 / 6) < 1e-6
    assert learning.iterations_to([{"iteration": 0, "greedy": 0.2}, {"iteration": 5, "greedy": 0.6}], 0.5) == 5
    assert learning.iterations_to([{"iteration": 0, "greedy": 0.2}], 0.5) is None


def _fake_run(seed: int, method: str, panel: list[tuple[int, float, float]]) -> dict:
    return {"task": "numberline", "method": method, "seed": seed, "wall_s": 1.0, "rl_s_per_iteration": 1.0,
            "diagnostics": [], "panel": [{"iteration": it, "greedy": g, "sampled": s, "top_plan_share": 1.0,
                                          "distinct_plans": 1} for it, g, s in panel]}


def test_summary_counts_final_threshold_and_keeps_per_seed_finals():
    """reached_threshold counts the FINAL evaluations at or above the threshold: a seed that
    reached it and fell back is counted only in ever_reached_threshold."""
    learning = _learning_module()
    runs = [_fake_run(2, "gigpo", [(0, 0.5, 0.2), (5, 0.9, 0.9), (10, 0.95, 0.9)]),
            _fake_run(0, "gigpo", [(0, 0.4, 0.1), (5, 0.95, 0.9), (10, 0.0, 0.0)]),  # solved, then collapsed
            _fake_run(1, "gigpo", [(0, 0.6, 0.3), (5, 0.6, 0.3), (10, 0.8, 0.7)])]
    m = learning.summarize(runs, threshold=0.8)
    assert m["seeds"] == [0, 1, 2]
    assert m["finals"] == [0.0, 0.8, 0.95] and m["finals_sampled"] == [0.0, 0.7, 0.9]
    assert m["after_warm_start"] == [0.4, 0.6, 0.5]
    assert m["reached_threshold"] == 2 and m["ever_reached_threshold"] == 3 and m["runs"] == 3
    assert m["reached_threshold_sampled"] == 1
    # runs recorded before approx_kl_max existed: null, not 0
    assert m["approx_kl_max"] is None and m["approx_kl_max_per_seed"] == [None, None, None]
    runs[0]["approx_kl_max"], runs[0]["train_action_valid"] = [0.01, None, 0.3], [0.9, 0.4]
    runs[1]["approx_kl_max"], runs[1]["train_action_valid"] = [0.02], [1.0]
    m = learning.summarize(runs, threshold=0.8)
    assert m["approx_kl_max"] == 0.3 and m["approx_kl_max_per_seed"] == [0.02, None, 0.3]  # seeds 0, 1, 2
    assert m["min_train_action_valid_per_seed"] == [1.0, None, 0.4]


def test_paired_comparison_interval_and_permutation_test():
    learning = _learning_module()
    # a constant difference of +0.1 on 6 seeds: no spread, the interval is the point, p = 2/64
    same = learning.paired_comparison({s: 0.9 for s in range(6)}, {s: 0.8 for s in range(6)})
    assert abs(same["mean_difference"] - 0.1) < 1e-9 and not same["within_noise"]
    assert abs(same["t_ci95"][0] - 0.1) < 1e-9 and abs(same["permutation_p"] - 2 / 64) < 1e-12
    # differences of both signs around 0: within noise, p = 1 for a zero mean
    noisy = learning.paired_comparison({0: 1.0, 1: 0.0, 2: 0.5, 3: 0.5}, {0: 0.0, 1: 1.0, 2: 0.5, 3: 0.5})
    assert noisy["mean_difference"] == 0.0 and noisy["within_noise"] and noisy["permutation_p"] == 1.0
    lo, hi = noisy["t_ci95"]
    assert lo < 0 < hi and noisy["bootstrap_ci95"][0] <= 0 <= noisy["bootstrap_ci95"][1]
    # only the seeds both methods ran are paired
    assert learning.paired_comparison({0: 1.0, 1: 0.5, 7: 0.2}, {0: 0.5, 1: 0.5})["seeds"] == [0, 1]
    methods = {m: learning.summarize([_fake_run(s, m, [(0, 0.5, 0.2), (5, g, g)]) for s, g in enumerate(gs)], 0.8)
               for m, gs in (("grpo", [0.5, 0.9, 0.9]), ("gigpo", [0.9, 0.9, 1.0]))}
    cmp_ = learning.compare_methods(methods)
    assert [round(d, 6) for d in cmp_["finals"]["differences"]] == [0.4, 0.0, 0.1]
    text = learning.results_markdown({"tasks": {"numberline": {
        "threshold": 0.8, "random_policy_success": 0.05, "methods": methods, "gigpo_vs_grpo": cmp_,
        "warm_start_only": {"greedy_mean": 0.5, "sampled_mean": 0.2}}}})
    assert "| gigpo | 3 |" in text and "3 of 3" in text and "GiGPO - GRPO, final greedy, paired over 3 seeds" in text
    # any other method against GiGPO (issue 34), the same paired statistics
    methods["hgpo"] = learning.summarize([_fake_run(s, "hgpo", [(0, 0.5, 0.2), (5, g, g)])
                                          for s, g in enumerate([1.0, 0.8, 1.0])], 0.8)
    vs = learning.compare_methods(methods, "hgpo", "gigpo")
    assert vs["difference"] == "hgpo - gigpo" and [round(d, 6) for d in vs["finals"]["differences"]] == [0.1, -0.1, 0.0]
    text = learning.results_markdown({"tasks": {"numberline": {
        "threshold": 0.8, "random_policy_success": 0.05, "methods": methods, "gigpo_vs_grpo": cmp_,
        "vs_gigpo": {"grpo": learning.compare_methods(methods, "grpo", "gigpo"), "hgpo": vs},
        "warm_start_only": {"greedy_mean": 0.5, "sampled_mean": 0.2}}}})
    assert "hgpo - GiGPO, final greedy, paired over 3 seeds: +0.000" in text and "grpo - GiGPO" not in text


def test_methods_that_all_solve_the_task_are_still_told_apart_by_how_soon():
    """Where every seed of both methods ends solved, the finals tie; the greedy panel's mean over the
    RL evaluations and the training success's mean per seed are paired as well (a run JSON without
    training success, an old one, drops out of that pair only)."""
    learning = _learning_module()
    fast = [_fake_run(s, "gigpo", [(0, 0.4, 0.2), (5, 1.0, 1.0), (10, 1.0, 1.0)]) for s in range(4)]
    slow = [_fake_run(s, "hgpo", [(0, 0.4, 0.2), (5, 0.5 + 0.1 * s, 0.5), (10, 1.0, 1.0)]) for s in range(4)]
    for run in fast + slow:
        run["train_success"] = [0.9, 1.0] if run["method"] == "gigpo" else [0.5, 1.0]
    del slow[3]["train_success"]
    methods = {"gigpo": learning.summarize(fast, 0.8), "hgpo": learning.summarize(slow, 0.8)}
    assert methods["hgpo"]["curve_means"] == [0.75, 0.8, 0.85, 0.9] and methods["hgpo"]["train_success_means"][3] is None
    vs = learning.compare_methods(methods, "hgpo", "gigpo")
    assert vs["finals"]["mean_difference"] == 0.0 and vs["finals"]["within_noise"]
    assert abs(vs["curve_means"]["mean_difference"] + 0.175) < 1e-9 and not vs["curve_means"]["within_noise"]
    assert vs["train_success_means"]["seeds"] == [0, 1, 2]
    assert abs(vs["train_success_means"]["mean_difference"] + 0.2) < 1e-9
    text = learning.results_markdown({"tasks": {"numberline": {
        "threshold": 0.8, "random_policy_success": 0.05, "methods": methods, "vs_gigpo": {"hgpo": vs}}}})
    assert "hgpo - GiGPO, greedy panel's mean over the RL evaluations, paired over 4 seeds: -0.175" in text
    assert "hgpo - GiGPO, training success's mean over the iterations, paired over 3 seeds: -0.200" in text


def test_report_summarises_finished_runs_without_running_the_missing_ones(tmp_path, monkeypatch, capsys):
    """--report reads the run JSONs in --out, names the missing runs and runs nothing: GiGPO with
    3 seeds beside GRPO with 2 is paired over the 2 both finished."""
    import json

    learning = _learning_module()
    finals = {("gigpo", 0): 1.0, ("gigpo", 1): 0.9, ("gigpo", 2): 1.0, ("grpo", 0): 0.5, ("grpo", 1): 0.9}
    here = learning.environment()
    elsewhere = {**here, "numpy": "0.0+elsewhere"}
    for (method, seed), final in finals.items():
        run = _fake_run(seed, method, [(0, 0.4, 0.1), (5, final, final)])
        if seed < 2:  # seed 2 is an old run's JSON, without its environment
            run["environment"] = elsewhere if (method, seed) == ("grpo", 1) else here
        with open(tmp_path / f"numberline_{method}_seed{seed}.json", "w") as f:
            json.dump(run, f)
    monkeypatch.setattr(learning, "random_valid_success", lambda task, episodes, **kw: 0.05)
    monkeypatch.setattr(learning, "constant_move_success", lambda task, episodes, *a: {"+": 0.25, "-": 0.75})
    monkeypatch.setattr(learning, "blind_ceiling", lambda task, episodes, *a: {"success": 0.75, "plan": "- -"})
    monkeypatch.setattr(sys, "argv", ["learning.py", "--report", "--tasks", "numberline", "--seeds", "0", "1", "2",
                                      "--out", str(tmp_path), "--plot", str(tmp_path / "curves.png")])
    learning.main()
    out, err = capsys.readouterr()
    info = json.loads(out.strip().splitlines()[-1])["tasks"]["numberline"]
    assert "not finished: numberline grpo seed 2" in err and "gigpo seed" not in err
    assert info["methods"]["gigpo"]["finals"] == [1.0, 0.9, 1.0] and info["methods"]["grpo"]["seeds"] == [0, 1]
    assert info["warm_start_only"]["seeds"] == [0, 1, 2] and info["constant_move_success"] == {"+": 0.25, "-": 0.75}
    assert info["gigpo_vs_grpo"]["finals"]["seeds"] == [0, 1]
    assert info["environments"] == [here, elsewhere] or info["environments"] == [elsewhere, here]
    assert here["torch"] == torch.__version__ and here["transformers"]  # what a rerun must match
    assert info["vs_gigpo"]["grpo"]["finals"]["mean_difference"] == -info["gigpo_vs_grpo"]["finals"]["mean_difference"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json") == sorted(
        f"numberline_{m}_seed{s}.json" for m, s in finals)  # nothing new was run


def test_a_constant_move_wins_the_numberline_games_on_its_side():
    """The blind ceiling of the NumberLine tasks (text and image): a move played every step wins
    exactly the games whose target lies on its side (12 steps cover the largest distance, 9), so
    the two moves' successes sum to 1, on the 64-game evaluation panel as on any other."""
    learning = _learning_module()
    for task in ("numberline", "vision_upright"):
        constant = learning.constant_move_success(task, 64)
        assert sorted(constant) == ["+", "-"] and math.isclose(sum(constant.values()), 1.0)
        assert 0.3 < min(constant.values()), constant  # both sides are drawn
    assert learning.constant_move_success("vision_upright", 64) == learning.constant_move_success("numberline", 64)  # one panel


def test_blind_ceiling_is_the_best_fixed_plan_and_the_bar_of_the_blanked_control():
    """``blind_ceiling`` tries every fixed sequence of moves on the panel. On a 6-step NumberLine with
    near targets the best one sweeps (it is no constant move) and replaying it wins what it reports.
    On the upright vision task's panel no plan of 12 moves beats ``-`` x12 (0.578): the most its
    blanked control (a black frame, no memory: one prompt every step) can win."""
    import itertools

    learning = _learning_module()
    short = ["env.max_steps=6", "env.kwargs.min_distance=1", "env.kwargs.max_distance=3"]
    ceiling = learning.blind_ceiling("numberline", 16, short)
    plan = ceiling["plan"].split()
    assert len(plan) == 6 and set(plan) == {"-", "+"}, ceiling
    calls = itertools.count()  # the 16 games step together: call // 16 is the step
    assert learning.scripted_success("numberline", 16, lambda admissible: plan[next(calls) // 16], short) == ceiling["success"]
    assert ceiling["success"] > max(learning.constant_move_success("numberline", 16, short).values())
    upright = learning.blind_ceiling("vision_upright", 64)
    assert upright == {"success": learning.constant_move_success("vision_upright", 64)["-"], "plan": " ".join(["-"] * 12)}
    assert learning.blind_ceiling("numberline", 16, ["+env.kwargs.stop_action=true"]) is None  # 3 ** 12 plans


def test_on_the_vision_task_a_blind_policy_plays_at_the_random_policys_level():
    """``vision`` (the view drawn either way up each step): on the same 256 held-out games, a
    constant move wins about half of ``vision_upright``'s and no more than a random walk of ``vision``'s;
    the games themselves are the same (the random valid policy's level barely moves)."""
    learning = _learning_module()
    assert learning.compose_config(["experiment=learning_vision"]).env.kwargs["mirror"] is True
    assert learning.compose_config(["experiment=learning_vision_upright"]).env.kwargs.get("mirror", False) is False
    plain, mirror = (learning.constant_move_success(task, 256) for task in ("vision_upright", "vision"))
    random_plain, random_mirror = (learning.random_valid_success(task, 256) for task in ("vision_upright", "vision"))
    assert min(plain.values()) > 0.4 and max(mirror.values()) < 0.1
    assert abs(random_mirror - random_plain) < 0.03 and max(mirror.values()) < 2 * random_mirror


def test_random_valid_policy_rarely_wins_the_benchmark_tasks():
    """The warm-started tasks are hard for a random walk; the pretrained task is not (its start is a
    zero-shot model that rarely answers in the reference's format at all: what RL must lift first),
    but a random valid policy still loses most of its games."""
    learning = _learning_module()
    for task in learning.TASKS:
        assert learning.random_valid_success(task, episodes=32) <= (0.5 if task == "pretrained" else 0.2), task


def test_summary_reports_success_after_warm_start(tmp_path):
    from torchrl_agent.trainers.cli import compose_config
    from torchrl_agent.trainers.trainer import Trainer

    cfg = compose_config(["experiment=learning_ezpoints", "warm_start.steps=2", "warm_start.episodes=8",
                          "iterations=1", "eval_every=1", "env.eval_episodes=4", "env.num_groups=1",
                          "env.group_size=2", "progress=false", f"run_dir={tmp_path}"])
    summary = Trainer(cfg).train()
    curve = dict(summary["eval_curve"])
    assert summary["eval_success_after_warm_start"] == curve[0]
    assert summary["eval_success_last"] == curve[1]


def test_numberline_distance_bounds_hold_for_every_seed():
    from torchrl_agent.envs.games.numberline import NumberLineGame

    game = NumberLineGame(max_position=9, min_distance=6, max_distance=9)
    distances = set()
    for seed in range(200):
        game.reset(seed)
        distances.add(abs(game.target - game.position))
    assert distances == {6, 7, 8, 9}
    try:
        NumberLineGame(max_position=5, min_distance=6)
    except ValueError as err:
        assert "min_distance" in str(err)
    else:
        raise AssertionError("an impossible distance range was accepted")


def test_expert_noise_makes_the_demonstrator_act_at_random_at_that_rate():
    """epsilon = 0: every demonstrated action is the expert's; epsilon = 1: about half of the
    NumberLine demonstrations (two actions) disagree with the expert, and the data stays valid."""
    from transformers import AutoTokenizer

    from torchrl_agent.models.tiny import build_tiny_model
    from torchrl_agent.trainers.cli import compose_config
    from torchrl_agent.trainers.warm_start import expert_rows

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())

    def disagreement(noise: float) -> float:
        cfg = compose_config(["experiment=smoke", "env.num_groups=8", "env.group_size=1",
                              f"warm_start.expert_noise={noise}", "warm_start.think="])
        rows = expert_rows(cfg, tokenizer, episodes=64)
        wrong = 0
        for row in rows.unbind(0):
            prompt, response = (tokenizer.decode(row["tokens", key]) for key in ("prompt", "response"))
            pos, target = (int(x) for x in re.findall(r"Position: (\d+)\. Target: (\d+)\.", prompt)[-1])
            expert = "+" if target > pos else "-"
            assert response.count("<action>") == 1
            wrong += f"<action>{expert}</action>" not in response
        return wrong / rows.batch_size[0]

    assert disagreement(0.0) == 0.0
    assert 0.3 < disagreement(1.0) < 0.7


def test_balanced_warm_start_gives_every_state_every_move_in_each_batch():
    """warm_start.balanced: each random demonstration step holds every admissible move once, and a
    mini-batch is made of whole steps, so its move labels are exactly uniform (no move bias)."""
    from transformers import AutoTokenizer

    from torchrl_agent.models.tiny import build_tiny_model
    from torchrl_agent.trainers.cli import compose_config
    from torchrl_agent.trainers.warm_start import batch_indices, expert_rows

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    cfg = compose_config(["experiment=smoke", "env.num_groups=8", "env.group_size=1", "warm_start.expert_noise=1.0",
                          "warm_start.think=", "warm_start.balanced=true"])
    rows = expert_rows(cfg, tokenizer, episodes=16)
    moves = [re.findall(r"<action>(.*?)</action>", tokenizer.decode(r)) for r in rows["tokens", "response"]]
    by_state: dict[int, list[str]] = {}
    for state, move in zip(rows["state"].tolist(), moves):
        by_state.setdefault(state, []).append(move[0])
    assert by_state and all(sorted(m) == ["+", "-"] for m in by_state.values())
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        idx = batch_indices(rows, 8, generator)
        assert len(idx) == 8 and sorted(moves[i][0] for i in idx).count("+") == 4
        assert all(sorted(rows["state"][idx].tolist()).count(s) == 2 for s in rows["state"][idx].tolist())
    plain = expert_rows(compose_config(["experiment=smoke", "warm_start.expert_noise=1.0"]), tokenizer, episodes=16)
    assert plain["state"].tolist() == list(range(plain.batch_size[0]))  # one row per step: drawn row by row


def test_numberline_invalid_reward_is_what_a_no_op_returns():
    from torchrl_agent.envs.games.numberline import NumberLineGame

    for reward in (0.0, -1.0):
        game = NumberLineGame(max_position=9, min_distance=6, invalid_reward=reward)
        before = game.reset(3).observation
        state, r, terminated, truncated = game.step("jump")
        assert (r, terminated, truncated, state.observation) == (reward, False, False, before)


def test_numberline_relative_observation_describes_the_same_state():
    """The relative observation is the offset to the target, step after step, and the game (moves,
    rewards, expert) is the absolute one's: same seed, same actions, same outcome."""
    from torchrl_agent.envs.games.numberline import NumberLineGame

    absolute = NumberLineGame(max_position=9, min_distance=6, max_distance=9)
    relative = NumberLineGame(max_position=9, min_distance=6, max_distance=9, observation="relative")
    for seed in range(20):
        a, r = absolute.reset(seed), relative.reset(seed)
        for step in range(14):
            action = ["+", "-", "+", "+", "x"][step] if step < 5 else a.expert_action
            pos, target = (int(x) for x in re.findall(r"Position: (\d+)\. Target: (\d+)\.", a.observation)[0])
            offset = target - pos
            side = "right" if offset > 0 else "left"
            unit = "step" if abs(offset) == 1 else "steps"
            assert r.observation == f"The target is {abs(offset)} {unit} to your {side}."
            assert r.expert_action == a.expert_action
            a, ra, ta, _ = absolute.step(action)
            r, rr, tr, _ = relative.step(action)
            assert (ra, ta) == (rr, tr)
            if ta:
                assert r.observation == "You are on the target."
                break
    try:
        NumberLineGame(observation="visual")
    except ValueError as err:
        assert "observation" in str(err)
    else:
        raise AssertionError("an unknown observation kind was accepted")


def test_kl_reference_is_the_warm_started_policy(tmp_path):
    """With a KL term and a warm start, the frozen reference is the policy after the warm start
    (what RL starts from), not the untrained model; the RL optimiser takes ``algorithm.adam_eps``."""
    from torchrl_agent.trainers.cli import compose_config
    from torchrl_agent.trainers.trainer import Trainer

    cfg = compose_config(["experiment=smoke", "warm_start.steps=3", "warm_start.episodes=8", "iterations=0",
                          "eval_every=0", "env.eval_episodes=2", "env.num_groups=1", "env.group_size=2",
                          "algorithm.kl_coef=0.01", "algorithm.adam_eps=1e-5", "progress=false",
                          f"run_dir={tmp_path}"])
    trainer = Trainer(cfg)
    assert [g["eps"] for g in trainer.updater.optimizer.param_groups] == [1e-5]
    untrained = {k: v.clone() for k, v in trainer.reference.state_dict().items()}
    trainer.train()
    model, reference = trainer.model.state_dict(), trainer.reference.state_dict()
    assert any(not torch.equal(untrained[k], reference[k]) for k in untrained)
    assert all(torch.equal(model[k].to(reference[k].dtype), reference[k]) for k in reference)


def test_warm_start_moves_is_a_distribution_over_the_admissible_moves(tmp_path):
    import argparse

    learning = _learning_module()
    args = argparse.Namespace(out=str(tmp_path), iterations=None, quick=False,
                              set=["warm_start.steps=2", "warm_start.episodes=8", "env.num_groups=2",
                                   "env.group_size=2"])
    out = learning.warm_start_moves("numberline", 0, args, max_prompts=6)
    assert set(out["move_prob_mean"]) == {"+", "-"} and 1 <= out["prompts"] <= 6
    assert abs(sum(out["move_prob_mean"].values()) - 1.0) < 1e-6
    assert 0.5 <= out["top_move_prob_mean"] <= 1.0 and 0.0 <= out["state_dependence"] <= 1.0
    assert 0.0 < out["valid_mass_mean"] <= 1.0


def test_a_killed_benchmark_leaves_no_run_behind(tmp_path):
    """``kill -9`` of ``learning.py`` ends its runs too (each pool process dies with it): a stopped
    benchmark does not keep training in the background."""
    import signal
    import subprocess
    import time

    out = tmp_path / "runs"
    bench = subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", "learning.py"), "--tasks", "numberline",
                              "--methods", "grpo", "--seeds", "0", "1", "--jobs", "2", "--out", str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = [out / "numberline_grpo_seed0", out / "numberline_grpo_seed1"]
    deadline = time.monotonic() + 240
    while not all(r.is_dir() for r in runs) and time.monotonic() < deadline and bench.poll() is None:
        time.sleep(0.5)
    assert all(r.is_dir() for r in runs), "both runs should have started"
    children = [int(p) for p in open(f"/proc/{bench.pid}/task/{bench.pid}/children").read().split()]
    assert len(children) >= 2
    bench.send_signal(signal.SIGKILL)
    bench.wait()
    deadline = time.monotonic() + 20
    alive = children
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if os.path.exists(f"/proc/{p}") and
                 open(f"/proc/{p}/stat").read().split(")")[-1].split()[0] != "Z"]
    for pid in alive:  # a failing run of this test does not leave them running either
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"runs left behind: {alive}"


def test_a_failed_run_is_reported_when_it_fails_and_the_finished_runs_are_still_summarised(tmp_path):
    """A run that fails (here: its folder is held by a live process) is reported on stderr as it
    fails; the benchmark still summarises the runs that finished, then exits non-zero naming it."""
    import socket
    import subprocess

    from torchrl_agent.trainers.run_dir import _start_time

    out = tmp_path / "runs"
    (out / "numberline_grpo_seed0").mkdir(parents=True)
    with open(out / "numberline_grpo_seed1.json", "w") as f:  # seed 1 finished earlier
        json.dump(_fake_run(1, "grpo", [(0, 0.4, 0.1), (5, 0.9, 0.8)]), f)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        (out / "numberline_grpo_seed0" / ".lock").write_text(json.dumps(
            {"pid": holder.pid, "host": socket.gethostname(), "started": _start_time(holder.pid)}))
        bench = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "learning.py"), "--tasks", "numberline",
                                "--methods", "grpo", "--seeds", "0", "1", "--out", str(out),
                                "--plot", str(tmp_path / "curves.png")], capture_output=True, text=True, timeout=600)
    finally:
        holder.kill()
        holder.wait()
    assert bench.returncode != 0
    assert "run numberline grpo 0 failed" in bench.stderr and "held by a running run" in bench.stderr
    assert bench.stderr.strip().splitlines()[-1] == "1 run(s) failed: numberline grpo seed 0"
    info = json.loads(bench.stdout.strip().splitlines()[-1])["tasks"]["numberline"]
    assert info["methods"]["grpo"]["seeds"] == [1] and info["methods"]["grpo"]["finals"] == [0.9]
    assert not (out / "numberline_grpo_seed0.json").exists()


def test_update_diagnosis_records_every_step_and_finds_the_moved_tokens(tmp_path):
    """benchmarks/update_diagnosis.py: one record per optimizer step, with the step's epoch and
    mini-batch, every row counted once per epoch, a KL per token kind; at a large lr the steps move the
    policy (the KL is positive) and AdamW moves some weight by at least a tenth of the lr."""
    spec = importlib.util.spec_from_file_location("update_diagnosis",
                                                  os.path.join(ROOT, "benchmarks", "update_diagnosis.py"))
    diag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diag)
    from torchrl_agent.trainers.cli import compose_config

    cfg = compose_config(["experiment=smoke", "env.num_groups=2", "env.group_size=2", "env.max_steps=3",
                          "rollout.max_new_tokens=8", "iterations=1", "eval_every=0", "env.eval_episodes=2",
                          "algorithm.lr=1e-2", "algorithm.epochs=2", "algorithm.minibatch_size=4",
                          "progress=false", f"run_dir={tmp_path}"])
    trainer = diag.DiagnosedTrainer(cfg)
    rows = trainer.advantage(trainer.collector.collect())
    metrics = trainer.update(rows)
    n = rows.batch_size[0]
    assert len(trainer.steps) == metrics["update_steps"] == 2 * -(-n // 4)
    assert [s["epoch"] for s in trainer.steps] == [0] * (len(trainer.steps) // 2) + [1] * (len(trainer.steps) // 2)
    assert sum(s["rows"] for s in trainer.steps) == 2 * n
    for s in trainer.steps:
        kinds = [s[f"step_kl_{k}"] for k in ("format", "action", "eos")]
        assert any(k is not None for k in kinds) and s["tokens"] > 0
        assert s["update_max_over_lr"] > 0.1 and s["step_kl"] >= 0
    assert max(s["step_kl"] for s in trainer.steps) > 1e-4
    first = trainer.steps[0]
    assert abs(first["approx_kl_before"]) < 1e-5  # the first step starts at the sampling policy
    assert set(diag.token_kinds(trainer.tokenizer, torch.tensor([trainer.tokenizer.eos_token_id]))) == {"eos"}
    trainer.close()


def test_pretrained_task_starts_from_the_zero_shot_model(tmp_path):
    """``--tasks pretrained`` (issue 36), shortened: SmolLM2-135M-Instruct with no warm start, the
    reference's NumberLine prompt and parsing, GiGPO with the KL term to the start, one iteration.
    Point 0 of the panel is the zero-shot model (no warm start ran), the update ran through the same
    trainer (a KL to the reference, a finite gradient), and the final point follows it."""
    import argparse

    learning = _learning_module()
    cfg = learning.compose_config(["experiment=learning_pretrained"])
    assert (cfg.model.name, cfg.warm_start.steps, cfg.algorithm.name) == ("smollm2-135m", 0, "gigpo")
    assert cfg.algorithm.kl_coef > 0 and cfg.algorithm.max_kl is not None
    assert (cfg.env.template, cfg.env.action_format, cfg.rollout.eval_temperature) == ("reference", "reference", 0.4)
    args = argparse.Namespace(out=str(tmp_path), iterations=None, quick=False, diagnose=False,
                              set=["iterations=1", "eval_every=1", "env.num_groups=2", "env.group_size=2",
                                   "env.eval_episodes=2", "env.max_steps=2", "rollout.max_new_tokens=12"])
    run = learning.run_one("pretrained", "gigpo", 0, args)
    assert run["warm_start_loss"] is None  # no warm start: the start is the zero-shot model
    assert [p["iteration"] for p in run["panel"]] == [0, 1]
    assert all(0.0 <= p[k] <= 1.0 for p in run["panel"] for k in ("greedy", "sampled", "greedy_action_valid"))
    assert len(run["train_success"]) == 1 and run["rl_s_per_iteration"] > 0
    assert (tmp_path / "pretrained_gigpo_seed0.json").exists()
    metrics = [json.loads(line) for line in open(tmp_path / "pretrained_gigpo_seed0" / "metrics.jsonl")]
    update = next(m for m in metrics if "update_steps" in m)
    assert update["update_steps"] == 1 and math.isfinite(update["grad_norm"])
    assert "kl_ref" in update and update["approx_kl_max"] <= cfg.algorithm.max_kl  # the KL to the start is in the loss


def test_vision_probe_prints_its_json_last(tmp_path):
    """benchmarks/vision_probe.py (can the tiny VLM read a frame layout, supervised): at step 0 the
    accuracy over the 90 states of the vision task is measured and printed as the last line's JSON."""
    import subprocess

    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "vision_probe.py"), "--steps", "0",
                          "--layout", "row", "--rope-theta", "100"], capture_output=True, text=True, timeout=600,
                         check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["layout"] == "row" and result["steps"] == 0 and result["rope_theta"] == 100.0  # the model it built
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "vision_probe.py"), "--steps", "0",
                          "--rope-theta", "0"], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "rope_theta must be a positive number, got 0.0" in bad.stderr
    assert [p["step"] for p in result["curve"]] == [0] and 0.0 <= result["final_accuracy"] <= 1.0


def test_an_interrupted_run_starts_again_and_a_live_one_is_left_alone(tmp_path):
    """A run killed before its JSON leaves its folder (metrics, checkpoints, a stale lock): the next
    benchmark deletes what it left and takes the folder (the Trainer would refuse a folder that holds
    a run); a folder held by a live process (a second benchmark on the same ``--out``) is refused
    and kept as it is."""
    import socket
    import subprocess

    import pytest

    from torchrl_agent.trainers.run_dir import RunDirBusyError, _start_time

    learning = _learning_module()
    run_dir = tmp_path / "numberline_grpo_seed3"
    (run_dir / "checkpoints" / "iter_2").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"iteration": 1}\n')
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run_dir / ".lock").write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    learning.start_over(str(run_dir))
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    assert json.loads((run_dir / ".lock").read_text())["pid"] == os.getpid()

    busy = tmp_path / "numberline_grpo_seed4"
    busy.mkdir()
    (busy / "metrics.jsonl").write_text('{"iteration": 1}\n')
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (busy / ".lock").write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(),
                                                "started": _start_time(holder.pid)}))
        with pytest.raises(RunDirBusyError, match="held by a running run"):
            learning.start_over(str(busy))
        assert (busy / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()


def test_every_method_composes_on_every_task_with_only_its_own_settings_apart():
    """The benchmark's overrides for ``--methods gigpo hgpo graphgpo grpo`` (issue 34) compose on
    each text task, and the configs differ from GiGPO's only in the algorithm (and GraphGPO's
    gamma, :data:`METHOD_SETTINGS`)."""
    import argparse

    learning = _learning_module()
    args = argparse.Namespace(out="runs/x", iterations=None, quick=False, set=None)
    for task in ("numberline", "babyai", "babyai_sparse"):
        base = learning.compose_config(learning.overrides_for(task, "gigpo", 0, args))
        for method in ("hgpo", "graphgpo", "grpo"):
            cfg = learning.compose_config(learning.overrides_for(task, method, 0, args))
            assert cfg.algorithm.name == method and cfg.env == base.env and cfg.model == base.model
            assert (cfg.algorithm.lr, cfg.algorithm.max_update_kl) == (base.algorithm.lr, base.algorithm.max_update_kl)
            assert cfg.algorithm.gamma == (0.95 if method == "graphgpo" else base.algorithm.gamma)
    # the long-credit task is the BabyAI task without its shaping, and discounts for every method
    shaped, sparse = (learning.compose_config([f"experiment=learning_{t}"]) for t in ("babyai", "babyai_sparse"))
    assert shaped.env.kwargs["shaping"] == "distance" and sparse.env.kwargs["shaping"] is None
    assert sparse.algorithm.gamma == 0.95 and shaped.algorithm.gamma == 0.0
    assert {k: v for k, v in sparse.env.kwargs.items() if k != "shaping"} == {
        k: v for k, v in shaped.env.kwargs.items() if k != "shaping"}


def test_advantage_split_recomputes_the_trainers_advantages():
    """benchmarks/advantage_split.py (issue 36): the variant of the run's own settings reproduces the
    advantages the trainer wrote, each variant counts every row once as valid or invalid, and an
    invalid answer paid far below any move's reward leaves the invalid rows a negative mean advantage
    (where both kinds of row were sampled); ``--update`` reports each kind of row's log-prob change."""
    spec = importlib.util.spec_from_file_location("advantage_split",
                                                  os.path.join(ROOT, "benchmarks", "advantage_split.py"))
    split = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(split)
    # a short format warm start: the first batch holds valid and invalid answers (6 of 32 valid)
    result = split.main(["--set", "experiment=learning_numberline", "warm_start.steps=10", "env.num_groups=2",
                         "env.group_size=4", "env.max_steps=4", "env.eval_episodes=2", "progress=false",
                         "--invalid-rewards", "-100", "0", "--gammas", "0", "--algorithms", "gigpo", "grpo", "--update"])
    assert result["matches_trainer"]
    assert 0 < result["valid_rows"] < result["rows"]
    assert len(result["variants"]) == 4
    for v in result["variants"]:
        assert v["valid"]["rows"] + v["invalid"]["rows"] == result["rows"]
        assert v["valid"]["rows"] == result["valid_rows"]
    harsh = [v for v in result["variants"] if v["invalid_reward"] == -100]
    assert all(v["invalid"]["mean"] < 0 < v["valid"]["mean"] for v in harsh)
    change = result["update"]["token_log_prob_change"]
    assert change["valid"]["rows"] + change["invalid"]["rows"] == result["rows"]
    assert all(math.isfinite(c["mean"]) for c in change.values() if c["rows"])

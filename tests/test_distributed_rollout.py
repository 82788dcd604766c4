"""Training under torchrun with colocated rollout engines: every rank collects its share of the groups
with its own vLLM engine, recomputes its share of the log-probs, and loads the weights after each update.

The worker half (``worker``) runs under ``torchrun`` in conftest's ``torchrun_launch``
(tests/torchrun_worker.py, 2 processes, after tests/test_distributed.py's worker): one training run
of 2 iterations with the vLLM CPU engine (the tiny model: head size 32, one vLLM CPU supports), then
one more batch collected after the last weight sync; the tests read what the ranks wrote.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from torchrl_agent.trainers.distributed import balanced_split, split_over_ranks

pytest.importorskip("vllm")

TOL = 1e-4  # engine sampling log-probs against the trainer's recomputation (float32 on both sides)


def test_balanced_split_puts_every_item_on_one_part_with_balanced_costs():
    costs = [7, 1, 3, 9, 2, 2, 8, 5]
    parts = balanced_split(costs, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    loads = [sum(costs[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(costs) and all(p == sorted(p) for p in parts)
    assert balanced_split(costs, 1) == [list(range(len(costs)))]
    with pytest.raises(ValueError, match="parts"):
        balanced_split(costs, 0)


def test_split_over_ranks_in_one_process_runs_every_item_in_the_given_passes():
    passes = []

    def compute(idx):
        passes.append(list(idx))
        return [torch.tensor([float(i)]) for i in idx]

    out, share = split_over_ranks(compute, [3, 1, 2, 5], lambda s: [s[:2], s[2:]])
    assert share == [0, 1, 2, 3] and passes == [[0, 1], [2, 3]]
    assert [float(o) for o in out] == [0.0, 1.0, 2.0, 3.0]


def worker(out_dir: str, run_dir: str) -> None:
    from torchrl_agent.collectors import DistributedStepCollector
    from torchrl_agent.modules import ResponseLogProbs, VLLMPolicy
    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.cli import compose_config
    from torchrl_agent.trainers.distributed import all_gather_object, get_rank

    torch.set_num_threads(1)
    cfg = compose_config(["experiment=smoke", "rollout.engine=vllm", "iterations=2", "eval_every=0",
                          "env.num_groups=3", "env.group_size=2", "env.eval_episodes=3", "env.max_steps=3",
                          "rollout.max_new_tokens=8", "algorithm.lr=1e-2", "algorithm.kl_coef=0.05",
                          "algorithm.micro_batch_tokens=64", "progress=false", "device=cpu", f"run_dir={run_dir}"])
    trainer = Trainer(cfg)
    rank = get_rank()
    result = {"rank": rank, "engine": isinstance(trainer.policy, VLLMPolicy),
              "collector": type(trainer.collector).__name__,
              "groups": DistributedStepCollector.groups_of(cfg.env.num_groups)}
    trainer.train()  # 2 iterations: a weight sync after each update
    # one more batch, sampled after the last weight sync, recomputed split over the ranks
    rows = trainer.collector.collect()
    old = trainer.scorer.recompute(trainer.model, rows)
    result["share"] = trainer.scorer.recomputed_rows
    trainer.scorer.score(rows)
    with torch.no_grad():  # every row on every rank, as a single process would
        full = ResponseLogProbs(trainer.model, trainer.tokenizer.pad_token_id, with_entropy=False)(rows)
    whole = [lp[: int(n)] for lp, n in zip(full["log_prob"], full["mask"].sum(-1))]
    result["split_vs_whole"] = max(float((a - b).abs().max()) for a, b in zip(old, whole) if len(a))
    result["after_last_sync"] = trainer.scorer.logprob_consistency(rows)
    result["owners"] = trainer.collector.owner(rows).tolist()
    result["rows"] = [r.tolist() for r in rows.get(("tokens", "response"), as_list=True)]
    result["traj"] = rows["traj_id"].reshape(-1).tolist()
    result["all_ranks_same_rows"] = len({json.dumps(r) for r in all_gather_object(result["rows"])}) == 1
    with open(os.path.join(out_dir, f"colocated_rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def run(torchrun_launch):
    out = torchrun_launch
    ranks = [json.loads((out / f"colocated_rank{r}.json").read_text()) for r in range(2)]
    metrics = [json.loads(line) for line in (out / "colocated_run" / "metrics.jsonl").read_text().splitlines()]
    return ranks, metrics


def test_torchrun_with_vllm_trains_and_every_engine_matches_the_trainer_after_each_sync(run):
    ranks, metrics = run
    assert all(r["engine"] and r["collector"] == "DistributedStepCollector" for r in ranks)
    assert [r["groups"] for r in ranks] == [[2, 0], [1, 2]]  # whole groups per engine
    iterations = [m for m in metrics if "loss" in m]
    assert [m["iteration"] for m in iterations] == [0, 1]  # both iterations trained
    for m in iterations:  # iteration 1 was sampled after the first weight sync
        assert m["skipped_steps"] == 0 and m["weight_sync_s"] > 0
        assert m["logprob_diff_max/engine0"] <= TOL and m["logprob_diff_max/engine1"] <= TOL
    for r in ranks:  # and a batch after the second sync, every engine's rows
        assert set(r["owners"]) == {0, 1}
        assert r["after_last_sync"]["logprob_diff_max/engine0"] <= TOL
        assert r["after_last_sync"]["logprob_diff_max/engine1"] <= TOL
    assert ranks[0]["all_ranks_same_rows"]  # every rank holds the whole batch


def test_torchrun_recomputes_each_row_on_one_rank_and_gathers_the_single_process_result(run):
    ranks, _ = run
    n = len(ranks[0]["rows"])
    shares = [set(r["share"]) for r in ranks]
    assert shares[0] and shares[1] and not shares[0] & shares[1]  # disjoint, both ranks work
    assert shares[0] | shares[1] == set(range(n))  # complete
    assert all(r["split_vs_whole"] <= 1e-6 for r in ranks)  # gathered = every row on one process

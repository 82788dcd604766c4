"""FSDP2 data parallelism: 2 CPU processes (gloo, torchrun) take the same clipped-loss steps as one.

The worker half of this file (``worker``) runs under ``torchrun`` in conftest's ``torchrun_launch``
(tests/torchrun_worker.py, 2 processes); the tests compare what it writes with the same steps taken
in the pytest process without any process group.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from torchrl_agent.modules import ResponseLogProbs
from torchrl_agent.objectives import ClipPolicyLoss
from torchrl_agent.objectives.clip_loss import AGGREGATIONS
from torchrl_agent.trainers.batching import micro_batches
from torchrl_agent.trainers.distributed import (
    clip_grad_norm,
    distributed_loss_scale,
    full_optimizer_state_dict,
    full_state_dict,
    get_rank,
    init_distributed,
    is_main_process,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    reduce_mean,
    shard_indices,
    shard_model,
)

PROMPT_LENGTHS = (6, 4, 9, 5, 3)
RESPONSE_LENGTHS = (3, 7, 2, 5, 4)  # unequal: the two ranks see different token counts
ADVANTAGES = (1.0, -0.5, 0.8, -1.2, 0.3)
MINIBATCHES = ([0, 1, 2, 3, 4], [2])  # the second leaves rank 1 without a row
LR, GRAD_CLIP = 1e-3, 0.05  # the clip is active: it checks the norm over all shards
# every row alone: rank 0 runs 3 micro-batches of the first mini-batch, rank 1 runs 2 and a weightless one
MICRO_BATCH_TOKENS = 12


def make_rows(vocab_size: int) -> TensorDict:
    """Five fixed rows: ragged prompt/response token ids (in ``[3, vocab_size)``) and an advantage each."""
    g = torch.Generator().manual_seed(123)
    rows = []
    for p, r, a in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, ADVANTAGES):
        rows.append(TensorDict({
            "tokens": {"prompt": torch.randint(3, vocab_size, (p,), generator=g),
                       "response": torch.randint(3, vocab_size, (r,), generator=g)},
            "advantage": torch.tensor(a),
        }))
    return lazy_stack(rows)


def train_steps(model, optimizer=None, *, aggregation="token-mean", micro_batch_tokens=None, autocast=None) -> dict:
    """The clipped-loss steps of MINIBATCHES: each rank takes its rows of each mini-batch, in one
    forward/backward or (``micro_batch_tokens``) as accumulated token-budget micro-batches."""
    torch.manual_seed(0)
    autocast = autocast or contextlib.nullcontext
    rows = make_rows(model.config.vocab_size)
    actor = ResponseLogProbs(model, pad_token_id=0, chunk_tokens=4)
    with torch.no_grad(), autocast():  # old / reference log-probs: the current ones, perturbed (ratio != 1)
        full = actor(rows.copy())
        noise = torch.randn(full["log_prob"].shape, generator=torch.Generator().manual_seed(7))
        old = (full["log_prob"] + 0.3 * noise) * full["mask"]
        ref = (full["log_prob"] - 0.1 * noise.flip(-1)) * full["mask"]
    # seq-mean-token-sum-norm divides by a constant length, as the trainer passes (rollout.max_new_tokens):
    # its default, the padded width, differs between a micro-batch and the whole mini-batch
    loss_module = ClipPolicyLoss(eps_low=0.2, eps_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01,
                                 aggregation=aggregation, norm_length=16)
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    out = {"loss": [], "grad_norm": [], "clip_fraction": []}
    for idx in MINIBATCHES:
        local, active = shard_indices(idx)
        parts = ([(local, None, active)] if micro_batch_tokens is None else
                 micro_batches(rows, local, active, budget=micro_batch_tokens, aggregation=aggregation))
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for part, weight, live in parts:
            with autocast():
                mb = actor(rows[part])
            width = mb["log_prob"].shape[-1]
            mask = mb["mask"] & live
            batch = TensorDict({"log_prob": mb["log_prob"], "entropy": mb["entropy"], "mask": mask,
                                "old_log_prob": old[part, :width], "ref_log_prob": ref[part, :width],
                                "advantage": rows[part]["advantage"]}, batch_size=[len(part)])
            losses = loss_module(batch)
            total = sum(v for k, v in losses.items() if k.startswith("loss_"))
            scale = distributed_loss_scale(mask, loss_module.aggregation) if weight is None else weight
            (scale * total).backward()
            loss = loss + scale * total.detach()
        out["grad_norm"].append(float(clip_grad_norm(model.parameters(), GRAD_CLIP)))
        optimizer.step()
        out["loss"].append(reduce_mean(loss))
        out["clip_fraction"].append(float(losses["clip_fraction"]))
    out["state"] = full_state_dict(model)
    out["optimizer"] = full_optimizer_state_dict(model, optimizer)
    return out


def worker(out_path: str, model_path: str) -> None:
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    rank, world, device = init_distributed("cpu")
    assert world == 2 and device.type == "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train()
    model = shard_model(model)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    result = train_steps(model)
    # checkpoint round trip: rank 0's full states into a fresh sharded model and optimizer
    fresh = shard_model(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=LR, weight_decay=0.01)
    load_full_state_dict(fresh, result["state"])
    load_full_optimizer_state_dict(fresh, fresh_optimizer, result["optimizer"])
    result["reloaded_state"] = full_state_dict(fresh)
    result["reloaded_optimizer"] = full_optimizer_state_dict(fresh, fresh_optimizer)
    # gradient accumulation over token-budget micro-batches, every aggregation
    result["accumulation"] = {}
    for aggregation in AGGREGATIONS:
        sharded_model = shard_model(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train())
        steps = train_steps(sharded_model, aggregation=aggregation, micro_batch_tokens=MICRO_BATCH_TOKENS)
        result["accumulation"][aggregation] = {k: steps[k] for k in ("loss", "grad_norm", "state")}
    # bf16 compute over fp32 master weights: FSDP2's MixedPrecisionPolicy
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    bf16_model = shard_model(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train(),
                             mp_policy=policy)
    steps = train_steps(bf16_model, micro_batch_tokens=MICRO_BATCH_TOKENS)
    result["bf16"] = {"loss": steps["loss"], "grad_norm": steps["grad_norm"], "state": steps["state"],
                      "param_dtypes": {p.dtype for p in bf16_model.parameters()}}
    # activation checkpointing (model.gradient_checkpointing, non-reentrant) under FSDP2: the same steps
    from torchrl_agent.models import load_model
    from torchrl_agent.trainers.config import TrainConfig

    cfg = TrainConfig().model
    cfg.name, cfg.path, cfg.gradient_checkpointing = "hf", model_path, True
    checkpointed, _ = load_model(cfg, dtype=torch.float32)
    result["checkpointing_on"] = checkpointed.is_gradient_checkpointing
    steps = train_steps(shard_model(checkpointed.train()))
    result["checkpointing"] = {k: steps[k] for k in ("loss", "grad_norm", "state")}
    result.update(rank=get_rank(), sharded=sharded, tied=tied)
    # the Trainer itself, in the same launch (the process group exists: it joins it)
    result["trainer"] = _trainer_worker(str(os.path.join(os.path.dirname(out_path), "run")))
    if is_main_process():
        torch.save(result, out_path)
    else:  # the full states live on rank 0 only
        assert result["state"] == {} and result["reloaded_state"] == {}


def test_init_distributed_without_torchrun_is_a_single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    rank, world, device = init_distributed("cpu")
    assert (rank, world, device) == (0, 1, torch.device("cpu"))
    assert is_main_process()
    model = torch.nn.Linear(2, 2)
    assert shard_model(model) is model  # no process group: unchanged
    assert float(distributed_loss_scale(torch.ones(2, 3, dtype=torch.bool))) == 1.0
    assert shard_indices([4, 5, 6], 0, 1) == ([4, 5, 6], True)
    assert shard_indices([4, 5, 6], 1, 2) == ([5], True)
    assert shard_indices([4], 1, 2) == ([4], False)


def test_decoder_layers_are_found_generically(tiny_model):
    from torchrl_agent.trainers.distributed import decoder_layers

    layers = list(tiny_model.model.layers)
    assert len(layers) == tiny_model.config.num_hidden_layers
    assert all(a is b for a, b in zip(decoder_layers(tiny_model), layers))  # model.model.layers
    wrapped = torch.nn.ModuleDict({"backbone": tiny_model.model})  # no .model.layers: by class name
    found = decoder_layers(wrapped)
    assert len(found) == len(layers) and all(a is b for a, b in zip(found, layers))
    assert decoder_layers(torch.nn.Linear(2, 2)) == []


def test_bad_arguments_are_named(monkeypatch):
    import pytest

    with pytest.raises(ValueError, match="device"):
        init_distributed("tpu")
    with pytest.raises(ValueError, match="aggregation"):
        distributed_loss_scale(torch.ones(2, 3, dtype=torch.bool), "median")
    with pytest.raises(ValueError, match="rank"):
        shard_indices([1, 2], 2, 2)
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK"):
        init_distributed("cpu")


@pytest.fixture(scope="module")
def dist_result(torchrun_launch):
    """What the 2 FSDP2 processes wrote (conftest's launch, the Trainer's part included)."""
    return torch.load(torchrun_launch / "rank0.pt", weights_only=False)


def test_fsdp2_on_two_processes_matches_one_process(tiny_path, dist_result):
    from transformers import AutoModelForCausalLM

    assert dist_result["sharded"] and dist_result["tied"]

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    single = train_steps(model)

    torch.testing.assert_close(dist_result["loss"], single["loss"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dist_result["grad_norm"], single["grad_norm"], atol=1e-6, rtol=1e-5)
    assert single["grad_norm"][0] > GRAD_CLIP  # the clip was active
    assert 0 < single["clip_fraction"][0] < 1  # the perturbed ratios hit the clip on some tokens
    state = dist_result["state"]
    assert set(state) == set(single["state"])
    moved = 0
    for name, value in single["state"].items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=0, msg=name)
        moved += not torch.equal(value, before[name])
    assert moved == len(before)  # every tensor took the steps
    # the tie survived sharding and gathering: one weight, two names
    torch.testing.assert_close(state["lm_head.weight"], state["model.embed_tokens.weight"])
    # the optimizer moments, gathered by parameter name, match the single process's
    optim, single_optim = dist_result["optimizer"]["state"], single["optimizer"]["state"]
    assert set(optim) == set(single_optim) and len(optim) > 0
    for name, moments in single_optim.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(optim[name][key], moments[key], atol=1e-6, rtol=1e-4, msg=f"{name} {key}")
    # a checkpoint round trip (load_full_* into a fresh sharded model) gives back the same states
    for name, value in state.items():
        assert torch.equal(dist_result["reloaded_state"][name], value), name
    for name, moments in optim.items():
        for key, value in moments.items():
            assert torch.equal(dist_result["reloaded_optimizer"]["state"][name][key], value), (name, key)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_fsdp2_micro_batches_accumulate_the_whole_minibatch_gradient(tiny_path, dist_result, aggregation):
    """2 ranks x token-budget micro-batches (uneven counts, weightless fill-ins) step exactly like one
    process taking each mini-batch in one forward/backward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).train()
    single = train_steps(model, aggregation=aggregation)
    split = dist_result["accumulation"][aggregation]
    torch.testing.assert_close(split["loss"], single["loss"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(split["grad_norm"], single["grad_norm"], atol=1e-6, rtol=1e-5)
    # the weights after AdamW: an element whose gradient is rounding noise (~1e-9) moves by a noise-driven
    # fraction of lr (Adam divides by the gradient's own scale), so allow 5% of one step (lr 1e-3)
    for name, value in single["state"].items():
        torch.testing.assert_close(split["state"][name], value, atol=5e-5, rtol=0, msg=name)


def test_fsdp2_bf16_mixed_precision_keeps_fp32_master_weights(tiny_path, dist_result):
    from transformers import AutoModelForCausalLM

    bf16 = dist_result["bf16"]
    assert bf16["param_dtypes"] == {torch.float32}  # the sharded master weights
    assert all(v.dtype == torch.float32 for v in bf16["state"].values())  # what checkpoints hold
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).train()
    fp32 = train_steps(model)
    torch.testing.assert_close(bf16["loss"], fp32["loss"], atol=2e-2, rtol=5e-2)  # within bf16 precision
    assert bf16["loss"] != fp32["loss"]  # and really computed in bf16


def test_fsdp2_with_gradient_checkpointing_matches_one_process_without_it(tiny_path, dist_result):
    """2 ranks, FSDP2-sharded, activation checkpointing on (``model.gradient_checkpointing``): the
    clipped-loss steps give the losses, gradient norms and weights of one process without it."""
    from transformers import AutoModelForCausalLM

    assert dist_result["checkpointing_on"]
    single = train_steps(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).train())
    checkpointed = dist_result["checkpointing"]
    torch.testing.assert_close(checkpointed["loss"], single["loss"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(checkpointed["grad_norm"], single["grad_norm"], atol=1e-6, rtol=1e-5)
    assert checkpointed["state"].keys() == single["state"].keys()
    for name, value in single["state"].items():
        torch.testing.assert_close(checkpointed["state"][name], value, atol=1e-5, rtol=0, msg=name)


def _trainer_worker(run_dir: str) -> dict:
    """The Trainer itself under torchrun: bf16 compute, a KL reference (in the loss and in the reward),
    micro-batches, ReMax's greedy baseline episodes, one iteration (its checkpoint written asynchronously,
    finished before ``last.pt``); what it holds (its history on rank 0)."""
    from torch.distributed.tensor import DTensor

    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.cli import compose_config

    torch.set_num_threads(1)
    cfg = compose_config(["experiment=smoke", "env.num_groups=2", "env.group_size=2", "env.eval_episodes=2", "env.max_steps=2",
                          "rollout.max_new_tokens=6", "progress=false", "eval_every=0", "iterations=1", "warm_start.steps=0",
                          "model.dtype=bfloat16", "algorithm.kl_coef=0.05", "algorithm.micro_batch_tokens=64",
                          "algorithm.minibatch_size=4", "algorithm.name=remax", "algorithm.kl_in_reward=true",
                          "checkpoint_every=1", "checkpoint_async=true", "device=cpu", f"run_dir={run_dir}"])
    trainer = Trainer(cfg)
    baseline = trainer.hooks.baseline.collector
    reference = list(trainer.reference.parameters())
    result = {
        "reference_sharded": all(isinstance(p, DTensor) for p in reference),
        "reference_local": sum(p.to_local().numel() for p in reference),
        "reference_full": sum(p.numel() for p in reference),
        "reference_dtypes": {p.dtype for p in reference},
        "master_dtypes": {p.dtype for p in trainer.model.parameters()},
        "rollout_dtypes": ({p.dtype for p in trainer.rollout_model.parameters()}
                           if trainer.rollout_model is not None else None),
        "baseline": (type(baseline).__name__, getattr(baseline.env, "base_env", baseline.env).num_groups,
                     baseline.num_groups),
    }
    trainer.train()
    result.update(history=trainer.history, run_dir=run_dir, baseline_batches=baseline.batches)
    return result


def test_trainer_under_torchrun_shards_the_reference_and_keeps_fp32_master_weights(dist_result):
    result = dist_result["trainer"]
    assert result["reference_sharded"] and result["reference_local"] < 0.6 * result["reference_full"]
    assert result["reference_dtypes"] == {torch.bfloat16}  # frozen: held in the compute dtype
    assert result["master_dtypes"] == {torch.float32} and result["rollout_dtypes"] == {torch.bfloat16}
    record = [h for h in result["history"] if "loss" in h][0]
    assert record["skipped_steps"] == 0 and torch.isfinite(torch.tensor(record["loss"]))
    assert "loss_kl" in record and record["reward_kl_coef"] > 0  # the KL in the loss and in the reward
    # ReMax's greedy baseline: each rank's engine played its own group of the 2, gathered once
    assert result["baseline"] == ("DistributedStepCollector", 1, 2) and result["baseline_batches"] == 1
    from torchrl_agent.trainers.checkpointing import read_checkpoint, read_weights

    path = os.path.join(result["run_dir"], "checkpoints", "last.pt")
    state = read_checkpoint(path)  # each rank wrote its shards (torch.distributed.checkpoint): no "model" entry
    assert "model" not in state and {"__0_0.distcp", "__1_0.distcp"} <= set(state["shards"]["files"])
    weights = read_weights(path, state)
    assert weights and all(v.dtype == torch.float32 for v in weights.values())
    # checkpoint_async=true: iteration 0's shards written in the background, finished (NAME.pt) before last.pt
    periodic = os.path.join(result["run_dir"], "checkpoints", "iteration_00000.pt")
    early = read_checkpoint(periodic)
    assert early["iteration"] == 0 and {"__0_0.distcp", "__1_0.distcp"} <= set(early["shards"]["files"])
    assert not os.path.exists(periodic.replace(".pt", ".shards.tmp"))
    for name, value in read_weights(periodic, early).items():  # nothing trained after iteration 0: the same weights
        torch.testing.assert_close(value, weights[name])

"""A training step at scale: chunked response log-probs, token-budget gradient accumulation, fp32
master weights with bf16 compute, and skipping non-finite steps."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict, lazy_stack
from torch.utils._python_dispatch import TorchDispatchMode

from torchrl_agent.modules import ResponseLogProbs, pad_rows
from torchrl_agent.trainers.cli import compose_config

SMALL = ["experiment=smoke", "env.num_groups=2", "env.group_size=2", "env.eval_episodes=2", "env.max_steps=3", "rollout.max_new_tokens=8",
         "progress=false", "eval_every=0", "warm_start.steps=0"]


def _rows(vocab_size: int, lengths=((5, 3), (2, 7), (9, 0), (4, 4), (3, 1))) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    return lazy_stack([TensorDict({"tokens": {"prompt": torch.randint(3, vocab_size, (p,), generator=g),
                                              "response": torch.randint(3, vocab_size, (r,), generator=g)}})
                       for p, r in lengths])


def full_vocabulary_log_probs(model, rows, temperature):
    """The former formula: the logits of every position, [N, L, V] in float32, gathered at the responses."""
    b = pad_rows(rows, 0)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float() / temperature
    n, t = b["response_mask"].shape
    pos = (b["response_start"][:, None] - 1 + torch.arange(t)[None]).clamp(max=logits.shape[1] - 1)
    picked = logits.gather(1, pos[..., None].expand(n, t, logits.shape[-1]))
    targets = b["input_ids"].gather(1, (pos + 1).clamp(max=b["input_ids"].shape[1] - 1))
    logp = F.log_softmax(picked, -1)
    mask = b["response_mask"]
    return logp.gather(-1, targets[..., None]).squeeze(-1) * mask, -(logp.exp() * logp).sum(-1) * mask, mask


class LargestLogits(TorchDispatchMode):
    """Records the largest floating-point ``[..., V]`` tensor any op produces (forward and backward)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size, self.numel = vocab_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # e.g. the head weight's transpose: no new memory
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.ndim and t.shape[-1] == self.vocab_size:
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("temperature, chunk", [(1.0, 1), (0.7, 3), (1.3, 1000)])
def test_chunked_log_probs_equal_the_full_vocabulary_ones_values_and_gradients(tiny_path, temperature, chunk):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).train()
    rows = _rows(model.config.vocab_size)
    logp, entropy, mask = full_vocabulary_log_probs(model, rows, temperature)
    (logp.sum() + 0.5 * entropy.sum()).backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()

    out = ResponseLogProbs(model, 0, temperature=temperature, chunk_tokens=chunk)(rows.copy())
    assert torch.equal(out["mask"], mask) and out["log_prob"].dtype == torch.float32
    torch.testing.assert_close(out["log_prob"], logp, atol=2e-6, rtol=0)
    # entropies are ~7 nats (a near-uniform 2048-token vocabulary): float32 sums differ by a few ulp
    torch.testing.assert_close(out["entropy"], entropy, atol=2e-6, rtol=1e-6)
    assert (out["log_prob"][~mask] == 0).all() and (out["log_prob"][mask] < 0).all()
    (out["log_prob"].sum() + 0.5 * out["entropy"].sum()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], atol=1e-5, rtol=1e-4, msg=name)
    # the model's own head is back in place
    assert model.get_output_embeddings() is model.lm_head and isinstance(model.lm_head, torch.nn.Linear)


def test_no_rows_by_sequence_by_vocabulary_tensor_exists_forward_or_backward(tiny_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).train()
    vocab = model.config.vocab_size
    rows = _rows(vocab, lengths=((6, 9), (4, 8), (7, 9), (5, 9)))  # 35 response tokens, sequences of 15
    n, seq = 4, 15
    with LargestLogits(vocab) as former:
        logp, entropy, _ = full_vocabulary_log_probs(model, rows, 1.0)
        (logp.sum() + entropy.sum()).backward()
    assert former.numel >= n * seq * vocab  # the check sees the full tensor where it exists
    model.zero_grad()
    with LargestLogits(vocab) as chunked:
        out = ResponseLogProbs(model, 0, chunk_tokens=8)(rows.copy())
        (out["log_prob"].sum() + out["entropy"].sum()).backward()
    assert chunked.numel <= 8 * vocab  # one chunk's logits at a time


def test_trainer_log_probs_go_through_the_chunked_head(tmp_path, monkeypatch):
    """Old, reference and current log-probs: every LM-head call of an update is chunked."""
    from torchrl_agent.modules.logprobs import ChunkedResponseHead
    from torchrl_agent.trainers import Trainer

    trainer = Trainer(compose_config([*SMALL, f"run_dir={tmp_path}", "algorithm.kl_coef=0.05",
                                      "algorithm.logprob_chunk_tokens=5"]))
    rows = trainer.advantage(trainer.collector.collect())
    calls = []
    original = ChunkedResponseHead.forward

    def spy(self, hidden):
        calls.append((self.chunk_tokens, torch.is_grad_enabled()))
        return original(self, hidden)

    head = trainer.model.lm_head
    head_calls = []
    handle = head.register_forward_hook(lambda m, i, o: head_calls.append(i[0].shape[0]))
    monkeypatch.setattr(ChunkedResponseHead, "forward", spy)
    trainer.update(rows)
    handle.remove()
    assert {c for c, _ in calls} == {5}
    assert any(g for _, g in calls) and any(not g for _, g in calls)  # current (grad), old and reference (no grad)
    assert head_calls and max(head_calls) <= 5  # the LM head itself only ever sees a chunk of tokens
    assert trainer.model.get_output_embeddings() is head


# ---------------------------------------------------------------------- gradient accumulation
@pytest.fixture(scope="module")
def trainer_and_rows(tmp_path_factory):
    """A float32 trainer with KL and entropy terms, no gradient clip, and one collected batch."""
    from torchrl_agent.trainers import Trainer

    cfg = compose_config([*SMALL, f"run_dir={tmp_path_factory.mktemp('run')}", "algorithm.kl_coef=0.05",
                          "algorithm.entropy_coef=0.01", "algorithm.grad_clip=1e9", "algorithm.minibatch_size=1000"])
    trainer = Trainer(cfg)
    return trainer, trainer.advantage(trainer.collector.collect())


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_accumulated_gradient_equals_the_whole_minibatch_gradient(trainer_and_rows, aggregation):
    trainer, rows = trainer_and_rows
    trainer.cfg.algorithm.aggregation = trainer.loss.aggregation = aggregation
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    def one_step(budget):
        trainer.model.load_state_dict(initial)
        trainer.updater.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-3)
        trainer.cfg.algorithm.micro_batch_tokens = budget
        metrics = trainer.update(rows)  # one mini-batch: the gradients stay in .grad (no clip)
        return metrics, {k: p.grad.clone() for k, p in trainer.model.named_parameters()}

    whole, whole_grad = one_step(10**9)
    split, split_grad = one_step(1)  # every row alone
    lengths = [len(p) + len(r) for p, r in zip(rows.get(("tokens", "prompt"), as_list=True),
                                               rows.get(("tokens", "response"), as_list=True))]
    assert len(trainer.updater.micro_batches(rows, list(range(len(lengths))), True)) == len(lengths)
    for name, g in whole_grad.items():
        torch.testing.assert_close(split_grad[name], g, atol=1e-6, rtol=1e-4, msg=name)
    for key in ("loss", "loss_objective", "loss_kl", "loss_entropy", "grad_norm"):
        assert split[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-7), key


def test_token_budget_batches_respect_the_budget():
    from torchrl_agent.trainers.batching import token_budget_batches

    lengths = [5, 40, 7, 12, 3, 40, 9]
    batches = token_budget_batches(list(range(7)), lengths, 30)
    assert sorted(i for b in batches for i in b) == list(range(7))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 30
    assert [1] in batches and [5] in batches  # longer than the budget: alone
    assert token_budget_batches([0, 1, 2], [4, 4, 4], 100) == [[0, 1, 2]]


# ---------------------------------------------------------------------- mixed precision
def test_bf16_compute_at_lr_1e6_moves_the_fp32_master_weights(tmp_path):
    from torchrl_agent.trainers import Trainer

    trainer = Trainer(compose_config([*SMALL, f"run_dir={tmp_path}", "model.dtype=bfloat16", "algorithm.lr=1e-6",
                                      "algorithm.epochs=10", "algorithm.minibatch_size=1000",
                                      "algorithm.kl_coef=0"]))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # master weights
    assert all(p.dtype == torch.bfloat16 for p in trainer.rollout_model.parameters())  # the engine's copy
    assert trainer.policy.model is trainer.rollout_model and trainer.rollout_model is not trainer.model
    rows = trainer.advantage(trainer.collector.collect())
    before = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    metrics = trainer.update(rows)  # 10 optimizer steps on the same rows
    assert metrics["skipped_steps"] == 0
    trained = changed = 0
    bf16_changed = 0
    for name, p in trainer.model.named_parameters():
        touched = p.grad != 0  # elements this data trains (unused embedding rows have no gradient)
        trained += int(touched.sum())
        changed += int((p.detach() != before[name])[touched].sum())
        # the former recipe: AdamW stepping bf16 weights with the same gradient, 10 times
        w = torch.nn.Parameter(before[name].to(torch.bfloat16))
        opt = torch.optim.AdamW([w], lr=1e-6, weight_decay=0.01)
        for _ in range(10):
            w.grad = p.grad.to(torch.bfloat16)
            opt.step()
        bf16_changed += int((w.detach() != before[name].to(torch.bfloat16))[touched].sum())
    assert trained > 10_000
    assert changed / trained > 0.99, changed / trained
    assert bf16_changed / trained < 0.5, bf16_changed / trained  # what the test guards against
    # the engine got the updated weights, in bf16
    for (name, p), q in zip(trainer.model.named_parameters(), trainer.rollout_model.parameters()):
        assert torch.equal(q, p.detach().to(torch.bfloat16)), name


def test_bf16_loss_equals_the_fp32_loss_within_bf16_tolerance(tmp_path):
    from torchrl_agent.trainers import Trainer

    trainer = Trainer(compose_config([*SMALL, f"run_dir={tmp_path}", "model.dtype=bfloat16",
                                      "algorithm.kl_coef=0.05", "algorithm.entropy_coef=0.01"]))
    rows = trainer.advantage(trainer.collector.collect())
    rows["advantage"] = torch.linspace(-1.5, 2.0, rows.batch_size[0]).reshape(rows["advantage"].shape)
    idx = list(range(rows.batch_size[0]))
    trainer.scorer.autocast_enabled = False
    trainer.scorer.score(rows)
    fp32 = trainer.scorer.loss_inputs(rows, idx)
    fp32_loss = trainer.loss(fp32)
    trainer.scorer.autocast_enabled = True
    bf16 = trainer.scorer.loss_inputs(rows, idx)
    bf16_loss = trainer.loss(bf16)
    mask = fp32["mask"]
    diff = (bf16["log_prob"] - fp32["log_prob"])[mask].abs()
    assert 0 < diff.max() < 0.1  # bf16 really computed, within its precision
    for key in ("loss_objective", "loss_kl", "loss_entropy"):
        torch.testing.assert_close(bf16_loss[key], fp32_loss[key], atol=2e-3, rtol=2e-2, msg=key)
    assert float(fp32_loss["loss_objective"].detach().abs()) > 0.05  # not a comparison of zeros


def test_bf16_checkpoint_holds_fp32_master_weights_and_resumes_exactly(tmp_path):
    from torchrl_agent.trainers import Trainer

    base = [*SMALL, "model.dtype=bfloat16", "algorithm.lr=1e-3", "algorithm.kl_coef=0.01", "env.max_steps=2",
            "algorithm.micro_batch_tokens=128"]
    straight = Trainer(compose_config([*base, "iterations=2", f"run_dir={tmp_path / 'a'}"]))
    straight.train()
    first = Trainer(compose_config([*base, "iterations=1", f"run_dir={tmp_path / 'b'}"]))
    first.train()
    checkpoint = tmp_path / "b" / "checkpoints" / "last.pt"
    state = torch.load(checkpoint, weights_only=False)
    assert all(v.dtype == torch.float32 for v in state["model"].values())
    moments = [m for s in state["optimizer"]["state"].values() for k, m in s.items() if k != "step"]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    resumed = Trainer(compose_config([*base, "iterations=2", f"run_dir={tmp_path / 'c'}", f"resume={checkpoint}"]))
    resumed.train()
    a = [h for h in straight.history if h["iteration"] == 1 and "loss" in h][0]
    c = [h for h in resumed.history if h["iteration"] == 1 and "loss" in h][0]
    assert a["episode_reward"] == c["episode_reward"] and a["loss"] == c["loss"]
    for (name, x), y in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(x, y), name
    for x, y in zip(straight.rollout_model.parameters(), resumed.rollout_model.parameters()):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------- non-finite steps
def test_non_finite_gradient_skips_the_step_and_repeated_skips_stop_the_run(tmp_path, caplog):
    from torchrl_agent.trainers import Trainer, TrainingDivergedError

    trainer = Trainer(compose_config([*SMALL, f"run_dir={tmp_path}", "algorithm.lr=1e-2", "algorithm.kl_coef=0",
                                      "algorithm.minibatch_size=1000", "algorithm.max_skipped_steps=3"]))
    rows = trainer.advantage(trainer.collector.collect())
    poisoned = rows.clone()
    advantage = rows["advantage"].clone()
    advantage[0] = float("nan")  # one bad row makes the whole mini-batch's gradient NaN
    poisoned["advantage"] = advantage
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    with caplog.at_level(logging.WARNING, logger="torchrl_agent"):
        metrics = trainer.update(poisoned)
    assert metrics["skipped_steps"] == 1 and "optimizer step skipped" in caplog.text
    assert all(p.grad is None for p in trainer.model.parameters())  # zeroed
    assert not trainer.updater.optimizer.state  # AdamW never stepped
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    saved = torch.load(trainer.save_checkpoint(), weights_only=False)
    assert all(torch.isfinite(v).all() for v in saved["model"].values())

    trainer.update(poisoned)  # 2 in a row
    metrics = trainer.update(rows)  # a finite step resets the count
    assert metrics["skipped_steps"] == 0 and trainer.updater.consecutive_skips == 0
    assert any(not torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    trained = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.update(poisoned)
    trainer.update(poisoned)
    with pytest.raises(TrainingDivergedError, match=r"3 optimizer steps in a row.*algorithm\.lr.*kl_coef.*entropy_coef"):
        trainer.update(poisoned)
    for k, v in trainer.model.state_dict().items():  # no NaN reached the weights
        assert torch.equal(v, trained[k]), k


def test_target_kl_stops_the_update_once_the_policy_moved_that_far(tmp_path):
    """algorithm.target_kl (PPO's early stop): at a large lr over 10 epochs the policy passes the bound
    within a few steps and the rest of the update is not taken; without it every step is."""
    from torchrl_agent.trainers import Trainer

    base = [*SMALL, "algorithm.lr=1e-2", "algorithm.epochs=10", "algorithm.minibatch_size=1000", "algorithm.kl_coef=0"]
    free = Trainer(compose_config([*base, f"run_dir={tmp_path / 'a'}"]))
    metrics = free.update(free.advantage(free.collector.collect()))
    assert metrics["update_steps"] == 10 and metrics["update_stopped_early"] == 0.0
    assert metrics["approx_kl"] > 0.01  # the same update, unbounded, goes past the bound used below
    bounded = Trainer(compose_config([*base, f"run_dir={tmp_path / 'b'}", "algorithm.target_kl=0.01"]))
    metrics = bounded.update(bounded.advantage(bounded.collector.collect()))
    assert 1 <= metrics["update_steps"] < 10 and metrics["update_stopped_early"] == 1.0
    assert metrics["approx_kl"] <= 0.01  # every step taken started within the bound


def test_max_kl_bounds_every_step_of_the_update_by_halving_or_undoing_it(tmp_path):
    """algorithm.max_kl (a KL budget per update): at a large lr a single step takes the policy past
    the budget; with it every kept step is measured after it was taken and ends within the budget
    (halved or undone), the metrics say so, and approx_kl_max never exceeds it."""
    from torchrl_agent.trainers import Trainer

    base = [*SMALL, "algorithm.lr=5e-2", "algorithm.epochs=4", "algorithm.minibatch_size=1000", "algorithm.kl_coef=0"]
    free = Trainer(compose_config([*base, f"run_dir={tmp_path / 'a'}"]))
    rows = free.advantage(free.collector.collect())
    metrics = free.update(rows.clone())
    assert metrics["update_steps"] == 4 and metrics["kl_step_halvings"] == 0
    assert metrics["approx_kl_max"] > 0.05  # unbounded, the update goes past the budget used below
    bounded = Trainer(compose_config([*base, f"run_dir={tmp_path / 'b'}", "algorithm.max_kl=0.01"]))
    before = {k: v.clone() for k, v in bounded.model.state_dict().items()}
    scored = bounded.scorer.score(rows.clone())  # the sampling policy's log-probs (same weights as `free`'s start)
    metrics = bounded.update(rows.clone())
    assert metrics["kl_step_halvings"] >= 1  # the first step alone was over the budget: halved
    assert metrics["approx_kl_max"] <= 0.01
    assert metrics["update_steps"] + metrics["kl_steps_undone"] >= 1
    moved = any(not torch.equal(v, before[k]) for k, v in bounded.model.state_dict().items())
    assert moved == (metrics["update_steps"] > 0)  # an undone step leaves the weights as they were
    # measured again from outside: the weights kept are within the budget of the sampling policy
    assert bounded.updater.measure_kl(scored, list(range(rows.batch_size[0])), True)[0] <= 0.01 + 1e-6


def test_max_update_kl_pulls_the_whole_update_back_within_its_budget(tmp_path, caplog):
    """algorithm.max_update_kl (TRPO's line search on the whole update): the epochs run as without
    it; then the update's KL over ALL its rows (k1 per response) is measured and its displacement
    halved until it is within the budget: the kept weights lie on the segment from the start to the
    free update's end, and the KL measured from outside matches the metric. An update still over the
    budget at 1/2^max_kl_backtracks of its size is undone, with a warning."""
    from torchrl_agent.trainers import Trainer

    base = [*SMALL, "algorithm.lr=3e-3", "algorithm.epochs=4", "algorithm.minibatch_size=4", "algorithm.kl_coef=0"]
    free = Trainer(compose_config([*base, f"run_dir={tmp_path / 'a'}", "algorithm.max_update_kl=1e6"]))
    rows = free.advantage(free.collector.collect())
    start = {k: v.clone() for k, v in free.model.state_dict().items()}
    scored = free.scorer.score(rows.clone())
    metrics = free.update(rows.clone())
    assert metrics["update_kl_halvings"] == 0 and metrics["update_kl"] > 0.03  # unbounded: past the budget below
    assert free.updater.update_kl(scored) == pytest.approx(metrics["update_kl"], abs=1e-5)
    end = {k: v.clone() for k, v in free.model.state_dict().items()}
    bounded = Trainer(compose_config([*base, f"run_dir={tmp_path / 'b'}", "algorithm.max_update_kl=0.03"]))
    metrics = bounded.update(rows.clone())
    halvings = metrics["update_kl_halvings"]
    assert metrics["update_steps"] > 1 and 1 <= halvings <= 5  # the same epochs, then pulled back
    assert 0 <= metrics["update_kl"] <= 0.03
    assert metrics["update_kl"] == pytest.approx(bounded.updater.update_kl(scored), abs=1e-5)
    for k, v in bounded.model.state_dict().items():  # theta_start + (theta_end - theta_start) / 2^halvings
        torch.testing.assert_close(v, start[k] + (end[k] - start[k]) / 2 ** halvings, atol=1e-6, rtol=1e-5)
    # far past the budget (lr 5e-2: KL ~3 per response), even 1/32 of the update is over it: undone
    far = Trainer(compose_config([*base, f"run_dir={tmp_path / 'c'}", "algorithm.lr=5e-2", "algorithm.max_update_kl=0.03"]))
    with caplog.at_level(logging.WARNING, logger="torchrl_agent"):
        metrics = far.update(rows.clone())
    assert metrics["update_kl_halvings"] == 6 and metrics["update_kl"] == 0.0
    assert "max_update_kl" in caplog.text and "undone" in caplog.text
    for k, v in far.model.state_dict().items():
        torch.testing.assert_close(v, start[k], atol=0, rtol=0)


def test_loss_inputs_live_on_the_models_device(trainer_and_rows, monkeypatch):
    """The recomputed old and reference log-probs are gathered on the CPU (under torchrun), the
    current ones come from the model's device: the loss's input puts them all on the latter (the
    first H200 run of benchmarks/gpu_smoke.sh failed on ``cuda:0`` against ``cpu``). No GPU here:
    the actor's output moved to the ``meta`` device stands for one."""
    trainer, rows = trainer_and_rows
    idx = list(range(rows.batch_size[0]))
    trainer.scorer.score(rows)
    actor = trainer.scorer.actor
    monkeypatch.setattr(trainer.scorer, "actor", lambda td: actor(td).detach().to("meta"))
    batch = trainer.scorer.loss_inputs(rows, idx)
    assert rows["old_log_prob"].device.type == "cpu" and "ref_log_prob" in rows.keys()
    for key in ("log_prob", "mask", "old_log_prob", "ref_log_prob", "advantage"):
        assert batch[key].device.type == "meta", key


class _Receiver:
    """A collector or an engine that records the weights it is given."""

    def __init__(self):
        self.got = []

    def update_policy_weights_(self, state):
        self.got.append(state)

    update_weights = update_policy_weights_


@pytest.mark.parametrize("name, engine_copy, sharded, distributed", [
    ("shared", "model", False, False), ("copy", "bf16", False, False), ("own", None, False, False),
    ("own", None, False, True), ("ranks", "bf16", False, True), ("collector", None, True, False),
])
def test_the_weight_sync_is_chosen_once_for_the_engines_of_the_run(name, engine_copy, sharded, distributed):
    from torchrl_agent.trainers.weight_sync import choose_weight_sync

    model = torch.nn.Linear(3, 2)
    copy = {"model": model, "bf16": torch.nn.Linear(3, 2).to(torch.bfloat16), None: None}[engine_copy]
    collector, policy = _Receiver(), _Receiver()
    chosen, sync = choose_weight_sync(model, copy, policy, collector, compute_dtype=torch.bfloat16,
                                      sharded_collector=sharded, distributed=distributed)
    assert chosen == name
    with torch.no_grad():
        model.weight.add_(1.0)  # an update
    sync()
    if engine_copy == "bf16":  # the engine's own copy holds the trained weights, cast
        assert torch.equal(copy.weight, model.weight.detach().to(torch.bfloat16))
    sent = {"shared": 0, "copy": 1, "own": 1, "ranks": 0, "collector": 1}[name]
    assert len(collector.got) == sent and len(policy.got) == (name == "collector")
    if name in ("own", "collector"):  # the full weights in the compute dtype
        assert collector.got[0]["weight"].dtype == torch.bfloat16
        assert torch.equal(collector.got[0]["weight"], model.weight.detach().to(torch.bfloat16))

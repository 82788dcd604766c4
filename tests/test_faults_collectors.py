"""Dead and stopped collector processes: the multi-process collector's engine server and
collector processes, and the Ray collector's actors, killed (SIGKILL) or stopped (SIGSTOP) for
real. Each is noticed within seconds, named (with its exit code where it exited), the collector
stops with ``RuntimeError`` (a training run then stops with a message; ``resume=auto`` continues
it) and its processes are gone: nothing hangs."""

from __future__ import annotations

import functools
import os
import signal
import time

import llvmlite.binding  # noqa: F401 - numba's llvmlite in sys.modules used to crash the in-process engine start
import pytest

from torchrl_agent.collectors.multiprocess import MultiProcessStepCollector

HEARTBEAT_S = 20.0  # a loaded shared machine starves a busy engine's heartbeat thread for seconds
RAY_HEARTBEAT_S = 8.0  # an actor answers its heartbeat from a thread of its own (no engine in the way)


def numberline_env(model_path: str, num_groups: int):
    from torchrl.envs import Compose, TransformedEnv
    from transformers import AutoTokenizer

    from torchrl_agent.envs import make_env
    from torchrl_agent.envs.transforms import ActionProjection, PromptTransform, WindowMemory

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return TransformedEnv(make_env("numberline", num_groups=num_groups, group_size=2, max_steps=2),
                          Compose(WindowMemory(2), PromptTransform(tokenizer, "numberline"), ActionProjection()))


@pytest.mark.parametrize("target, signum, expected", [
    ("engine", signal.SIGKILL, r"torchrl_agent-engine \(pid \d+, exit code -9\) exited"),
    ("collector", signal.SIGKILL, r"torchrl_agent-collector-1 \(pid \d+, exit code -9\) exited"),
    ("engine", signal.SIGSTOP, r"no heartbeat from torchrl_agent-engine \(pid \d+ \(stopped: SIGSTOP\?\)"),
])
def test_a_dead_or_stopped_process_of_the_multiprocess_collector_stops_it_within_seconds(tiny_path, target, signum,
                                                                                        expected):
    engine = {"model_path": str(tiny_path), "max_new_tokens": 6, "max_model_len": 512, "max_num_seqs": 8, "seed": 0}
    collector = MultiProcessStepCollector(functools.partial(numberline_env, str(tiny_path)), engine, num_groups=2,
                                          num_collectors=2, seed=0, heartbeat_timeout=HEARTBEAT_S)
    processes = [collector._engine, *collector._workers]
    try:
        assert collector.collect().batch_size[0] > 0
        victim = collector._engine if target == "engine" else collector._workers[1]
        os.kill(victim.pid, signum)
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


@pytest.mark.parametrize("signum, expected", [
    (signal.SIGKILL, r"collector actor 1 \(pid {pid}\) failed"),
    (signal.SIGSTOP, r"no heartbeat from collector actor 1 \(pid {pid}\), silent for \d+ s"),
])
def test_a_killed_or_stopped_ray_actor_is_named_within_seconds(tiny_path, signum, expected):
    ray = pytest.importorskip("ray")
    from torchrl_agent.collectors import PolicyFactory, RayStepCollector, TextEnvFactory

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        policy = PolicyFactory("transformers", str(tiny_path), kwargs={"max_new_tokens": 6})
        collector = RayStepCollector(TextEnvFactory("numberline", str(tiny_path), group_size=2,
                                                    env_kwargs={"max_steps": 2}), policy, num_groups=2,
                                     num_collectors=2, seed=0, heartbeat_timeout=RAY_HEARTBEAT_S)
        try:
            collector.collect()
            pid = ray.get(collector._actors[1].pid.remote())
            os.kill(pid, signum)
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=expected.format(pid=pid)):
                collector.collect()
            noticed = time.monotonic() - t0
        finally:
            collector.shutdown()
        stopped = time.monotonic() - t0
        # generous bounds, far from "forever" (a stopped actor used to be waited for without end)
        assert noticed < (RAY_HEARTBEAT_S + 15 if signum == signal.SIGSTOP else 30), noticed
        assert stopped - noticed < 40, stopped
    finally:
        ray.shutdown()

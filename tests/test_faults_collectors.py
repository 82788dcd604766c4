"""Dead and stopped collector processes: the multi-process collector's engine server and
collector processes killed (SIGKILL) or stopped (SIGSTOP) for real. Each is noticed within seconds,
named (with its exit code where it exited), the collector stops with ``RuntimeError`` (a training
run then stops with a message; ``resume=auto`` continues it) and its processes are gone: nothing
hangs. The Ray collector's actors get the same treatment in tests/test_collector_ray.py (on its
module's Ray cluster)."""

from __future__ import annotations

import functools
import os
import signal
import time

import llvmlite.binding  # noqa: F401 - numba's llvmlite in sys.modules used to crash the in-process engine start
import pytest

from torchrl_agent.collectors.multiprocess import MultiProcessStepCollector

HEARTBEAT_S = 12.0  # a loaded shared machine can starve a busy engine's heartbeat thread for seconds


def numberline_env(model_path: str, num_groups: int):
    from torchrl.envs import Compose, TransformedEnv
    from transformers import AutoTokenizer

    from torchrl_agent.envs import make_env
    from torchrl_agent.envs.transforms import ActionProjection, PromptTransform, WindowMemory

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return TransformedEnv(make_env("numberline", num_groups=num_groups, group_size=2, max_steps=2),
                          Compose(WindowMemory(2), PromptTransform(tokenizer, "numberline"), ActionProjection()))


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
    collector = MultiProcessStepCollector(functools.partial(numberline_env, str(tiny_path)), engine, num_groups=2,
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

"""The Ray collector on a local two-CPU Ray cluster, one for the module (the smoke experiment:
NumberLine, the tiny model, a transformers engine in each actor, or one shared engine over HTTP):
the same rows as the single-process StepCollector for a seed, before and after a weight update (and
for the tiny VLM on Sokoban frames, images included); the
standard TorchRL loop; shutdown gives the actors' resources back; an actor killed (SIGKILL) or
stopped (SIGSTOP) for real is named within seconds; ``torchrl-agent train collector.kind=ray``
trains on the running cluster; without Ray, a clear ImportError."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ray
import torch
from torchrl.data import LazyStackStorage, ReplayBuffer

from torchrl_agent.collectors import ConfigEnvFactory, PolicyFactory, RayStepCollector, StepCollector
from torchrl_agent.collectors.ray import start_local_ray
from torchrl_agent.models import model_path
from torchrl_agent.trainers.cli import compose_config, main

NUM_GROUPS, SEED = 4, 7
HEARTBEAT_S = 8.0  # an actor answers its heartbeat from a thread of its own (no engine in the way)


@pytest.fixture(scope="module")
def cfg():
    """The smoke experiment, 4 groups of 2 games, episodes of at most 4 steps, short responses."""
    return compose_config(["experiment=smoke", f"env.num_groups={NUM_GROUPS}", "env.group_size=2", "env.max_steps=4",
                           "rollout.max_new_tokens=10"])


@pytest.fixture(scope="module")
def policy_factory(cfg):
    r = cfg.rollout
    return PolicyFactory("transformers", model_path(cfg.model),
                         kwargs={"max_new_tokens": r.max_new_tokens, "temperature": r.temperature})


@pytest.fixture(scope="module")
def cluster():
    start_local_ray(num_cpus=2, log_to_driver=False)  # as RayStepCollector starts one
    yield
    ray.shutdown()


def test_the_cluster_the_project_starts_runs_no_dashboard_and_takes_calls_only_with_its_token(cluster):
    """Ray's gRPC servers listen on every interface (Ray 2.60 has no loopback-only option): the
    cluster a collector starts has no dashboard UI and no Jobs API (Ray 2.60 still runs a minimal
    dashboard head for its usage statistics: on 127.0.0.1, frontend disabled, that module alone) and
    token authentication on."""
    from ray._private import ray_constants
    from ray._raylet import AuthenticationMode, get_authentication_mode

    node = ray._private.worker.global_worker.node
    assert not node.address_info.get("webui_url")
    for info in node.all_processes.get(ray_constants.PROCESS_TYPE_DASHBOARD, []):
        args = info.process.args
        assert "--disable-frontend" in args and "--host=127.0.0.1" in args, args
        assert "--modules-to-load=UsageStatsHead" in args, args  # no JobHead: no Jobs API
    assert get_authentication_mode() == AuthenticationMode.TOKEN


def free_cpus(expected: float = 2, timeout: float = 30.0) -> float:
    """The cluster's free CPUs, once they reach ``expected`` or after ``timeout`` s (Ray frees a
    killed actor's resources asynchronously)."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("CPU", 0)


def perturbed(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # tied with the embeddings: a visibly different policy
    return model.state_dict()


def original(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def content(rows):
    """Everything a row holds, in order, as plain Python values (log-probs compared apart)."""
    return [(int(row["group_id"]), int(row["traj_id"]), int(row["step_count"]), row["text", "prompt"],
             row["text", "response"], row["action"], row["tokens", "response"].tolist(), float(row["reward"]),
             bool(row["done"]), bool(row["action_valid"])) for row in rows.unbind(0)]


def log_probs(rows):
    return torch.cat([row["log_probs", "response"] for row in rows.unbind(0)])


@pytest.fixture(scope="module")
def single_rows(cfg, policy_factory):
    """Three batches of the single-process collector (the same env and policy factories, in this
    process, one thread as in the actors); new weights before the third."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        policy = policy_factory()
        collector = StepCollector(ConfigEnvFactory(cfg)(NUM_GROUPS), policy, seed=SEED)
        batches = [collector.collect(), collector.collect()]
        policy.model.load_state_dict(perturbed(policy_factory.model_path))
        batches.append(collector.collect())
        collector.shutdown()
    finally:
        torch.set_num_threads(threads)
    return batches


def test_ray_rows_with_images_equal_single_process_rows(cluster):
    """A VLM's image rows (the tiny VLM on Sokoban frames, a VisionPolicy in each actor): the
    single-process rows of tests/test_vision_collectors.py, frames and image tokens included."""
    import test_vision_collectors as vision  # tests/test_vision_collectors.py

    from torchrl_agent.models import build_tiny_vl

    path = str(build_tiny_vl(seed=0))
    env_factory = vision.image_env_factory(path)
    with RayStepCollector(env_factory, PolicyFactory("transformers", path, kwargs=vision.ENGINE),
                          num_groups=vision.NUM_GROUPS, num_collectors=2, seed=vision.SEED,
                          total_batches=1) as collector:
        rows = collector.collect()
    assert rows["pixels"].shape[1:] == (96, 96, 3) and set(rows["image_tokens"].reshape(-1).tolist()) == {9}
    vision.assert_same_rows(rows, vision.single_process_rows(path, env_factory))


def test_ray_rows_equal_single_process_rows(cluster, cfg, policy_factory, single_rows):
    path = policy_factory.model_path
    rb = ReplayBuffer(storage=LazyStackStorage(1000))
    with RayStepCollector(ConfigEnvFactory(cfg), policy_factory, num_groups=NUM_GROUPS, num_collectors=2, seed=SEED,
                          total_batches=2) as collector:
        assert collector.shards == [(2, 0), (2, 2)]  # (groups, first group) of each actor
        batches = list(collector)  # the standard TorchRL loop; ends after total_batches
        assert len(batches) == 2
        collector.update_policy_weights_(perturbed(path))  # one ray.put, loaded by both actors
        batches.append(collector.collect())
        assert collector.stats()["batches"] == 3
        assert collector.stats["env_steps"] == batches[-1].batch_size[0]
        # with a replay buffer, after a reseed and the original weights: the first batch again
        collector.replay_buffer, collector.total_batches = rb, 1
        collector.set_seed(SEED)
        collector.update_policy_weights_(original(path))
        assert list(collector) == [None]
        actors = list(collector._actors)
    # shutdown killed the actors and gave their CPUs back to the cluster
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ready.remote(), timeout=30)
    assert free_cpus() == 2
    for ours, theirs in zip(batches, single_rows):
        assert content(ours) == content(theirs)
        torch.testing.assert_close(log_probs(ours), log_probs(theirs), atol=1e-5, rtol=0)
    assert len({int(t) for t in single_rows[0]["traj_id"]}) == NUM_GROUPS * 2  # every game of the batch
    assert content(single_rows[2]) != content(single_rows[1])  # the update changed the policy
    assert content(rb[:]) == content(single_rows[0])


def test_ray_actors_over_one_http_server_rows_equal_single_process_rows(cluster, cfg, tiny_model, tokenizer):
    """The shared-engine route: both actors are HTTPPolicy clients of one OpenAI-compatible server
    (the tiny model; each request sampled from its seed); with request_seeds the rows are the
    single-process ones. The server holds the weights: a weight update is refused, naming why."""
    from openai_server import OpenAIServer

    from torchrl_agent.modules import TransformersPolicy

    server = OpenAIServer(TransformersPolicy(tiny_model, tokenizer, max_new_tokens=10), limit=4096)
    try:
        http = PolicyFactory("http", model_path(cfg.model), base_url=server.url,
                             kwargs={"max_new_tokens": 10, "temperature": 1.0, "max_concurrency": 2})
        single = StepCollector(ConfigEnvFactory(cfg)(NUM_GROUPS), http(), seed=SEED)
        expected = single.collect()
        single.shutdown()
        with RayStepCollector(ConfigEnvFactory(cfg), http, num_groups=NUM_GROUPS, num_collectors=2,
                              seed=SEED) as collector:
            rows = collector.collect()
            with pytest.raises(RuntimeError, match="update the weights where its engine runs"):
                collector.update_policy_weights_(tiny_model.state_dict())
    finally:
        server.close()
    assert content(rows) == content(expected)
    torch.testing.assert_close(log_probs(rows), log_probs(expected), atol=1e-5, rtol=0)
    assert len(server.requests) == 2 * expected.batch_size[0]  # every step went to the server, twice


def test_an_actor_that_fails_to_start_is_named_and_released(cluster, policy_factory):
    """A broken env factory (an unknown environment): the error names the actor and the cause, and
    the actors already started are killed (their CPUs back to the cluster)."""
    from torchrl_agent.collectors import TextEnvFactory

    with pytest.raises(RuntimeError, match=r"(?s)the actors to start: collector actor [01] failed.*no_such_env"):
        RayStepCollector(TextEnvFactory("no_such_env", policy_factory.model_path), policy_factory,
                         num_groups=2, num_collectors=2, start_timeout=300)
    assert free_cpus() == 2


def test_bad_arguments_fail_before_starting_actors(cfg, policy_factory):
    with pytest.raises(ValueError, match="num_collectors"):
        RayStepCollector(ConfigEnvFactory(cfg), policy_factory, num_groups=2, num_collectors=3)
    with pytest.raises(ValueError, match="engine"):
        PolicyFactory("tgi", policy_factory.model_path)
    with pytest.raises(ValueError, match="base_url"):
        PolicyFactory("http", policy_factory.model_path)


def test_without_ray_the_error_names_the_extra(tmp_path):
    """Ray made unimportable in a fresh interpreter: the package imports, the collector says what to install."""
    script = ("import sys; sys.modules['ray'] = None\n"
              "import torchrl_agent.collectors as c\n"
              "try:\n"
              "    c.RayStepCollector(None, None, num_groups=2)\n"
              "except ImportError as err:\n"
              "    print('ImportError:', err)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr
    assert "ImportError: RayStepCollector needs Ray" in out.stdout
    assert "pip install 'torchrl-agent[ray]'" in out.stdout


@pytest.mark.parametrize("signum, expected", [
    (signal.SIGKILL, r"collector actor 1 \(pid {pid}\) failed"),
    (signal.SIGSTOP, r"no heartbeat from collector actor 1 \(pid {pid}\), silent for \d+ s"),
])
def test_a_killed_or_stopped_actor_is_named_within_seconds(cluster, tiny_path, signum, expected):
    """The actor's process killed or stopped for real: the next collect raises ``RuntimeError``
    naming it (a training run then stops with a message; ``resume=auto`` continues it), and shutdown
    kills the actors and gives their CPUs back: nothing hangs."""
    from torchrl_agent.collectors import TextEnvFactory

    policy = PolicyFactory("transformers", str(tiny_path), kwargs={"max_new_tokens": 6})
    collector = RayStepCollector(TextEnvFactory("numberline", str(tiny_path), group_size=2,
                                                env_kwargs={"max_steps": 2}), policy, num_groups=2,
                                 num_collectors=2, seed=0, heartbeat_timeout=HEARTBEAT_S)
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
    assert noticed < (HEARTBEAT_S + 15 if signum == signal.SIGSTOP else 30), noticed
    assert stopped - noticed < 40, stopped
    assert free_cpus() == 2


def test_train_with_the_ray_collector(cluster, tmp_path):
    """``torchrl-agent train collector.kind=ray`` on the running cluster: 2 iterations, both actors'
    groups, the actors' engines load the first update's weights."""
    small = ["experiment=smoke", "iterations=2", "eval_every=0", "env.num_groups=2", "env.group_size=2",
             "env.eval_episodes=2", "env.max_steps=2", "rollout.max_new_tokens=6", "progress=false", "threads=1"]
    assert main(["train", *small, "collector.kind=ray", "collector.num_collectors=2", f"run_dir={tmp_path}"]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "loss" in r]
    assert [r["iteration"] for r in trained] == [0, 1] and all(r["episodes"] == 4 for r in trained)
    assert trained[1]["logprob_diff_max"] < 1e-3  # the actors' engines got the first update's weights
    assert ray.is_initialized()  # the run used the cluster it found and left it running


def test_closing_a_trainer_gives_its_actors_back(cluster, tmp_path):
    """``Trainer.close()`` (which every way out of ``train()`` calls, errors and signals included)
    kills the Ray collector's actors: a job that stopped inside a sweep leaves the cluster free."""
    from torchrl_agent.trainers.trainer import Trainer

    cfg = compose_config(["experiment=smoke", "env.num_groups=2", "env.group_size=2", "progress=false", "threads=1",
                          "collector.kind=ray", "collector.num_collectors=2", f"run_dir={tmp_path}"])
    trainer = Trainer(cfg)
    assert free_cpus(expected=0, timeout=0) < 2  # the actors hold the cluster's CPUs
    trainer.close()
    assert free_cpus() == 2
    trainer.close()  # idempotent

"""Runs safe to leave alone at scale: a resume refuses another experiment, SIGHUP stops like SIGTERM,
checkpoint retention with the metrics history kept once, an endpoint's API key kept out of every
file and output, listeners on loopback, a non-finite reward is an env fault, and one line for every
filesystem setting that cannot be used. Every fault is caused for real."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
from pathlib import Path

import pytest

from torchrl_agent.trainers.cli import compose_config, main

SMALL = ["experiment=smoke", "iterations=2", "eval_every=0", "env.num_groups=2", "env.group_size=2",
         "env.eval_episodes=2", "env.max_steps=3", "rollout.max_new_tokens=6", "progress=false", "warm_start.steps=0"]


def _one_line(err: str) -> str:
    """The program's message: exactly one ``torchrl-agent:`` line and no traceback."""
    lines = [x for x in err.splitlines() if x.startswith("torchrl-agent")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 3-iteration smoke run with a checkpoint after every iteration (read-only: copy it)."""
    from torchrl_agent.trainers import Trainer

    run = tmp_path_factory.mktemp("finished") / "run"
    Trainer(compose_config([*SMALL, "iterations=3", "checkpoint_every=1", f"run_dir={run}"])).train()
    return run


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, copy_function=shutil.copy)
    return to


# ----------------------------------------------------------------------------------- 1. the same experiment
def test_resume_with_another_experiment_is_refused_in_one_line_naming_the_keys(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path / "run")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code = main(["train", *SMALL, "iterations=5", "checkpoint_every=1", "env.group_size=3", "algorithm.name=rloo",
                 "memory.kind=none", f"run_dir={run}", "resume=auto"])
    line = _one_line(capsys.readouterr().err)
    assert code == 2
    for key in ("env.group_size (2 -> 3)", "algorithm.name ('grpo' -> 'rloo')", "memory.kind", "resume_allow_changes="):
        assert key in line, line
    assert "algorithm.lr" not in line and "iterations" not in line  # those may change
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing overwritten


def test_resume_lists_what_may_change_and_experts_may_allow_more(finished_run, tmp_path, caplog):
    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.checkpointing import CheckpointLoadError

    run = _copy(finished_run, tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="torchrl_agent"):
        trainer = Trainer(compose_config([*SMALL, "iterations=6", "checkpoint_every=1", "algorithm.lr=2e-6",
                                          f"run_dir={run}", "resume=auto"]))
    trainer.close()
    changed = [r.getMessage() for r in caplog.records if "changed since checkpoint" in r.getMessage()]
    assert len(changed) == 1 and "iterations 3 -> 6" in changed[0] and "algorithm.lr" in changed[0], changed
    with pytest.raises(CheckpointLoadError, match=r"env\.max_steps \(3 -> 4\)"):
        Trainer(compose_config([*SMALL, "checkpoint_every=1", "env.max_steps=4", f"run_dir={run}", "resume=auto"]))
    for allow in ("[env.max_steps]", "[env]", "[all]"):
        Trainer(compose_config([*SMALL, "checkpoint_every=1", "env.max_steps=4", f"run_dir={run}", "resume=auto",
                                f"resume_allow_changes={allow}"])).close()


# ----------------------------------------------------------------------------------- 2. SIGHUP
def test_sighup_asks_the_run_to_stop_at_the_end_of_the_iteration_like_sigterm(tmp_path):
    """SIGHUP (a closed terminal) is caught like SIGTERM: the run is asked to stop at its next safe
    point, and the stop says which signal and exits 129 (the end-to-end stop with a checkpoint is
    test_run_dir's SIGINT / SIGTERM test: the same code path)."""
    from torchrl_agent.trainers.run_dir import StopSignals

    def before(signum, frame):  # SIGHUP's default action would end the test process
        pass

    previous = signal.signal(signal.SIGHUP, before)
    try:
        with StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGHUP)
            assert signals.requested == signal.SIGHUP
            stop = signals.stop_message(tmp_path, tmp_path / "checkpoints" / "iteration_00003.pt", 3)
        assert signal.getsignal(signal.SIGHUP) is before  # the previous handler is back
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert stop.exit_code == 129 and "stopped by SIGHUP after iteration 3" in str(stop)


# ----------------------------------------------------------------------------------- 3. retention, history once
def test_prune_keeps_the_newest_and_the_best_held_out_checkpoint(tmp_path):
    from torchrl_agent.trainers.checkpointing import prune_checkpoints

    for it in range(6):
        (tmp_path / f"iteration_{it:05d}.pt").write_bytes(b"x")
    (tmp_path / "last.pt").write_bytes(b"x")
    removed = prune_checkpoints(tmp_path, 2, {0: 0.2, 1: 0.9, 2: 0.5, 3: 0.9 - 1e-9})
    assert sorted(p.name for p in removed) == ["iteration_00000.pt", "iteration_00002.pt", "iteration_00003.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iteration_00001.pt", "iteration_00004.pt",
                                                          "iteration_00005.pt", "last.pt"]
    assert prune_checkpoints(tmp_path, 0, {}) == []  # 0: keep all


def test_checkpoint_keep_in_a_run_and_the_history_kept_once_in_metrics_jsonl(tmp_path):
    """checkpoint_keep=1 with an evaluation every iteration: the newest periodic checkpoint, the
    best held-out one (the evaluation at iteration i scores checkpoint i - 1) and last.pt remain;
    no checkpoint holds the metrics history, each holds its count and digest."""
    from torchrl_agent.trainers.checkpointing import read_checkpoint
    from torchrl_agent.trainers.run_dir import records_digest

    run = tmp_path / "run"
    assert main(["train", *SMALL, "iterations=4", "eval_every=1", "checkpoint_every=1", "checkpoint_keep=1",
                 f"run_dir={run}"]) == 0
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    scores = {r["iteration"] - 1: r["eval_success"] for r in records if "eval_success" in r and r["iteration"] < 4}
    best = max((s, it) for it, s in scores.items())[1]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == sorted({f"iteration_{best:05d}.pt", "iteration_00003.pt", "last.pt"}), names
    for name in names:
        state = read_checkpoint(run / "checkpoints" / name)
        assert "history" not in state
        upto = [r for r in records if r["iteration"] <= state["iteration"]]
        assert state["history_records"] == len(upto) and state["history_sha256"] == records_digest(upto)


def test_resume_rebuilds_the_history_from_metrics_jsonl_and_reads_old_checkpoints(finished_run, tmp_path, caplog):
    from torchrl_agent.trainers.checkpointing import read_checkpoint
    from torchrl_agent.trainers.run_dir import checkpoint_history

    run = _copy(finished_run, tmp_path / "run")
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    path = run / "checkpoints" / "iteration_00001.pt"
    state = read_checkpoint(path)
    assert checkpoint_history(path, state) == records[:2]
    assert checkpoint_history(path, {"iteration": 1, "history": [{"iteration": 0}]}) == [{"iteration": 0}]  # older
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records[1:]) + "\n")  # a line lost
    assert checkpoint_history(path, state) == records[1:2]
    assert any("not the 2 checkpoint" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------------- 4. an endpoint's API key
def test_an_endpoint_key_is_sent_as_bearer_and_never_written_or_printed(tiny_model, tokenizer, tmp_path, monkeypatch,
                                                                        capsys, caplog):
    from openai_server import OpenAIServer

    from torchrl_agent.modules import TransformersPolicy

    key = "sk-test-" + secrets.token_hex(12)
    monkeypatch.chdir(tmp_path)
    srv = OpenAIServer(TransformersPolicy(tiny_model, tokenizer, max_new_tokens=4))
    args = ["eval", "experiment=smoke", "env.eval_episodes=2", "env.max_steps=2", "eval.retries=0", "progress=false"]
    try:
        with caplog.at_level(logging.DEBUG):
            monkeypatch.setenv("OPENAI_API_KEY", key)
            assert main([*args, f"eval.endpoint={srv.url}"]) == 0
            assert srv.headers and {h.get("Authorization") for h in srv.headers} == {f"Bearer {key}"}
            monkeypatch.delenv("OPENAI_API_KEY")
            monkeypatch.setenv("MY_ENDPOINT_KEY", key + "-2")
            srv.headers.clear()
            assert main([*args, f"eval.endpoint={srv.url}", "eval.api_key_env=MY_ENDPOINT_KEY"]) == 0
            assert {h.get("Authorization") for h in srv.headers} == {f"Bearer {key}-2"}
            capsys.readouterr()
            for url in (srv.url.replace("http://", f"http://user:{key}@"), f"'{srv.url}/v1?api_key={key}'"):
                assert main([*args, f"eval.endpoint={url}"]) == 2  # refused, the key not repeated
                assert "eval.endpoint carries credentials" in _one_line(capsys.readouterr().err)
            assert main([*args, f"eval.endpoint={srv.url}/v1?api_key={key}"]) == 2  # unquoted: Hydra's parse error
            assert "api_key=***" in _one_line(capsys.readouterr().err)  # quotes the override, its key redacted
    finally:
        srv.close()
    out = capsys.readouterr()
    assert key not in out.out + out.err + caplog.text
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or key.encode() not in path.read_bytes(), path


# ----------------------------------------------------------------------------------- 7. settings that cannot work
def test_every_filesystem_setting_that_cannot_be_used_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("not a folder")
    assert main(["train", *SMALL, f"run_dir={tmp_path / 'file' / 'run'}"]) == 2
    assert "run_dir=" in (line := _one_line(capsys.readouterr().err)) and "a file, not a folder" in line, line
    monkeypatch.setenv("TORCHRL_AGENT_CACHE", str(tmp_path / "file"))
    assert main(["train", *SMALL, f"run_dir={tmp_path / 'run'}"]) == 2
    assert f"TORCHRL_AGENT_CACHE={tmp_path / 'file'}: is a file" in _one_line(capsys.readouterr().err)
    # a cache that cannot be written (here: sysfs, refused even to root), named by the setting that chose it
    monkeypatch.setenv("TORCHRL_AGENT_CACHE", "/sys/kernel/torchrl_agent")
    assert main(["train", *SMALL, "model.seed=987", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "TORCHRL_AGENT_CACHE=/sys/kernel/torchrl_agent: the cache folder" in _one_line(capsys.readouterr().err)
    monkeypatch.delenv("TORCHRL_AGENT_CACHE")
    monkeypatch.setenv("HOME", "/sys/kernel")
    assert main(["train", *SMALL, "model.seed=987", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "HOME=/sys/kernel (the cache /sys/kernel/.cache/torchrl_agent)" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("algorithm, warned", [("grpo", True), ("gigpo", True), ("rloo", True), ("ppo", False),
                                               ("reinforce_pp", False), ("remax", False)])
def test_group_size_1_with_a_group_relative_algorithm_is_warned_at_start(algorithm, warned, caplog):
    from torchrl_agent.trainers.builders import build_advantage

    build_advantage(compose_config(["experiment=smoke", "env.group_size=1", f"algorithm.name={algorithm}"]))
    assert any("env.group_size=1" in r.getMessage() for r in caplog.records) == warned


# ----------------------------------------------------------------------------------- 5. listeners
_GLOO_PROBE = """
import json, tempfile
import psutil, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
group = dist.new_group([0])  # as vLLM's world and CPU groups
print(json.dumps(sorted({c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"})))
"""


def test_a_single_node_engine_listens_on_loopback_whatever_the_host_name_resolves_to():
    """The engine's torch.distributed (gloo) sockets: with the host name set to this machine's
    network address (a UTS namespace), gloo alone listens there; after :func:`bind_loopback` (what
    every single-node vLLM engine runs, the multi-process collector's engine server included) only on
    loopback."""
    import subprocess
    import sys

    psutil = pytest.importorskip("psutil")
    address = next((a.address for name, addrs in psutil.net_if_addrs().items() if name not in ("lo", "lo0")
                    for a in addrs if a.family == 2 and not a.address.startswith("127.")), None)
    if (address is None or shutil.which("unshare") is None
            or subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0):
        pytest.skip("needs a network interface and unshare --uts (root)")
    from torchrl_agent.modules.vllm_policy import bind_loopback

    plain = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "VLLM_HOST_IP", "VLLM_LOOPBACK_IP")}
    bound = dict(plain)
    assert bind_loopback(bound) == {"VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1",
                                    "GLOO_SOCKET_IFNAME": "lo"}
    seen = {}
    for mode, env in (("plain", plain), ("bind", bound)):
        out = subprocess.run(["unshare", "--uts", "sh", "-c", f'hostname {address} && exec "$@"', "sh",
                              sys.executable, "-c", _GLOO_PROBE], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        seen[mode] = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert address in seen["plain"]  # by host-name resolution: the network address
    assert seen["bind"] and seen["bind"] <= {"127.0.0.1", "::1"}, seen


def test_the_chaos_runs_nan_reward_env_faults_one_episode_when_its_flag_appears(tmp_path, monkeypatch):
    """benchmarks/chaos.py's ``nan_reward`` fault: the custom env returns one NaN reward, at the
    first step after the supervisor's flag file appears; that episode is an env fault naming the
    game, the others and the next steps go on."""
    import importlib.util
    import sys

    from tensordict import TensorDict

    from torchrl_agent.envs import make_env

    spec = importlib.util.spec_from_file_location("chaos", Path(__file__).resolve().parents[1] / "benchmarks" / "chaos.py")
    chaos = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "chaos", chaos)
    spec.loader.exec_module(chaos)
    flag = tmp_path / "nan.flag"
    monkeypatch.setenv(chaos.NAN_FLAG, str(flag))
    chaos.register_nan_env()
    env = make_env("chaos_nan_numberline", num_groups=1, group_size=2, max_steps=3)
    env.reset()
    step = TensorDict({"action": ["+", "+"]}, batch_size=[2])
    assert not env.step(step)["next", "env_fault"].any()
    env.reset()
    flag.write_text("")
    out = env.step(step)["next"]
    assert out["env_fault"].tolist() == [[True], [False]] and not flag.exists()
    assert "FlaggedNumberLine.step returned a non-finite reward nan" in env.fault_log[-1]

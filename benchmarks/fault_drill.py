"""Fault drill: the faults of a careful user's bad day, each caused for real, each reported.

Faults (all on this machine, no network beyond 127.0.0.1):

- ``worker_killed``: a training iteration with ``env.num_workers=2`` whose second worker process is
  killed (SIGKILL) at the second step of the collection;
- ``retriever_dead`` / ``retriever_hanging`` / ``retriever_garbage``: the Search panel run by
  ``torchrl-agent eval`` against a local retrieval server that is shut down after the health check,
  that stops answering, or that answers bytes that are not JSON (the policy is a local scripted
  endpoint that searches first, then answers, so that searches really happen);
  ``retriever_dead_in_workers``: the same with ``env.num_workers=1``;
- ``endpoint_garbage``: ``torchrl-agent eval`` on an endpoint whose every 4th reply is garbage
  (not UTF-8, not JSON, ``choices`` a string, a lone surrogate) and one of whose requests hangs;
- ``lr_inf``: ``algorithm.lr=inf`` (refused at start, naming the key);
- ``diverging``: ``algorithm.kl_coef=1e38`` after a short warm start: every gradient norm is
  non-finite, the steps are skipped and the run stops with a message, leaving finite weights;
- ``long_prompts``: ``env=sokoban memory=full env.max_steps=200`` for one iteration (default prompt
  budget and token-budget micro-batches).
- ``sighup``: SIGHUP to ``torchrl-agent train`` (a closed terminal) once its first metrics line is
  written, then ``resume=auto``;
- ``changed_resume``: ``resume=auto`` with a larger ``env.group_size`` than the checkpoint's (refused,
  the run folder untouched), then with the same;
- ``nan_reward``: a custom env (benchmarks/chaos.py's ``chaos_nan_numberline``) one of whose steps
  returns a NaN reward in the training collection.

Crashes, restarts, damaged or hostile checkpoints, shared run directories, full disks, signals at
random moments and dead collector processes are ``benchmarks/chaos.py``'s (a supervised 30-iteration run) and
``tests/test_run_dir.py`` / ``tests/test_collector_multiprocess.py`` / ``tests/test_collector_ray.py``'s.

For each fault: ``completed`` (the program ended as designed: the run finished, or refused or
stopped with a message, with no traceback), ``rows_lost`` (training: the rows left out of the
update because their episode faulted; evaluation: the episodes cut short by the fault, counted as
failures; ``rows_lost_beyond_faulted`` counts any other loss, which should be 0) and ``message``
(what the user was told). Prints one JSON object as its LAST line::

    python benchmarks/fault_drill.py [--only worker_killed,lr_inf]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMALL = ["experiment=smoke", "eval_every=0", "env.num_groups=2", "env.group_size=2", "env.eval_episodes=2", "rollout.max_new_tokens=8",
         "progress=false", "warm_start.steps=0", "iterations=1"]


class _Log(logging.Handler):
    """Keeps the warnings and errors the run printed (what the user was told)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _serve(handler) -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _stop(server) -> None:
    server.shutdown()
    server.server_close()


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------- training faults
def worker_killed(tmp: Path, log: _Log) -> dict:
    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.cli import compose_config

    trainer = Trainer(compose_config([*SMALL, "env.num_workers=2", "env.max_steps=6", f"run_dir={tmp / 'w'}"]))
    base = trainer.env.base_env
    original, calls = base._step, [0]

    def step_then_kill(td):
        calls[0] += 1
        if calls[0] == 2:  # the second step of the training batch's collection
            os.kill(base.worker_pids[1], signal.SIGKILL)
            time.sleep(0.2)
        return original(td)

    base._step = step_then_kill
    trainer.train()
    trainer.env.close()
    record = _records(tmp / "w")[0]
    return {"completed": True, "rows_lost": record["fault_rows_dropped"], "rows_lost_beyond_faulted": 0,
            "episodes_faulted": record["env_faults"], "groups_dropped": record["fault_groups_dropped"],
            "message": next(m for m in log.messages if "worker fault" in m)}


def lr_inf(tmp: Path, log: _Log) -> dict:
    from torchrl_agent.trainers.cli import main

    code, err = _run_cli(main, ["train", *SMALL, "algorithm.lr=inf", f"run_dir={tmp / 'lr'}"])
    return {"completed": code == 2 and "algorithm.lr" in err, "rows_lost": 0, "exit_code": code,
            "message": err.strip()}


def diverging(tmp: Path, log: _Log) -> dict:
    import torch

    from torchrl_agent.trainers.cli import main

    run_dir = tmp / "div"
    code, err = _run_cli(main, ["train", *SMALL, "warm_start.steps=20", "warm_start.episodes=8",
                                "algorithm.kl_coef=1e38", "iterations=3", "checkpoint_every=1", f"run_dir={run_dir}"])
    finite = True
    from torchrl_agent.trainers.checkpointing import read_checkpoint

    for path in (run_dir / "checkpoints").glob("*.pt"):
        state = read_checkpoint(path)["model"]  # verified, no code runs
        finite &= all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    strict = all(json.loads(x, parse_constant=_refuse) is not None for x in lines)
    stop = [m for m in log.messages if "stopped" in m or "skipped" in m]
    return {"completed": code in (0, 1) and finite and strict, "rows_lost": 0, "exit_code": code,
            "checkpoints_finite": finite, "metrics_strict_json": strict,
            "message": (err.strip().splitlines() or [""])[-1] or (stop[-1] if stop else "")}


def long_prompts(tmp: Path, log: _Log) -> dict:
    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.cli import compose_config
    from torchrl_agent.trainers.loggers import peak_rss_gb

    cfg = compose_config(["experiment=smoke", "env=sokoban", "memory=full", "env.max_steps=200", "env.num_groups=1", "env.group_size=2",
                          "env.eval_episodes=1", "rollout.max_new_tokens=8", "progress=false", "warm_start.steps=0",
                          "iterations=1", "eval_every=0", f"run_dir={tmp / 'long'}"])
    trainer = Trainer(cfg)
    collect, seen = trainer.collector.collect, {}

    def collect_and_measure():
        rows = collect()
        seen.update(rows=rows.batch_size[0], prompt_tokens_max=int(rows["prompt_tokens"].max()))
        return rows

    trainer.collector.collect = collect_and_measure
    trainer.train()
    record = _records(tmp / "long")[0]
    return {"completed": True, "rows_lost": record.get("fault_rows_dropped", 0), **seen,
            "prompt_budget": trainer.env.transform[1].max_prompt_tokens,
            "prompt_budget_truncations": record.get("prompt_budget_truncations", 0),
            "peak_rss_gb": peak_rss_gb(),
            "message": f"completed: prompts within the {trainer.env.transform[1].max_prompt_tokens}-token budget"}


def _lost_beyond_faulted(records: list[dict]) -> int:
    """Rows collected but neither trained nor left out as faulted, over the training records."""
    return sum(r["env_steps"] - round(r["episodes"] * r["episode_length"]) - r.get("fault_rows_dropped", 0)
               for r in records if "episodes" in r)


def sighup(tmp: Path, log: _Log) -> dict:
    """A closed terminal: SIGHUP to ``torchrl-agent train`` once its first metrics line is written.
    The iteration running finishes, its checkpoint is written, the run exits (128 + SIGHUP) with one
    line; ``resume=auto`` then finishes the run."""
    import subprocess

    run_dir = tmp / "hup"
    cmd = [sys.executable, "-m", "torchrl_agent.trainers.cli", "train", *SMALL, "iterations=3", f"run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=900)
    stopped = next((line for line in err.splitlines() if "stopped by SIGHUP" in line), "")
    resumed = subprocess.run([*cmd, "resume=auto"], capture_output=True, text=True, timeout=900)
    records = _records(run_dir)
    iterations = [r["iteration"] for r in records]
    return {"completed": (proc.returncode == 128 + signal.SIGHUP and bool(stopped) and resumed.returncode == 0
                          and iterations == [0, 1, 2, 3]),
            "rows_lost": 0, "rows_lost_beyond_faulted": _lost_beyond_faulted(records), "exit_code": proc.returncode,
            "iterations": iterations, "message": stopped.strip()}


def changed_resume(tmp: Path, log: _Log) -> dict:
    """``resume=auto`` with another experiment (a larger group): refused at start in one line naming
    the key, nothing in the run folder changed; the same experiment then resumes."""
    import hashlib

    from torchrl_agent.trainers.cli import main

    run_dir = tmp / "changed"
    first = ["train", *SMALL, "checkpoint_every=1", f"run_dir={run_dir}"]

    def snapshot() -> dict[str, str]:
        return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}

    code0, _ = _run_cli(main, first)
    before = snapshot()
    code, err = _run_cli(main, [*first, "env.group_size=3", "iterations=2", "resume=auto"])
    unchanged = snapshot() == before
    code2, _ = _run_cli(main, [*first, "iterations=2", "resume=auto"])
    records = _records(run_dir)
    return {"completed": (code0 == 0 and code == 2 and "env.group_size (2 -> 3)" in err and unchanged and code2 == 0
                          and [r["iteration"] for r in records] == [0, 1, 2]),
            "rows_lost": 0, "rows_lost_beyond_faulted": _lost_beyond_faulted(records), "exit_code": code,
            "run_dir_unchanged": unchanged, "message": (err.strip().splitlines() or [""])[-1]}


def nan_reward(tmp: Path, log: _Log) -> dict:
    """A custom env with a bug: one step of one game returns a NaN reward (benchmarks/chaos.py's
    ``chaos_nan_numberline``). That game's episode is an env fault (ended truncated, named in the log,
    its rows left out of the update); the batch and the run go on."""
    from chaos import NAN_ENV, NAN_FLAG, register_nan_env

    from torchrl_agent.trainers import Trainer
    from torchrl_agent.trainers.cli import compose_config

    register_nan_env()
    flag = tmp / "nan.flag"
    os.environ[NAN_FLAG] = str(flag)
    try:
        trainer = Trainer(compose_config([*SMALL, *NAN_ENV, "env.max_steps=4", f"run_dir={tmp / 'nan'}"]))
        base = trainer.env.base_env
        original, armed = base._step, []

        def step_after_flag(td):  # the flag at the training collection's first step (not the evaluation's)
            if not armed:
                flag.write_text("")
                armed.append(True)
            return original(td)

        base._step = step_after_flag
        trainer.train()
        trainer.env.close()
    finally:
        os.environ.pop(NAN_FLAG)
    record = _records(tmp / "nan")[0]
    named = next((m for m in log.messages if "non-finite reward nan" in m), "")
    return {"completed": bool(named) and record["env_faults"] == 1 and not flag.exists(),
            "rows_lost": record["fault_rows_dropped"], "rows_lost_beyond_faulted": _lost_beyond_faulted([record]),
            "episodes_faulted": record["env_faults"], "message": named}


# ----------------------------------------------------------------------------------- retrieval faults
class _Retrieval(BaseHTTPRequestHandler):
    """Search-R1 protocol: answers the health check; other queries per the class's ``mode``."""

    mode = "ok"

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        health = request["queries"] == ["health check"]
        if not health and self.mode == "hang":
            time.sleep(30)
            return
        if not health and self.mode == "garbage":
            body = b"\xff<html>502 Bad Gateway</html>"
        else:
            doc = {"document": {"contents": "Paris\nParis is the capital of France."}, "score": 1.0}
            body = json.dumps({"result": [[doc] for _ in request["queries"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _scripted_endpoint(on_first_request=None):
    """An OpenAI-compatible completions endpoint that searches at the first turn, then answers."""
    fired = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if on_first_request is not None and not fired:
                fired.append(True)
                on_first_request()
            first = "taken 0 turns" in body.get("prompt", "")
            text = "<think>look it up</think><search>capital of France</search>" if first else \
                "<think>found</think><answer>Paris</answer>"
            data = json.dumps({"choices": [{"text": text}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return _serve(Handler)


def _retrieval_fault(mode: str, tmp: Path, log: _Log, workers: int = 0) -> dict:
    from torchrl_agent.trainers.cli import compose_config
    from torchrl_agent.trainers.evaluate import evaluate_policy

    retrieval, retrieval_url = _serve(type("R", (_Retrieval,), {"mode": "ok" if mode == "dead" else mode}))
    endpoint, endpoint_url = _scripted_endpoint(
        (lambda: _stop(retrieval)) if mode == "dead" else None)  # the server dies after the health check
    try:
        cfg = compose_config(["experiment=smoke", "env=search", "env.eval_episodes=4", "eval.chunk_episodes=4", "progress=false",
                              f"env.num_workers={workers}", f"eval.endpoint={endpoint_url}"])
        cfg.env.kwargs.update(retriever=retrieval_url + "/retrieve", retriever_timeout=1.0, retriever_retries=1)
        before = len(log.messages)
        result = evaluate_policy(cfg)
    finally:
        _stop(endpoint)
        if mode != "dead":
            _stop(retrieval)
    faults = [m for m in log.messages[before:] if "fault" in m]
    return {"completed": result["episodes"] == 4, "rows_lost": len(faults), "rows_lost_beyond_faulted": 0,
            "episodes_faulted": len(faults), "wall_s": result["wall_s"],
            "message": faults[0] if faults else "no fault reported"}


# ----------------------------------------------------------------------------------- endpoint faults
def endpoint_garbage(tmp: Path, log: _Log) -> dict:
    from torchrl_agent.trainers.cli import compose_config
    from torchrl_agent.trainers.evaluate import evaluate_policy

    bad = [b"\xff\xfe<html>busy</html>", json.dumps({"choices": "none today"}).encode(),
           json.dumps({"choices": [{"text": {"oops": 1}}]}).encode(), b"hang",
           json.dumps({"choices": [{"text": "<action>\ud800</action>"}]}).encode()]
    count = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            count[0] += 1
            n = count[0]
            data = json.dumps({"choices": [{"text": "<think>hm</think><action>+</action>"}]}).encode()
            if n % 4 == 0:
                data = bad[(n // 4 - 1) % len(bad)]
            if data == b"hang":
                time.sleep(5)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server, url = _serve(Handler)
    try:
        cfg = compose_config(["experiment=smoke", "env.eval_episodes=16", "env.max_steps=5", "eval.timeout=1", "eval.retries=0",
                              "progress=false", f"eval.endpoint={url}"])
        result = evaluate_policy(cfg)
    finally:
        _stop(server)
    return {"completed": result["episodes"] == 16, "rows_lost": result["failed_episodes"],
            "rows_lost_beyond_faulted": 0, "episodes_failed": result["failed_episodes"],
            "requests": count[0], "wall_s": result["wall_s"],
            "message": result["endpoint_errors"][0] if result["endpoint_errors"] else ""}


# ----------------------------------------------------------------------------------- driver
def _refuse(constant):
    raise ValueError(f"non-strict JSON constant {constant}")


def _run_cli(main, argv) -> tuple[int, str]:
    """Run the console script in process; its exit code and what it printed to stderr."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except Exception:  # a traceback: the drill fails this fault
            return -1, traceback.format_exc()
    return code, err.getvalue()


FAULTS = {
    "worker_killed": worker_killed,
    "retriever_dead": lambda tmp, log: _retrieval_fault("dead", tmp, log),
    "retriever_hanging": lambda tmp, log: _retrieval_fault("hang", tmp, log),
    "retriever_garbage": lambda tmp, log: _retrieval_fault("garbage", tmp, log),
    "retriever_dead_in_workers": lambda tmp, log: _retrieval_fault("dead", tmp, log, workers=1),
    "endpoint_garbage": endpoint_garbage,
    "lr_inf": lr_inf,
    "diverging": diverging,
    "long_prompts": long_prompts,
    "sighup": sighup,
    "changed_resume": changed_resume,
    "nan_reward": nan_reward,
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated fault names (default: all)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(FAULTS)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log = _Log()
    logging.getLogger().addHandler(log)
    out: dict = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            t = time.perf_counter()
            try:
                out[name] = FAULTS[name](Path(tmp), log)
            except Exception as err:
                out[name] = {"completed": False, "rows_lost": None, "message": f"{type(err).__name__}: {err}",
                             "traceback": traceback.format_exc(limit=-4)}
            out[name]["drill_s"] = round(time.perf_counter() - t, 1)
            print(f"{name}: {json.dumps(out[name])}", file=sys.stderr, flush=True)
    summary = {"faults": out, "all_completed": all(v["completed"] for v in out.values()),
               "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()

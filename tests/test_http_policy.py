"""HTTPPolicy against a local OpenAI-compatible server whose engine is the real tiny model."""

from __future__ import annotations

import json
import logging
import math
import secrets
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from openai_server import SERVER_LIMIT, OpenAIServer  # tests/openai_server.py
from tensordict import NonTensorStack, TensorDict

from torchrl_agent.modules import ResponseLogProbs, TransformersPolicy
from torchrl_agent.modules.http_policy import HTTPPolicy, HTTPPolicyError
from torchrl_agent.trainers.cli import main


@pytest.fixture(scope="module")
def server(tiny_model, tokenizer):
    srv = OpenAIServer(TransformersPolicy(tiny_model, tokenizer, max_new_tokens=8))
    yield srv
    srv.close()


def _prompts(tokenizer, n):
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"Go to {i}."}], tokenize=False,
                                          add_generation_prompt=True) for i in range(n)]


def test_completions_round_trip(server, tokenizer, tiny_model):
    policy = HTTPPolicy(server.url, tokenizer, max_new_tokens=10, temperature=0.8, max_concurrency=1, seed=5)
    prompts = _prompts(tokenizer, 3)
    server.generations.clear()
    gens = policy.generate(prompts)
    assert [r["seed"] for r in server.requests[-3:]] == [5, 6, 7]
    assert server.requests[-1]["max_tokens"] == 10 and server.requests[-1]["temperature"] == 0.8
    for prompt, g, ref in zip(prompts, gens, server.generations):
        assert g.prompt_ids == ref.prompt_ids == policy.encode(prompt)
        assert g.response_ids == ref.response_ids and len(g.response_ids) >= 1
        assert g.log_probs == pytest.approx(ref.log_probs, abs=1e-6)
        assert g.text == ref.text == policy.decode(g.response_ids)
        assert not g.prompt_too_long
    # the log-probs are the sampled tokens' under T, as the trainer recomputes them
    td = policy(TensorDict({"text": TensorDict({"prompt": NonTensorStack(*prompts)}, batch_size=[3])},
                           batch_size=[3]))
    with torch.no_grad():
        rows = ResponseLogProbs(tiny_model, tokenizer.pad_token_id, temperature=0.8)(td.copy())
    for i in range(3):
        lp = td[i]["log_probs", "response"]
        assert (lp - rows["log_prob"][i, : len(lp)]).abs().max() < 1e-4


def test_seeded_requests_are_reproducible(server, tokenizer):
    policy = HTTPPolicy(server.url, tokenizer, max_new_tokens=8, max_concurrency=1, seed=11)
    prompts = _prompts(tokenizer, 2)
    first = policy.generate(prompts)
    policy.set_seed(11)
    again = policy.generate(prompts)
    assert [g.response_ids for g in first] == [g.response_ids for g in again]


@pytest.mark.parametrize("extra_body", [{}, {"return_tokens_as_token_ids": True}])
def test_response_ids_without_return_token_ids(server, tokenizer, extra_body):
    policy = HTTPPolicy(server.url, tokenizer, max_new_tokens=8, extra_body=extra_body)
    server.generations.clear()
    (g,) = policy.generate(_prompts(tokenizer, 1))
    (ref,) = server.generations
    assert "return_token_ids" not in server.requests[-1]
    if extra_body:  # "token_id:N" strings: the exact ids
        assert g.response_ids == ref.response_ids and g.log_probs == pytest.approx(ref.log_probs, abs=1e-6)
    else:  # the text re-tokenised locally (special tokens such as eos are not in the text)
        assert g.response_ids == tokenizer(ref.text, add_special_tokens=False)["input_ids"]
        assert g.text == ref.text
        if len(g.response_ids) == len(ref.response_ids):
            assert g.log_probs == pytest.approx(ref.log_probs, abs=1e-6)
        else:
            assert len(g.log_probs) == len(g.response_ids) and all(math.isnan(x) for x in g.log_probs)


def test_chat_api(server, tokenizer):
    policy = HTTPPolicy(server.url + "/v1", tokenizer, api="chat", max_new_tokens=6)
    server.generations.clear()
    (g,) = policy.generate(["Go to 3."])
    (ref,) = server.generations
    assert server.requests[-1]["messages"] == [{"role": "user", "content": "Go to 3."}]
    assert g.response_ids == ref.response_ids and g.log_probs == pytest.approx(ref.log_probs, abs=1e-6)
    assert g.prompt_ids == policy.encode("Go to 3.")


def test_prompt_too_long(server, tokenizer):
    short = _prompts(tokenizer, 1)[0]
    long = "word " * (SERVER_LIMIT + 10)
    n_requests = len(server.requests)
    local = HTTPPolicy(server.url, tokenizer, max_new_tokens=4, max_prompt_tokens=50)
    gens = local.generate([long, short])
    assert [g.prompt_too_long for g in gens] == [True, False]
    assert len(server.requests) == n_requests + 1  # the long prompt was never sent
    remote = HTTPPolicy(server.url, tokenizer, max_new_tokens=4)  # no local limit: the server's 400 says so
    gens = remote.generate([long, short])
    assert [g.prompt_too_long for g in gens] == [True, False]
    assert gens[0].response_ids == [] and len(gens[1].response_ids) >= 1


def test_retries_then_clear_errors(server, tokenizer):
    policy = HTTPPolicy(server.url, tokenizer, max_new_tokens=4, retries=2, backoff=0.01)
    server.fail_next = 2
    (g,) = policy.generate(_prompts(tokenizer, 1))
    assert len(g.response_ids) >= 1 and server.fail_next == 0
    server.fail_next = 3
    with pytest.raises(HTTPPolicyError, match=r"failed after 3 attempt\(s\): HTTP 503"):
        policy.generate(_prompts(tokenizer, 1))
    server.fail_next = 0
    wrong_route = HTTPPolicy(server.url + "/v2", tokenizer, retries=5, backoff=0.01)
    with pytest.raises(HTTPPolicyError, match="after 1 attempt.*HTTP 404"):  # a client error is not retried
        wrong_route.generate(["x"])
    srv = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = srv.server_address[1]
    srv.server_close()  # nothing listens there now
    down = HTTPPolicy(f"http://127.0.0.1:{port}", tokenizer, retries=1, backoff=0.01, timeout=2)
    with pytest.raises(HTTPPolicyError, match=f"127.0.0.1:{port}/v1/completions failed after 2"):
        down.generate(["x"])


def test_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="base_url"):
        HTTPPolicy("localhost:8000", tokenizer)
    with pytest.raises(ValueError, match="api"):
        HTTPPolicy("http://127.0.0.1:1", tokenizer, api="responses")
    with pytest.raises(ValueError, match="timeout"):
        HTTPPolicy("http://127.0.0.1:1", tokenizer, timeout=0)
    with pytest.raises(TypeError, match="prompts"):
        HTTPPolicy("http://127.0.0.1:1", tokenizer).generate("x")


def _vllm_ready(tiny_path: Path, folder: Path) -> Path:
    """The tiny model, or its recipe with head size 32 while its own head size lacks a vLLM CPU kernel."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from torchrl_agent.modules.vllm_policy import VLLM_CPU_HEAD_SIZES

    config = json.loads((tiny_path / "config.json").read_text())
    if (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]) in VLLM_CPU_HEAD_SIZES:
        return tiny_path
    heads = config["hidden_size"] // 32
    config.update(num_attention_heads=heads, num_key_value_heads=math.gcd(heads, config["num_key_value_heads"]))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**config)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, tiny_path):
    """vLLM's own OpenAI server (CPU build) in a subprocess, on a vLLM-ready copy of the tiny model."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    path = _vllm_ready(tiny_path, tmp_path_factory.mktemp("vllm-server"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    log = open(tmp_path_factory.mktemp("vllm-server-log") / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--served-model-name",
         "tiny", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager",
         "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--host", "127.0.0.1",
         "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    raise RuntimeError(f"vLLM server did not start; log: {log.name}") from None
                time.sleep(1)
        yield url, path
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_vllm_openai_server(vllm_server):
    """The same client against vLLM's real server: its token ids and T-scaled log-probs, its 400 for long prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    url, path = vllm_server
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    policy = HTTPPolicy(url, tokenizer, model="tiny", max_new_tokens=8, temperature=0.7, seed=3, timeout=120)
    prompts = _prompts(tokenizer, 3)
    td = policy(TensorDict({"text": TensorDict({"prompt": NonTensorStack(*prompts)}, batch_size=[3])},
                           batch_size=[3]))
    with torch.no_grad():
        rows = ResponseLogProbs(model, tokenizer.pad_token_id, temperature=0.7)(td.copy())
    for i in range(3):
        lp = td[i]["log_probs", "response"]
        assert len(lp) == len(td[i]["tokens", "response"]) >= 1
        assert (lp - rows["log_prob"][i, : len(lp)]).abs().max() < 1e-3
    policy.set_seed(3)
    again = policy.generate(prompts)
    assert [g.response_ids for g in again] == [td[i]["tokens", "response"].tolist() for i in range(3)]
    gens = policy.generate(["word " * 300, prompts[0]])  # past the server's max_model_len (256)
    assert [g.prompt_too_long for g in gens] == [True, False]


# ----------------------------------------------------------------------------------- bad endpoints
class _Garbage:
    """A local endpoint whose n-th reply follows ``modes[n % len(modes)]`` (or the mode named in the
    prompt): a valid completion, bad bytes, wrong shapes, a lone surrogate, or no answer at all.
    ``interrupt_at``: send this process SIGINT when that request arrives (a real Ctrl-C)."""

    MODES = ("ok", "non_utf8", "text_not_string", "choices_string", "surrogate", "hang")

    def __init__(self, modes=("ok",), interrupt_at=None):
        self.modes, self.count, self.interrupt_at = list(modes), 0, interrupt_at
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    n, outer.count = outer.count, outer.count + 1
                if outer.interrupt_at is not None and n == outer.interrupt_at:
                    import os
                    import signal

                    os.kill(os.getpid(), signal.SIGINT)
                named = [m for m in outer.MODES if f"mode={m}" in body.get("prompt", "")]
                mode = named[0] if named else outer.modes[n % len(outer.modes)]
                if mode == "hang":
                    time.sleep(3)
                    return
                text = "<think>hm</think><action>stay</action>"
                payload = {"ok": {"choices": [{"text": text}]},
                           "text_not_string": {"choices": [{"text": {"oops": 1}}]},
                           "choices_string": {"choices": "none today"},
                           "surrogate": {"choices": [{"text": "ok \ud800 x"}]}}.get(mode)
                data = b"\xff\xfe<html>busy</html>" if mode == "non_utf8" else json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_bad_replies_cost_only_their_prompt_and_name_the_url(tokenizer):
    srv = _Garbage()
    try:
        policy = HTTPPolicy(srv.url, tokenizer, max_new_tokens=4, timeout=0.5, retries=0, on_error="truncate")
        t0 = time.perf_counter()
        out = policy.generate([f"mode={m}" for m in _Garbage.MODES])
        assert time.perf_counter() - t0 < 3  # the hanging request cost its timeout, no more
        by_mode = dict(zip(_Garbage.MODES, out))
        assert by_mode["ok"].text.endswith("<action>stay</action>") and not by_mode["ok"].prompt_too_long
        assert by_mode["surrogate"].text == "ok ? x"  # cleaned to valid UTF-8, then tokenised
        assert tokenizer.decode(by_mode["surrogate"].response_ids) == "ok ? x"
        for mode in ("non_utf8", "text_not_string", "choices_string", "hang"):
            assert by_mode[mode].prompt_too_long and by_mode[mode].response_ids == []
        assert len(policy.errors) == 4 and all(f"{srv.url}/v1/completions" in e for e in policy.errors)
        joined = " | ".join(policy.errors)
        for reason in ("not JSON", "not a string", "no completion", "no answer within 0.5 s"):
            assert reason in joined, (reason, joined)
        strict = HTTPPolicy(srv.url, tokenizer, max_new_tokens=4, retries=0)  # the default raises
        with pytest.raises(HTTPPolicyError, match=f"{srv.url}/v1/completions answered no completion"):
            strict.generate(["mode=choices_string"])
    finally:
        srv.close()


def test_eval_on_a_garbage_endpoint_costs_episodes_not_the_panel(capsys):
    from torchrl_agent.trainers.cli import main

    # every answer is an invalid move (episodes run their 3 steps): 12 requests, the 8th is garbage
    srv = _Garbage(modes=("ok",) * 7 + ("non_utf8",))
    try:
        args = ["eval", "experiment=smoke", f"eval.endpoint={srv.url}", "env.eval_episodes=4", "env.max_steps=3", "eval.timeout=1",
                "eval.retries=0", "eval.chunk_episodes=2", "progress=false"]
        assert main(args) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["episodes"] == 4 and result["failed_episodes"] == 1
        assert srv.url in result["endpoint_errors"][0] and "not JSON" in result["endpoint_errors"][0]
        assert result["episode_length"] < 3  # the failed episode ended early, the others ran their 3 steps
    finally:
        srv.close()


def test_eval_interrupted_prints_the_finished_chunks(capsys):
    from torchrl_agent.trainers.cli import main

    # every answer is an invalid move, so each chunk of 2 episodes x 3 steps takes exactly 6 requests;
    # Ctrl-C arrives with the first request of the second chunk
    srv = _Garbage(interrupt_at=6)
    # the handler a terminal's `torchrl-agent eval` runs with, whatever an earlier test of this process set
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        args = ["eval", "experiment=smoke", f"eval.endpoint={srv.url}", "env.eval_episodes=4", "env.max_steps=3", "eval.retries=0",
                "eval.chunk_episodes=2", "progress=false"]
        assert main(args) == 130
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["interrupted"] is True and result["episodes"] == 2
    finally:
        signal.signal(signal.SIGINT, previous)
        srv.close()


def _one_line(err: str) -> str:
    """The program's message: exactly one ``torchrl-agent:`` line and no traceback."""
    lines = [x for x in err.splitlines() if x.startswith("torchrl-agent")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


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

"""Images through every collector and engine: the tiny VLM on Sokoban frames (``modality="image"``)
gives the same rows (frames, image tokens, responses, log-probs) from the single-process
StepCollector, the multi-process collector (its engine server running the transformers engine of
the VLM, the frames sent beside the token ids) and the Ray collector (a VisionPolicy in each actor:
tests/test_collector_ray.py, on that module's Ray cluster);
the HTTP engine sends each frame to an OpenAI-compatible server as image content (a ``data:`` URL
of its PNG) in the user message, over a real HTTP round trip."""

from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from torchrl_agent.collectors import PolicyFactory, StepCollector, TextEnvFactory
from torchrl_agent.collectors.multiprocess import MultiProcessStepCollector
from torchrl_agent.envs.base import IMAGE_PLACEHOLDER
from torchrl_agent.models import build_tiny_vl
from torchrl_agent.modules import HTTPPolicy
from torchrl_agent.modules.vision import transformers_engine

NUM_GROUPS, SEED = 2, 3
ENGINE = {"max_new_tokens": 8, "temperature": 1.0, "min_pixels": 0}  # 96x96 frames: 9 image tokens each


@pytest.fixture(scope="module")
def vl_path():
    return str(build_tiny_vl(seed=0))


def image_env_factory(vl_path):
    """Sokoban frames, 2 steps, groups of 2, the sokoban template (its image-mode task) under window memory."""
    return TextEnvFactory("sokoban", vl_path, group_size=2, env_kwargs={"modality": "image", "max_steps": 2})


@pytest.fixture(scope="module")
def env_factory(vl_path):
    return image_env_factory(vl_path)


def content(rows):
    """Everything a row holds, in order, as plain Python values (log-probs compared apart)."""
    return [(int(r["group_id"]), int(r["traj_id"]), int(r["step_count"]), r["text", "prompt"], r["text", "response"],
             r["action"], r["tokens", "prompt"].tolist(), r["tokens", "response"].tolist(), int(r["image_tokens"]),
             bytes(r["pixels"].numpy()), float(r["reward"]), bool(r["done"])) for r in rows.unbind(0)]


def log_probs(rows):
    return torch.cat([row["log_probs", "response"] for row in rows.unbind(0)])


def single_process_rows(vl_path, env_factory):
    """The single-process StepCollector's rows (one thread, as the engine server and the actors)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        policy = transformers_engine(vl_path, request_seeds=True, **ENGINE)
        return StepCollector(env_factory(NUM_GROUPS), policy, seed=SEED).collect()
    finally:
        torch.set_num_threads(threads)


def assert_same_rows(rows, single):
    assert content(rows) == content(single)
    torch.testing.assert_close(log_probs(rows), log_probs(single), atol=1e-5, rtol=0)


def test_rows_with_images_are_equal_in_the_single_and_multiprocess_collectors(vl_path, env_factory):
    """The Ray collector's rows are compared with the same single-process rows in
    tests/test_collector_ray.py (on its module's Ray cluster)."""
    single = single_process_rows(vl_path, env_factory)
    assert single["pixels"].shape[1:] == (96, 96, 3) and single["pixels"].dtype == torch.uint8
    assert set(single["image_tokens"].reshape(-1).tolist()) == {9}
    pad = AutoConfig.from_pretrained(vl_path).image_token_id
    assert all(int((p == pad).sum()) == 9 for p in single.get(("tokens", "prompt"), as_list=True))  # in the ids
    assert len({bytes(p.numpy()) for p in single["pixels"]}) > 1  # the frames differ between states

    with MultiProcessStepCollector(env_factory, {"engine": "transformers", "model_path": vl_path, **ENGINE},
                                   num_groups=NUM_GROUPS, num_collectors=1, shards_per_collector=2, seed=SEED,
                                   total_batches=1) as collector:  # one process (an import less), two shards
        assert collector.shards == [(1, 0), (1, 1)]
        assert_same_rows(collector.collect(), single)


def test_a_vlm_is_refused_by_the_vllm_engines_before_anything_starts(vl_path, env_factory):
    with pytest.raises(ValueError, match="vLLM engine takes no images yet"):
        MultiProcessStepCollector(env_factory, {"model_path": vl_path}, num_groups=NUM_GROUPS)
    with pytest.raises(ValueError, match="vLLM engine takes no images yet"):
        PolicyFactory("vllm", vl_path)()


class _RecordingServer:
    """An OpenAI-compatible ``/v1/chat/completions`` that records each request body and answers one move."""

    def __init__(self):
        self.bodies = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                server.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                data = json.dumps({"choices": [{"message": {"content": "<think>push</think><action>up</action>"},
                                                "logprobs": None}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_the_http_engine_sends_each_frame_as_openai_image_content(vl_path, env_factory):
    server = _RecordingServer()
    try:
        policy = PolicyFactory("http", vl_path, base_url=server.url, kwargs={"api": "chat", "max_new_tokens": 8})()
        rows = StepCollector(env_factory(1), policy, seed=SEED).collect()
    finally:
        server.httpd.shutdown()
    assert isinstance(policy, HTTPPolicy) and policy.images
    assert len(server.bodies) == len(rows) == 4  # 2 games x 2 steps
    sent = []
    for body in server.bodies:
        (message,) = body["messages"]
        assert message["role"] == "user"
        head, image, tail = message["content"]  # the text around the image's place, the frame in it
        assert [head["type"], image["type"], tail["type"]] == ["text", "image_url", "text"]
        url = image["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        frame = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
        sent.append((head["text"] + IMAGE_PLACEHOLDER + tail["text"], frame.tobytes()))
    # each row's prompt and frame, losslessly (the requests run in threads: compared as multisets)
    assert sorted(sent) == sorted((r["text", "prompt"], r["pixels"].numpy().tobytes()) for r in rows.unbind(0))
    assert rows["action"][0] == "up" and bool(rows["action_valid"].all())
    with pytest.raises(ValueError, match="api='chat'"):
        HTTPPolicy(server.url, policy.tokenizer, images=True)


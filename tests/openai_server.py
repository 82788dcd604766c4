"""A minimal OpenAI-compatible server over a real engine, for the HTTPPolicy tests (a test helper)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

SERVER_LIMIT = 200  # the server's own prompt limit (tokens)


class OpenAIServer:
    """A minimal ``/v1/completions`` + ``/v1/chat/completions`` server over a TransformersPolicy.

    Each request is generated alone (under a lock), from ``torch.manual_seed(seed)`` when it
    carries a seed. It records every Generation its engine produced; ``fail_next`` makes the next
    requests answer 503; prompts over ``limit`` tokens get vLLM's 400 "maximum context length".
    """

    def __init__(self, engine, limit: int = SERVER_LIMIT):
        self.engine = engine
        self.limit = limit
        self.lock = threading.Lock()
        self.generations = []
        self.requests = []
        self.headers = []  # each request's HTTP headers (the Authorization an API key arrives in)
        self.fail_next = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    server.headers.append(dict(self.headers))
                    if server.fail_next:
                        server.fail_next -= 1
                        return self._send(503, {"error": {"message": "busy"}})
                    if self.path == "/v1/completions":
                        prompt = body["prompt"]
                    elif self.path == "/v1/chat/completions":
                        prompt = server.engine.tokenizer.apply_chat_template(
                            body["messages"], tokenize=False, add_generation_prompt=True)
                    else:
                        return self._send(404, {"error": {"message": f"no route {self.path}"}})
                    if len(server.engine.encode(prompt)) > server.limit:
                        return self._send(400, {"error": {"message": "This model's maximum context length is "
                                                                     f"{server.limit} tokens."}})
                    server.engine.max_new_tokens = body["max_tokens"]
                    server.engine.temperature = body["temperature"]
                    if body.get("seed") is not None:
                        torch.manual_seed(body["seed"])
                    (g,) = server.engine.generate([prompt])
                    server.generations.append(g)
                tok = server.engine.tokenizer
                if body.get("return_tokens_as_token_ids"):
                    tokens = [f"token_id:{t}" for t in g.response_ids]
                else:
                    tokens = [tok.decode([t]) for t in g.response_ids]
                if self.path == "/v1/completions":
                    choice = {"index": 0, "text": g.text, "finish_reason": "stop",
                              "logprobs": {"tokens": tokens, "token_logprobs": g.log_probs}}
                else:
                    choice = {"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": g.text},
                              "logprobs": {"content": [{"token": t, "logprob": lp}
                                                       for t, lp in zip(tokens, g.log_probs)]}}
                if body.get("return_token_ids"):
                    choice["token_ids"] = g.response_ids
                self._send(200, {"id": "cmpl-test", "object": "text_completion", "choices": [choice]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

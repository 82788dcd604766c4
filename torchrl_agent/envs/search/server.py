"""A retrieval server speaking Search-R1's protocol (``POST /retrieve``) over any :class:`Retriever`.

``python -m torchrl_agent.envs.search --port 8000`` serves BM25 over the Wikipedia summaries.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from torchrl_agent.envs.search.corpus import Passage
from torchrl_agent.envs.search.retrievers import BM25Retriever, Retriever

__all__ = ["make_retrieval_server"]


def make_retrieval_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server speaking Search-R1's retrieval protocol (``POST /retrieve``) over ``retriever``.

    Returns the bound, not yet serving, server: call ``serve_forever()`` (in a thread if need be),
    then ``shutdown()`` and ``server_close()``. ``port=0`` picks a free port (``server.server_address``).
    Documents are ``{"id": title, "contents": "Title\\ntext"}``.
    """
    if not isinstance(retriever, Retriever):
        raise TypeError(f"retriever must be a Retriever, got {type(retriever).__name__}")
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") != "/retrieve":
                return self._reply(404, {"error": f"unknown path {self.path!r}; use POST /retrieve"})
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                queries, k = request["queries"], int(request.get("topk", 3))
                with lock:
                    hits = retriever.search(queries, k)
            except (ValueError, TypeError, KeyError, AttributeError) as err:
                return self._reply(400, {"error": f"bad request: {err}"})
            with_scores = bool(request.get("return_scores", False))

            def document(p: Passage) -> dict:
                return {"id": p.title, "contents": p.contents}

            result = [
                [{"document": document(p), "score": p.score} if with_scores else document(p) for p in passages]
                for passages in hits
            ]
            self._reply(200, {"result": result})

        def _reply(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # keep test and training logs quiet
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve BM25 over the Wikipedia summaries with Search-R1's retrieval protocol."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m torchrl_agent.envs.search", description=main.__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    server = make_retrieval_server(BM25Retriever(), args.host, args.port)
    print(f"serving POST http://{args.host}:{server.server_address[1]}/retrieve", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


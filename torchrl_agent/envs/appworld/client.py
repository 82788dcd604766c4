"""The trainer's side of an AppWorld worker: AppWorld's Python, and a worker process spoken to with JSON lines."""

from __future__ import annotations

import json
import os
import select
import subprocess
from pathlib import Path

__all__ = ["DEFAULT_PYTHON", "WORKER_SCRIPT", "AppWorldWorker", "appworld_python"]

#: The worker's entry point, run by AppWorld's Python (:mod:`torchrl_agent.envs.appworld.worker`).
WORKER_SCRIPT = Path(__file__).with_name("worker.py")

#: Where ``make appworld`` puts AppWorld's Python.
DEFAULT_PYTHON = Path(__file__).resolve().parents[3] / ".venv-appworld" / "bin" / "python"


def appworld_python(python: str | os.PathLike | None = None) -> Path:
    """The Python that has ``appworld`` installed: ``python``, ``$TORCHRL_AGENT_APPWORLD_PYTHON``, or ``.venv-appworld``."""
    given = python or os.environ.get("TORCHRL_AGENT_APPWORLD_PYTHON")
    if given:
        if not Path(given).is_file():
            raise FileNotFoundError(f"AppWorld python {given} does not exist")
        return Path(given)
    if DEFAULT_PYTHON.is_file():
        return DEFAULT_PYTHON
    raise FileNotFoundError(
        "AppWorld needs its own Python environment (appworld pins pydantic<2, which vLLM cannot share): "
        "run `make appworld` (creates .venv-appworld and runs `appworld install`), or pass python=/path/to/python "
        "or set TORCHRL_AGENT_APPWORLD_PYTHON"
    )


class AppWorldWorker:
    """One worker process on AppWorld's Python, spoken to with JSON lines (see :mod:`~torchrl_agent.envs.appworld.worker`)."""

    def __init__(self, python: Path, *, timeout: float = 300.0, log_path: Path | None = None):
        self.python, self.timeout, self.log_path = Path(python), float(timeout), log_path
        self.process: subprocess.Popen | None = None

    def _start(self) -> None:
        stderr = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ""}
        self.process = subprocess.Popen([str(self.python), str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=stderr, env=env, text=True, bufsize=1)
        if stderr is not subprocess.DEVNULL:
            stderr.close()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def send(self, request: dict) -> None:
        if not self.alive:
            self._start()
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            self.kill()
            raise RuntimeError(f"AppWorld worker is gone ({err})") from err

    def receive(self, timeout: float | None = None) -> dict:
        timeout = self.timeout if timeout is None else timeout
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            code = self.process.poll()
            self.kill()
            raise RuntimeError("AppWorld worker " + (f"exited with code {code}" if code is not None
                                                     else f"did not answer within {timeout:.0f} s"))
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"AppWorld: {reply.get('error')}")
        return reply

    def request(self, request: dict, timeout: float | None = None) -> dict:
        self.send(request)
        return self.receive(timeout)

    def kill(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        self.process = None

    def close(self) -> None:
        if self.alive:
            try:
                self.request({"op": "close"}, timeout=30)
            except (RuntimeError, ValueError):
                pass
        self.kill()

"""Step the games of a text environment in worker processes, with fault recovery.

:class:`ParallelTextEnv` is a :class:`~torchrl_agent.envs.base.TextEnv` whose games live in
``num_workers`` processes, each holding a contiguous slice of the batch. The main process keeps the
episode bookkeeping (group seeds, the evaluation panel, step counts, done flags), so for the same
arguments and seed it produces exactly what the single-process env produces; the workers only run
``game.reset(seed)`` and ``game.step(action)``, all slices at the same time.

It speaks the same keys as :class:`TextEnv`, plus one:

==================  ========  ===============================================================
``worker_fault``    ``[B,1]``  bool, the game's episode was cut short by a worker fault
==================  ========  ===============================================================

Faults: a worker that dies (killed, crashed) or does not answer within ``timeout`` seconds (a game
that hangs) is killed and restarted with fresh games. Its games that were running end
``truncated`` (``done``) with ``worker_fault`` True, their last observation kept; every other game
of the batch keeps its data. A game whose ``step``/``reset`` raises is handled the same way, alone
(its worker is not restarted). At reset, a failed call is retried once on the restarted worker and
raises ``RuntimeError`` if it fails again. ``num_restarts`` counts restarts and ``fault_log`` keeps
the reasons.

Images (``modality="image"`` or ``"both"``): each worker draws its games' frames
(:meth:`~torchrl_agent.envs.base.TextEnv.play`) and sends them back inside the game states, so the
main process only stacks them into ``pixels``.

Workers start with ``fork`` by default (fast, and any factory works); ``mp_start_method="spawn"``
needs a registered name or a picklable module-level factory. The games are plain Python, so the
workers run no torch code.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any, Literal

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.data import Categorical
from torchrl.envs import EnvBase

from torchrl_agent.envs.base import MODALITIES, GameState, TextEnv, _as_str_list
from torchrl_agent.envs.data_files import DataFileError
from torchrl_agent.envs.registry import ENV_REGISTRY, env_constructor

__all__ = ["ParallelTextEnv"]

logger = logging.getLogger(__name__)


def _build_env(factory: str | Callable[..., TextEnv], num_games: int, env_kwargs: dict) -> TextEnv:
    if isinstance(factory, str):
        factory = env_constructor(factory)
    return factory(num_groups=1, group_size=num_games, seed=0, **env_kwargs)


def die_with_parent(parent: int) -> None:
    """In a child process: end when the process ``parent`` ends, however it ends (``kill -9``
    included), so that no worker outlives its trainer. Linux: ``PR_SET_PDEATHSIG`` (the kernel sends
    SIGKILL when the parent dies); elsewhere a daemon thread polls the parent pid. Ctrl-C is left to
    the parent (SIGINT ignored here): it stops the run and closes its workers."""
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a forked worker inherits the trainer's SIGTERM handler (stop at the end of an iteration), which would
    # swallow multiprocessing's terminate() at exit and leave the trainer joining it forever
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0:  # PR_SET_PDEATHSIG = 1
                if os.getppid() != parent:  # the parent died before the call
                    os._exit(0)
                return
        except (OSError, AttributeError):
            pass

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="torchrl_agent-parent-watch", daemon=True).start()


def _worker_main(conn, factory, num_games: int, env_kwargs: dict, parent: int | None = None) -> None:
    """A worker's loop: build the games, then answer ``(command, [(local index, argument)])`` messages."""
    if parent is not None:
        die_with_parent(parent)
    # one torch thread: a forked child cannot use the parent's OpenMP pool (a big spec, the frames'
    # ``pixels``, would otherwise hang in its construction), and the games are plain Python anyway
    torch.set_num_threads(1)
    try:
        env = _build_env(factory, num_games, env_kwargs)
        games = env.games
        conn.send(("ready", int(env.max_steps), (env.image_shape, env.visual_task, env.visual_observation)))
    except (DataFileError, FileNotFoundError) as err:  # a bad or missing data file: the parent raises it as is
        conn.send(("error", traceback.format_exc(), err))
        return
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            command, payload = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if command == "close":
            return
        out = []
        for i, argument in payload:
            try:
                result = env.play(games[i], command, argument)  # a non-finite reward raises (checked_step)
                out.append((i, result, None))
            except Exception:
                out.append((i, None, traceback.format_exc(limit=5)))
        conn.send(("ok", out))


class _Worker:
    """One worker process and the global indices of the games it holds."""

    def __init__(self, rank: int, indices: list[int]):
        self.rank, self.indices = rank, indices
        self.process = None
        self.conn = None

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
        if self.process is not None:
            self.process.join(timeout=5)
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = None


class ParallelTextEnv(TextEnv):
    """A :class:`TextEnv` whose games step in worker processes.

    Args:
        env_name_or_factory: a registered environment name (see
            :func:`~torchrl_agent.envs.make_env`), or a callable ``(num_groups=, group_size=, seed=,
            **env_kwargs) -> TextEnv`` that each worker calls to build its games.
        num_workers: worker processes (default ``os.cpu_count()``; at most the batch size).
        num_groups, group_size, split, seed, modality: as for :class:`TextEnv`; the batch is ``[G * n]``.
        max_steps: episode length; default: the environment's own default.
        timeout: seconds a worker may take to answer one reset or step before it counts as hung.
        startup_timeout: seconds a worker may take to build its games.
        mp_start_method: ``"fork"`` (default), ``"forkserver"`` or ``"spawn"``.
        **env_kwargs: passed to the environment in every worker (``level=``, ``num_boxes=``, ...).

    Keys: those of :class:`TextEnv`, plus ``worker_fault`` (bool ``[B, 1]``).
    """

    def __init__(
        self,
        env_name_or_factory: str | Callable[..., TextEnv],
        *,
        num_workers: int | None = None,
        num_groups: int = 1,
        group_size: int = 1,
        max_steps: int | None = None,
        split: Literal["train", "eval"] = "train",
        seed: int = 0,
        modality: Literal["text", "image", "both"] = "text",
        timeout: float = 60.0,
        startup_timeout: float = 300.0,
        mp_start_method: str = "fork",
        **env_kwargs: Any,
    ):
        if not (isinstance(env_name_or_factory, str) or callable(env_name_or_factory)):
            raise TypeError(f"env_name_or_factory must be an env name or a callable, got {env_name_or_factory!r}")
        if isinstance(env_name_or_factory, str):
            if env_name_or_factory not in ENV_REGISTRY:
                raise KeyError(f"unknown environment {env_name_or_factory!r}; known: {sorted(ENV_REGISTRY)}")
        if num_groups < 1 or group_size < 1:
            raise ValueError(f"num_groups and group_size must be >= 1, got {num_groups}, {group_size}")
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if modality not in MODALITIES:
            raise ValueError(f"modality must be one of {MODALITIES}, got {modality!r}")
        if not timeout > 0 or not startup_timeout > 0:
            raise ValueError(f"timeout and startup_timeout must be > 0, got {timeout}, {startup_timeout}")
        if max_steps is not None:
            if max_steps < 1:
                raise ValueError(f"max_steps must be >= 1, got {max_steps}")
            env_kwargs["max_steps"] = max_steps
        batch = num_groups * group_size
        EnvBase.__init__(self, batch_size=torch.Size([batch]))
        self.num_groups, self.group_size, self.split = num_groups, group_size, split
        self.timeout, self.startup_timeout = float(timeout), float(startup_timeout)
        if modality != "text":  # a factory that shows text only need not know the option
            env_kwargs["modality"] = modality
        self._factory, self._env_kwargs = env_name_or_factory, env_kwargs
        self.modality = modality
        self._ctx = mp.get_context(mp_start_method)
        self.num_workers = min(num_workers or os.cpu_count() or 1, batch)
        self.num_restarts, self.fault_log = 0, []
        self._workers = [
            _Worker(rank, [int(i) for i in chunk])
            for rank, chunk in enumerate(np.array_split(np.arange(batch), self.num_workers))
        ]
        self._owner = np.zeros(batch, dtype=np.int64)  # global index -> worker rank
        self._local = np.zeros(batch, dtype=np.int64)  # global index -> index inside its worker
        for w in self._workers:
            self._owner[w.indices] = w.rank
            self._local[w.indices] = np.arange(len(w.indices))
        self.is_closed = False
        reported, visual = self._start(self._workers)
        self.max_steps = max_steps if max_steps is not None else reported
        self.image_shape, self.visual_task, self.visual_observation = visual  # as the workers' env reports
        self._episodes_started = 0
        self._group_seeds = [0] * num_groups
        self._step_count = np.zeros(batch, dtype=np.int64)
        self._done = np.ones(batch, dtype=bool)
        self._success = np.zeros(batch, dtype=bool)
        self._states: list[GameState] = [GameState("")] * batch
        self._make_specs()
        self.set_seed(seed)

    # ------------------------------------------------------------------ specs
    def _make_specs(self) -> None:
        super()._make_specs()
        spec = self.observation_spec.clone()
        spec["worker_fault"] = Categorical(2, shape=(*self.batch_size, 1), dtype=torch.bool)
        self.observation_spec = spec

    # ------------------------------------------------------------------ workers
    def _start(self, workers: list[_Worker]) -> tuple[int, tuple]:
        """Start ``workers`` (in parallel) and wait until they are ready; return the env's max_steps and
        its ``(image_shape, visual_task, visual_observation)``."""
        for w in workers:
            parent, child = self._ctx.Pipe()
            w.process = self._ctx.Process(
                target=_worker_main, args=(child, self._factory, len(w.indices), self._env_kwargs, os.getpid()),
                daemon=True,
            )
            w.process.start()
            child.close()
            w.conn = parent
        max_steps, visual = 0, (None, None, None)
        deadline = time.monotonic() + self.startup_timeout
        for w in workers:
            message = None
            if w.conn.poll(max(deadline - time.monotonic(), 0)):
                try:
                    message = w.conn.recv()
                except (EOFError, OSError):
                    message = None
            if message is None or message[0] != "ready":
                for other in workers:
                    other.kill()
                if message is not None and len(message) > 2:
                    raise message[2]  # its one-line message names the file (and the record and field)
                reason = message[1] if message else "no answer (died or timed out)"
                raise RuntimeError(f"worker {w.rank} of {self._factory!r} failed to start:\n{reason}")
            max_steps, visual = message[1], message[2]
        return max_steps, visual

    def _restart(self, w: _Worker, reason: str) -> None:
        self.fault_log.append(f"worker {w.rank}: {reason}")
        logger.warning("worker fault, worker %d restarted and its running episodes truncated: %s", w.rank, reason)
        self.num_restarts += 1
        w.kill()
        self._start([w])

    def _run(self, command: str, arguments: dict[int, Any]) -> tuple[dict[int, Any], set[int]]:
        """Send ``command`` for each global index in ``arguments`` to its worker; gather the results.

        Returns ``(results, restarted)``: the results by global index (missing where the call failed)
        and the global indices of every game held by a worker that had to be restarted.
        """
        by_worker: dict[int, list[tuple[int, Any]]] = {}
        for i, argument in arguments.items():
            by_worker.setdefault(int(self._owner[i]), []).append((int(self._local[i]), argument))
        results: dict[int, Any] = {}
        faulted: dict[int, str] = {}
        pending: dict[int, _Worker] = {}
        for rank, payload in by_worker.items():
            w = self._workers[rank]
            try:
                w.conn.send((command, payload))
                pending[rank] = w
            except (OSError, ValueError) as err:  # the worker is gone (e.g. killed while idle)
                faulted[rank] = f"{command}: send failed ({type(err).__name__})"
        deadline = time.monotonic() + self.timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables = {}
            for rank, w in pending.items():
                waitables[w.conn] = rank
                waitables[w.process.sentinel] = rank
            for ready in wait(list(waitables), timeout=remaining):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                w = pending[rank]
                try:
                    if not w.conn.poll():  # the process ended without an answer
                        raise EOFError
                    status, out = w.conn.recv()
                except (EOFError, OSError):
                    faulted[rank] = f"{command}: the worker died (exit code {w.process.exitcode})"
                    del pending[rank]
                    continue
                del pending[rank]
                for local, result, error in out:
                    if error is None:
                        results[w.indices[local]] = result
                    else:
                        self.fault_log.append(f"worker {rank}, game {w.indices[local]}: {error}")
                        logger.warning("worker fault, episode truncated: worker %d, game %d: %s", rank,
                                       w.indices[local], error.strip().splitlines()[-1])
        for rank in pending:
            faulted[rank] = f"{command}: no answer within {self.timeout} s"
        restarted: set[int] = set()
        for rank, reason in faulted.items():
            self._restart(self._workers[rank], reason)
            restarted.update(self._workers[rank].indices)
        return results, restarted

    # ------------------------------------------------------------------ reset / step
    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        n = self.batch_size[0]
        mask = np.ones(n, dtype=bool)
        if tensordict is not None and "_reset" in tensordict.keys():
            mask = tensordict.get("_reset").reshape(n).cpu().numpy().astype(bool)
        seeds: dict[int, int] = {}
        for g in range(self.num_groups):
            members = slice(g * self.group_size, (g + 1) * self.group_size)
            if mask[members].all():  # a whole group restarts on a new task
                self._group_seeds[g] = self._next_group_seed()
            for i in np.flatnonzero(mask[members]) + g * self.group_size:
                seeds[int(i)] = self._group_seeds[g]
        results, restarted = self._run("reset", seeds)
        missing = {i: s for i, s in seeds.items() if i not in results}
        if missing:  # one retry, on the restarted worker(s)
            retried, more = self._run("reset", missing)
            results.update(retried)
            restarted |= more
            if len(retried) < len(missing):
                raise RuntimeError(f"reset failed twice for games {sorted(set(missing) - set(retried))}; "
                                   f"last faults: {self.fault_log[-3:]}")
        fault = np.zeros(n, dtype=bool)
        for i in restarted - set(seeds):  # running games lost with their worker
            if not self._done[i]:
                fault[i] = self._done[i] = True
        for i, state in results.items():
            self._states[i] = state
            self._step_count[i] = 0
            self._done[i] = False
            self._success[i] = False
        td = self._observation_td(None, np.zeros(n, dtype=bool), fault)
        td.set("worker_fault", torch.from_numpy(fault).unsqueeze(-1))
        return td

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        n = self.batch_size[0]
        actions = _as_str_list(tensordict.get("action"), n)
        running = np.flatnonzero(~self._done)
        results, _ = self._run("step", {int(i): actions[i] for i in running})
        reward = np.zeros(n, dtype=np.float32)
        terminated = self._done.copy()  # finished earlier: the action is ignored, the state kept
        truncated = np.zeros(n, dtype=bool)
        fault = np.zeros(n, dtype=bool)
        for i in running:
            if i not in results:  # the worker died, hung, or the game raised
                fault[i] = truncated[i] = self._done[i] = True
                continue
            self._record_step(i, results[i], reward, terminated, truncated)
        td = self._observation_td(reward, terminated, truncated)
        td.set("worker_fault", torch.from_numpy(fault).unsqueeze(-1))
        return td

    # ------------------------------------------------------------------ lifecycle
    @property
    def worker_pids(self) -> list[int]:
        """The process id of each worker (for monitoring, or for fault-injection tests)."""
        return [w.process.pid if w.process is not None else -1 for w in self._workers]

    def close(self, *, raise_if_closed: bool = True) -> None:
        for w in getattr(self, "_workers", []):
            if w.conn is not None:
                try:
                    w.conn.send(("close", None))
                except (OSError, ValueError):
                    pass
            if w.process is not None:
                w.process.join(timeout=1)
            w.kill()
        super().close(raise_if_closed=raise_if_closed)

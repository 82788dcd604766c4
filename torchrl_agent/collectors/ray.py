"""Collection over a Ray cluster: Ray actors, each stepping a shard of the groups.

The same sharding as :class:`~torchrl_agent.collectors.MultiProcessStepCollector` (see
:mod:`torchrl_agent.collectors.shards`), with Ray actors for processes, so the shards may run on
other machines of the cluster:

- **``num_collectors`` actors**: each holds a :class:`~torchrl_agent.collectors.shards.CollectorShard`
  (a :class:`~torchrl_agent.collectors.StepCollector` over ``env_factory(shard_groups)`` with the
  policy ``policy_factory()``, both built in the actor). The policy is either an engine of the
  actor's own (transformers or vLLM: a copy of the weights per actor, refreshed by
  :meth:`~RayStepCollector.update_policy_weights_`) or a client of one shared engine served over
  HTTP (:class:`~torchrl_agent.modules.http_policy.HTTPPolicy`, e.g. vLLM's OpenAI server).
- **this process** (the Ray driver): hands out batches, gathers the shards' rows, applies
  ``postproc`` / fills the replay buffer, and sends new weights to the actors (one ``ray.put``,
  read by every actor).

Rows are those of the single-process :class:`~torchrl_agent.collectors.StepCollector` for the same
seed when the policy samples each request from its ``request_seed`` (the default of
:class:`PolicyFactory`): same ids, episodes, responses and log-probs.

TorchRL's own :class:`torchrl.collectors.distributed.RayCollector` is not used: it builds its
remote collectors with frame-based arguments (``frames_per_batch``, devices, ``split_trajs``, ...)
that a step collector, whose batch is one episode per environment, does not take; it gives every
remote collector the same environment (no shard of the groups, so ids and episodes would repeat)
and sets the seeds one collector after another (different seeds per collector); its weight sync
(``RayWeightSyncScheme``) expects an ``nn.Module`` policy in each remote collector, and its replay
buffer must be a Ray service. What is reused: TorchRL's ``BaseCollector`` interface and the
project's ``EngineReloadScheme`` for the weights.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.envs import EnvBase

from torchrl_agent.collectors.shards import CollectorShard, ShardedCollector
from torchrl_agent.collectors.weight_sync import EngineReloadScheme, as_state_dict, register_policy_scheme
from torchrl_agent.modules.policy import LLMPolicy

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
except ImportError as err:
    ray, _RAY_ERROR = None, err
else:
    _RAY_ERROR = None

__all__ = ["PolicyFactory", "RayStepCollector", "start_local_ray"]

_ENGINES = ("transformers", "vllm", "http")
logger = logging.getLogger("torchrl_agent")


def start_local_ray(**kwargs) -> None:
    """``ray.init(**kwargs)`` of the local cluster a collector starts when none is running: without
    the dashboard (``include_dashboard=False``: no web UI and no Jobs API, which runs code; Ray 2.60
    still starts a minimal dashboard head for its usage statistics, on 127.0.0.1, frontend
    disabled), and with Ray's
    token authentication, which Ray 2.60 (the version required) turns on for a cluster that
    ``ray.init`` starts unless ``RAY_AUTH_MODE`` says otherwise (then a warning). Ray's own gRPC
    servers (GCS, raylet, workers) listen on every interface whatever is asked (Ray 2.60 has no
    loopback-only option, and replaces a ``_node_ip_address`` of ``127.0.0.1`` by the node's
    address): the token guards them (docs/distributed.md)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        logger.warning("RAY_AUTH_MODE=disabled: the local Ray cluster's ports (every interface) take calls "
                       "without a token, and Ray's calls carry pickles: unset it, or firewall the ports")
    ray.init(include_dashboard=False, **kwargs)

_POLL_S = 0.5  # how often a waiting driver checks the actors it waits for


@dataclass
class PolicyFactory:
    """A picklable ``policy_factory``: builds a policy inside each actor.

    Args:
        engine: ``"transformers"`` (a copy of the model in every actor,
            :class:`~torchrl_agent.modules.TransformersPolicy`, or for a VLM folder
            :class:`~torchrl_agent.modules.VisionPolicy`: ``kwargs`` may then hold ``min_pixels``,
            ``max_pixels``), ``"vllm"`` (an engine in every actor,
            :class:`~torchrl_agent.modules.VLLMPolicy`; text models only so far) or ``"http"`` (a client of one shared server,
            :class:`~torchrl_agent.modules.http_policy.HTTPPolicy`; a VLM's frames as image content,
            which needs ``kwargs={"api": "chat"}``).
        model_path: the model folder (its weights; for ``"http"`` only its tokenizer).
        base_url: the server's root URL (``"http"`` only), e.g. ``http://HEAD_IP:8000``.
        dtype: the weights' dtype (``"transformers"``, ``"vllm"``).
        request_seeds: sample every request from its ``request_seed`` (rows independent of the
            sharding); forced for ``"vllm"``, which always does.
        kwargs: more keyword arguments of the policy (``max_new_tokens``, ``temperature``, ...).
    """

    engine: str
    model_path: str
    base_url: str | None = None
    dtype: str = "float32"
    request_seeds: bool = True
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.engine not in _ENGINES:
            raise ValueError(f"engine must be one of {_ENGINES}, got {self.engine!r}")
        if (self.engine == "http") != (self.base_url is not None):
            raise ValueError("base_url is required with engine='http', and only then")

    def __call__(self) -> LLMPolicy:
        from transformers import AutoTokenizer

        from torchrl_agent.models import is_vision_model

        vision = is_vision_model(self.model_path)
        if self.engine == "vllm":
            if vision:
                raise ValueError("PolicyFactory: the vLLM engine takes no images yet (docs/vision.md); serve a VLM "
                                 "with engine='transformers' or 'http'")
            from torchrl_agent.modules.vllm_policy import VLLMPolicy

            return VLLMPolicy(self.model_path, dtype=self.dtype, **self.kwargs)
        if self.engine == "transformers":  # a VLM: VisionPolicy, its frames read from `pixels`
            from torchrl_agent.modules.vision import transformers_engine

            return transformers_engine(self.model_path, dtype=self.dtype, request_seeds=self.request_seeds,
                                       **self.kwargs)
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        from torchrl_agent.modules.http_policy import HTTPPolicy

        # a VLM's frames go as OpenAI image content (api="chat")
        return HTTPPolicy(self.base_url, tokenizer, request_seeds=self.request_seeds,
                          **({"images": True} if vision else {}), **self.kwargs)


class _ShardActor(CollectorShard):
    """The actor: builds its environment and policy where it runs."""

    def __init__(self, env_factory, policy_factory, groups: int, group_offset: int, groups_total: int, seed: int,
                 num_threads: int | None):
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        env = env_factory(groups)
        try:
            super().__init__(env, policy_factory(), groups_total=groups_total, group_offset=group_offset, seed=seed)
        except BaseException:
            env.close()
            raise

    def ready(self) -> bool:
        return True

    @ray.method(concurrency_group="heartbeat") if ray is not None else (lambda f: f)
    def heartbeat(self) -> float:
        """Answered from a thread of its own while a command runs: an actor that does not answer
        (stopped by SIGSTOP, frozen) is named by the driver after ``heartbeat_timeout`` seconds."""
        return time.time()

    def pid(self) -> int:
        """The actor's process id (named when it dies; for monitoring and fault tests)."""
        return os.getpid()


class _ActorsTransport:
    """TorchRL ``TransportBackend``: the weights go once into Ray's object store; every actor loads
    them (``CollectorShard.update_weights``); returns when all have."""

    def __init__(self, collector: RayStepCollector):
        self.collector = collector

    def send_weights(self, weights) -> None:
        state = {k: v.detach().to("cpu").contiguous() for k, v in as_state_dict(weights).items()}
        ref = ray.put(state)
        self.collector._get([a.update_weights.remote(ref) for a in self.collector._actors], "the weight update")

    def receive_weights(self, timeout=None, *, weights=None, model=None, strategy=None):
        return None

    def check_connection(self) -> bool:
        return not self.collector._closed

    def setup_connection_and_weights_on_sender(self) -> None:
        pass

    def setup_connection_and_weights_on_receiver(self, *, worker_idx=None, weights=None, model=None, strategy=None):
        return None


class RayStepCollector(ShardedCollector):
    """:class:`~torchrl_agent.collectors.StepCollector` over ``num_collectors`` Ray actors (see the
    module notes). A TorchRL collector: iterate it, or call :meth:`collect`.

    Connects to the running Ray cluster (``ray.init(address="auto")`` beforehand on a multi-node
    cluster; without a ``ray.init`` call it starts a local one, :func:`start_local_ray`: no
    dashboard, token authentication). The
    package (and the env's data) must be installed on every node.

    Args:
        env_factory: ``env_factory(num_groups) -> env``, picklable: a transformed text environment of
            ``num_groups`` groups (:class:`~torchrl_agent.collectors.shards.TextEnvFactory`,
            :class:`~torchrl_agent.collectors.shards.ConfigEnvFactory`). Called once in each actor.
        policy_factory: ``policy_factory() -> LLMPolicy``, picklable (:class:`PolicyFactory`).
            Called once in each actor.
        num_groups: groups per batch, split as evenly as possible over the actors.
        num_collectors: actors (at most ``num_groups``).
        seed, total_frames, total_batches, replay_buffer, postproc: as for :class:`StepCollector`.
        max_batches_ahead: batches an actor may collect beyond the one being consumed (0: on-policy).
        actor_options: Ray's options of each actor (default ``{"num_cpus": 1}``; e.g.
            ``{"num_cpus": 4, "num_gpus": 1}`` for an engine per GPU).
        start_timeout: seconds to wait for the actors to start.
        heartbeat_timeout: while the driver waits for an actor, it pings it (a method served by a
            thread of its own, :meth:`_ShardActor.heartbeat`); an actor that does not answer within
            this many seconds (stopped by SIGSTOP, frozen) is named, with its pid, and the collector
            raises ``RuntimeError``. An actor that died is named as soon as Ray reports it.

    Example::

        ray.init(address="auto")
        collector = RayStepCollector(TextEnvFactory("numberline", path, group_size=2),
                                     PolicyFactory("transformers", path, kwargs={"max_new_tokens": 32}),
                                     num_groups=8, num_collectors=4, total_batches=10)
        for rows in collector:
            ...
            collector.update_policy_weights_(model.state_dict())
        collector.shutdown()
    """

    def __init__(self, env_factory: Callable[[int], EnvBase], policy_factory: Callable[[], LLMPolicy], *,
                 num_groups: int, num_collectors: int = 2, seed: int = 0, total_frames: int = -1,
                 total_batches: int | None = None, replay_buffer=None, postproc=None, max_batches_ahead: int = 0,
                 actor_options: dict[str, Any] | None = None, start_timeout: float = 600.0,
                 heartbeat_timeout: float = 60.0):
        if ray is None:
            raise ImportError("RayStepCollector needs Ray, an optional extra: pip install 'torchrl-agent[ray]'"
                              ) from _RAY_ERROR
        if not heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout must be > 0, got {heartbeat_timeout}")
        self.heartbeat_timeout, self._running, self._faulted = float(heartbeat_timeout), False, False
        super().__init__(num_groups=num_groups, num_collectors=num_collectors, seed=seed, total_frames=total_frames,
                         total_batches=total_batches, replay_buffer=replay_buffer, postproc=postproc,
                         max_batches_ahead=max_batches_ahead)
        self._pending: dict[tuple[int, int], list] = {}  # (epoch, batch) -> one object ref per actor
        self._actors: list = []
        if not ray.is_initialized():
            start_local_ray()
        options = {"num_cpus": 1, **(actor_options or {})}
        threads = max(1, int(options["num_cpus"])) if options.get("num_cpus") else None
        actor_class = ray.remote(concurrency_groups={"heartbeat": 1})(_ShardActor).options(**options)
        try:
            self._actors = [actor_class.remote(env_factory, policy_factory, groups, offset, num_groups, seed, threads)
                            for groups, offset in self.shards]
            self._get([a.ready.remote() for a in self._actors], "the actors to start", start_timeout)
            self._pids = self._get([a.pid.remote() for a in self._actors], "the actors' process ids")
            self._running = True  # from now on, an actor that does not answer its heartbeat is hung
        except BaseException:
            self.shutdown()
            raise
        register_policy_scheme(self, EngineReloadScheme(_ActorsTransport(self)))

    # ------------------------------------------------------------------ the actors
    def _get(self, refs: list, what: str, timeout: float | None = None) -> list:
        """``ray.get(refs)`` (one ref per actor, in order), naming the actor that failed: an actor
        that died (killed, out of memory, its node lost) is reported as soon as Ray knows, with its
        pid; one that does not answer its heartbeat for ``heartbeat_timeout`` seconds (stopped,
        frozen) then. Either way the collector cannot go on (a training run stops with a message,
        ``resume=auto`` continues it)."""
        t0, pings = time.monotonic(), {}  # rank -> (heartbeat ref, when sent)
        try:
            while True:
                ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=_POLL_S)
                if not waiting:
                    return ray.get(refs)
                if ready:
                    ray.get(ready)  # an actor that died or failed: raises now, not when the others are done
                if timeout is not None and time.monotonic() - t0 > timeout:
                    raise GetTimeoutError
                if self._running:
                    self._check_heartbeats([r for r, ref in enumerate(refs) if ref in waiting], pings, what)
        except GetTimeoutError:
            raise TimeoutError(f"waiting for {what}: no answer in {timeout:.0f} s") from None
        except (RayActorError, RayTaskError) as err:
            self._faulted = True
            rank = next((r for r, ref in enumerate(refs) if _failed(ref)), "?")
            raise RuntimeError(f"waiting for {what}: collector actor {rank}{self._pid(rank)} failed:\n{err}") from err

    def _pid(self, rank) -> str:
        pids = getattr(self, "_pids", [])
        return f" (pid {pids[rank]})" if isinstance(rank, int) and rank < len(pids) else ""

    def _check_heartbeats(self, ranks: list[int], pings: dict, what: str) -> None:
        """Ping each actor of ``ranks`` (the ones still working) once its last ping was answered;
        raise ``RuntimeError`` naming those whose ping went unanswered for ``heartbeat_timeout`` s."""
        now, silent = time.monotonic(), []
        for rank in ranks:
            ping = pings.get(rank)
            if ping is None or ray.wait([ping[0]], timeout=0)[0]:
                pings[rank] = (self._actors[rank].heartbeat.remote(), now)
            elif now - ping[1] > self.heartbeat_timeout:
                silent.append(f"collector actor {rank}{self._pid(rank)}, silent for {now - ping[1]:.0f} s")
        if silent:
            self._faulted = True
            raise RuntimeError(f"waiting for {what}: no heartbeat from {', '.join(silent)} within heartbeat_timeout="
                               f"{self.heartbeat_timeout:g} s (stopped or frozen?); the collector stops")

    def _send(self, command: tuple) -> None:
        kind = command[0]
        if kind == "collect":
            self._pending[command[1:]] = [a.collect.remote(command[2]) for a in self._actors]
        elif kind == "seed":
            self._get([a.set_seed.remote(command[1]) for a in self._actors], "the actors' new seed")
        elif kind == "load":
            self._get([a.load_state_dict.remote(command[1]) for a in self._actors], "the actors' state")
        else:
            raise ValueError(f"unknown command {kind!r}")

    def _gather(self, batch: int) -> list[tuple[TensorDictBase, dict]]:
        return self._get(self._pending.pop((self._epoch, batch)), f"batch {batch}")

    def _drop_in_flight(self) -> None:
        self._pending.clear()  # the actors finish them (in order, before the restart command); nobody reads them

    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Close the actors' environments and kill the actors (their resources go back to the
        cluster). Ray itself keeps running."""
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        if not ray.is_initialized():  # Ray was shut down first: its actors went with it
            self._actors = []
            return
        if close_env and self._actors:
            try:  # after a fault (an actor dead or silent) the others are not waited for long
                ray.get([a.close.remote() for a in self._actors], timeout=timeout or (2.0 if self._faulted else 30.0))
            except Exception:  # an actor that died or hangs: killed below all the same
                pass
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        # ray.kill is asynchronous: return once every actor is gone (its resources back to the cluster)
        deadline = time.monotonic() + (timeout or 30.0)  # a stopped actor's process is SIGKILLed too
        for actor in self._actors:
            while time.monotonic() < deadline:
                try:
                    ray.get(actor.ready.remote(), timeout=max(0.1, deadline - time.monotonic()))
                except Exception:  # RayActorError: the kill has landed
                    break
                time.sleep(0.05)
        self._actors = []


def _failed(ref) -> bool:
    """Whether ``ref`` holds an error (after a failed ``ray.get``)."""
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return False
    try:
        ray.get(ready[0])
    except Exception:
        return True
    return False


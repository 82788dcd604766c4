"""Multi-process collection: collector processes over one shared, continuously batching vLLM engine.

Processes (all started with ``spawn``; the collector starts and stops them):

- **one engine server**: a :class:`~torchrl_agent.modules.VLLMPolicy`'s engine (vLLM's ``LLMEngine``,
  in that process). Requests of every collector process are added to the engine as they arrive and
  the engine steps the running batch (continuous batching): a request joins the batch at the next
  engine step, whoever sent it, and leaves it as soon as it finishes. With
  ``engine={"engine": "transformers", ...}`` it is the folder's transformers engine instead, one call
  at a time: a VLM's (:class:`~torchrl_agent.modules.VisionPolicy`; each client expands its prompts'
  images and sends each frame, uint8, beside the token ids: :class:`EngineClient`).
- **``num_collectors`` collector processes**: each owns ``shards_per_collector`` shards of the
  groups (a :class:`~torchrl_agent.collectors.StepCollector` over ``env_factory(shard_groups)``
  each, stepped by a thread of its own). A shard steps its environments, builds and tokenizes
  prompts, sends the prompts of its running environments to the engine server and decodes the
  answers. While one shard steps its games, the engine serves the others; two shards per process
  keep the process busy while one of them waits for its answers (the engine's latency, every step).
- **this process**: hands out batches, gathers the shards' rows, applies ``postproc`` / fills the
  replay buffer, and sends new weights to the engine server.

Rows are those of the single-process :class:`~torchrl_agent.collectors.StepCollector` with the same
environments, engine and seed: a shard gives its environments the single-process ids (``group_id``,
``traj_id``), plays the same episodes (its env skips the other shards' group seeds), and every
request carries the ``request_seed`` of its ``(seed, traj_id, step_count)``. vLLM samples a seeded
request independently of the batch it runs in (checked on the CPU engine: same tokens, log-probs
within 1e-6, in batches of 1, 8 and 16). The batch is returned in the single-process order
(``step_count``, then ``traj_id``).

``max_batches_ahead=0`` (on-policy, the default): a shard starts batch ``b + 1`` only when the
consumer asks for it, i.e. after it used batch ``b`` (and updated the weights); meanwhile it resets
its games for it (a reset does not involve the policy). With ``k > 0`` a
shard that finished batch ``b`` goes on with up to ``k`` later batches instead of waiting for the
slowest shard (their rows may then come from weights up to ``k`` updates old). A weight update
waits for the engine's running requests to finish, so every response is sampled with one set of
weights.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable

import torch
from torchrl.envs import EnvBase

from torchrl_agent.collectors.shards import CollectorShard, ShardedCollector, TextEnvFactory, split_groups
from torchrl_agent.collectors.weight_sync import EngineReloadScheme, as_state_dict, register_policy_scheme
from torchrl_agent.modules.policy import Generation, LLMPolicy

__all__ = ["MultiProcessStepCollector", "EngineClient", "TextEnvFactory"]

logger = logging.getLogger(__name__)

_POLL_S = 1.0
_BEAT_S = 0.5  # a child process's heartbeat period


def _get_while_parent_lives(q, parent: int):
    """``q.get()`` in a child process; exits if the parent process died (no orphaned engines)."""
    while True:
        try:
            return q.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:
                raise SystemExit(0) from None


def _start_heartbeat(beats, slot: int, parent: int) -> None:
    """In a child process: die with the parent (:func:`~torchrl_agent.envs.workers.die_with_parent`)
    and write the time into ``beats[slot]`` every ``_BEAT_S`` seconds from a daemon thread. A process
    that is stopped (SIGSTOP) or frozen stops beating; the coordinator notices (``heartbeat_timeout``)."""
    from torchrl_agent.envs.workers import die_with_parent

    die_with_parent(parent)

    def beat():
        while True:
            beats[slot] = time.time()
            time.sleep(_BEAT_S)

    beats[slot] = time.time()
    threading.Thread(target=beat, name="torchrl_agent-heartbeat", daemon=True).start()


def _process_state(pid: int | None) -> str:
    """``" (stopped)"`` when process ``pid`` is stopped (SIGSTOP, ``/proc/PID/stat`` state T), else ``""``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return " (stopped: SIGSTOP?)" if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t") else ""
    except (OSError, IndexError, TypeError):
        return ""


class EngineClient(LLMPolicy):
    """The policy of a collector process: prompts go to the engine server, answers come back.

    Tokenizes the prompts and decodes the responses here (in the collector process); the server
    only sees token ids. Every request must carry its sampling seed (``request_seed``).

    With a VLM's ``processor`` it also reads ``pixels``: each prompt's image is expanded here
    (:func:`~torchrl_agent.modules.vision.prompt_with_image`, the engine's ``min_pixels`` and
    ``max_pixels``) and its frame (uint8 ``[H, W, 3]``) travels with the token ids; the rows get
    ``image_tokens`` as :class:`~torchrl_agent.modules.VisionPolicy` writes them."""

    accepts_request_seeds = True

    def __init__(self, tokenizer, requests, responses, rank: int, *, processor=None, min_pixels: int | None = None,
                 max_pixels: int | None = None, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self._requests, self._responses, self.rank = requests, responses, rank
        self._calls, self._parent = 0, os.getppid()
        self.processor = processor
        self.image_bounds = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        if processor is not None:
            self.in_keys = [*LLMPolicy.in_keys, "pixels"]
            self.out_keys = [*LLMPolicy.out_keys, "image_tokens"]

    def _generate_inputs(self, tensordict) -> dict:
        return {} if self.processor is None else {"images": tensordict.get("pixels")}

    def generate(self, prompts: list[str], seeds: list[int] | None = None, images=None) -> list[Generation]:
        if seeds is None:
            raise ValueError("the engine server samples seeded requests only: pass seeds")
        if images is None:
            ids, frames = [self.encode(p) for p in prompts], [None] * len(prompts)
        else:
            from torchrl_agent.modules.vision import prompt_with_image

            ids = [self.encode(prompt_with_image(self.processor, p, frame, **self.image_bounds)[0])
                   for p, frame in zip(prompts, images)]
            frames = [frame.numpy() for frame in images]  # by value through the queue, not a shared-memory handle
        self._calls += 1
        self._requests.put(("generate", self.rank, self._calls, [(i, p, int(s), f) for i, (p, s, f) in
                                                                  enumerate(zip(ids, seeds, frames))]))
        call, results = _get_while_parent_lives(self._responses, self._parent)
        if call != self._calls:
            raise RuntimeError(f"engine server answered call {call}, expected {self._calls}")
        return [Generation(p, response, log_probs, self.decode(response), too_long, cached)
                for p, (too_long, response, log_probs, cached) in zip(ids, results)]

    def forward(self, tensordict):
        tensordict = super().forward(tensordict)
        if self.processor is None:
            return tensordict
        from torchrl_agent.modules.vision import set_image_tokens

        return set_image_tokens(tensordict, self.tokenizer.convert_tokens_to_ids("<|image_pad|>"))


def _engine_main(engine_kwargs: dict, requests, responses: list, acks, threads: int = 1, beats=None) -> None:
    """The engine server: admit requests as they come, step the engine, answer finished calls."""
    parent = os.getppid()
    if beats is not None:
        _start_heartbeat(beats, 0, parent)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # before the engine's OpenMP runtime starts
    torch.set_num_threads(threads)
    engine_kwargs = dict(engine_kwargs)
    if engine_kwargs.pop("engine", "vllm") == "transformers":
        return _transformers_server(engine_kwargs, requests, responses, acks, parent)
    try:
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from torchrl_agent.modules.vllm_policy import VLLMPolicy

        policy = VLLMPolicy(**engine_kwargs)
        engine = policy.llm.llm_engine
        policy.generate(["warm-up"], seeds=[0])  # the first request pays one-off set-up costs: not a collector's
    except BaseException:
        acks.put(("error", traceback.format_exc()))
        return
    acks.put(("ready", policy.max_prompt_tokens))
    calls: dict[tuple[int, int], list] = {}  # (rank, call) -> [results, outstanding]
    owner: dict[str, tuple[int, int, int]] = {}  # engine request id -> (rank, call, index)
    held: list = []  # calls that arrived while a weight update waits for the running batch
    pending_weights = None
    busy_s, engine_steps, batched = 0.0, 0, 0  # time in engine.step, steps, requests summed over steps

    def answer_if_complete(key):
        if calls[key][1] == 0:
            responses[key[0]].put((key[1], calls.pop(key)[0]))

    def admit(message):
        _, rank, call, items = message
        key = (rank, call)
        calls[key] = [[None] * len(items), len(items)]
        for i, ids, seed, _ in items:  # no frames: a VLM is refused before the server starts
            if not ids or len(ids) > policy.max_prompt_tokens:  # never sent to the engine (as VLLMPolicy)
                calls[key][0][i] = (True, [], [], 0)
                calls[key][1] -= 1
                continue
            params = policy._sampling_params(1, [seed])[0]
            params.output_kind = RequestOutputKind.FINAL_ONLY
            request_id = f"{rank}:{call}:{i}"  # outputs carry it (add_request returns an internal id)
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=ids), params)
            owner[request_id] = (rank, call, i)
        answer_if_complete(key)

    try:
        while True:
            messages = []
            if not engine.has_unfinished_requests() and pending_weights is None:
                messages.append(_get_while_parent_lives(requests, parent))  # idle: wait for work
            while True:
                try:
                    messages.append(requests.get_nowait())
                except queue.Empty:
                    break
            for message in messages:
                if message[0] == "stop":
                    return
                if message[0] == "stats":
                    acks.put(("stats", {"busy_s": busy_s, "engine_steps": engine_steps, "requests_x_steps": batched}))
                elif message[0] == "weights":
                    pending_weights = message[1]
                elif pending_weights is not None:
                    held.append(message)
                else:
                    admit(message)
            if pending_weights is not None and not engine.has_unfinished_requests():
                try:
                    policy.update_weights(pickle.loads(pending_weights))
                    acks.put(("updated", None))
                except Exception:
                    acks.put(("error", traceback.format_exc()))
                pending_weights = None
                for message in held:
                    admit(message)
                held = []
            if engine.has_unfinished_requests():
                batched += engine.get_num_unfinished_requests()
                t0 = time.perf_counter()
                outputs = engine.step()
                busy_s, engine_steps = busy_s + time.perf_counter() - t0, engine_steps + 1
                for output in outputs:
                    if output.finished:
                        rank, call, i = owner.pop(output.request_id)
                        calls[(rank, call)][0][i] = (False, *policy.completion(output))
                        calls[(rank, call)][1] -= 1
                        answer_if_complete((rank, call))
    finally:
        policy.close()


def _transformers_server(engine_kwargs: dict, requests, responses: list, acks, parent: int) -> None:
    """The engine server of ``engine="transformers"``: one call at a time, each prompt sampled from
    its seed (:func:`~torchrl_agent.modules.vision.transformers_engine` with ``request_seeds``: the
    rows do not depend on which calls share the server); a VLM takes each prompt's frame."""
    try:
        from torchrl_agent.modules.vision import transformers_engine

        policy = transformers_engine(engine_kwargs.pop("model_path"), request_seeds=True, **engine_kwargs)
    except BaseException:
        acks.put(("error", traceback.format_exc()))
        return
    acks.put(("ready", policy.max_prompt_tokens))
    busy_s, calls, prompts = 0.0, 0, 0
    while True:
        message = _get_while_parent_lives(requests, parent)
        if message[0] == "stop":
            return
        if message[0] == "stats":
            acks.put(("stats", {"busy_s": busy_s, "engine_steps": calls, "requests_x_steps": prompts}))
        elif message[0] == "weights":
            try:
                policy.model.load_state_dict(pickle.loads(message[1]))
                acks.put(("updated", None))
            except Exception:
                acks.put(("error", traceback.format_exc()))
        else:
            _, rank, call, items = message
            t0 = time.perf_counter()
            frames = [frame for *_, frame in items]
            inputs = None if not frames or frames[0] is None else [policy.image_inputs([frame]) for frame in frames]
            out = policy._generate_encoded([ids for _, ids, _, _ in items], [seed for _, _, seed, _ in items], inputs)
            busy_s, calls, prompts = busy_s + time.perf_counter() - t0, calls + 1, prompts + len(items)
            responses[rank].put((call, [(g.prompt_too_long, g.response_ids, g.log_probs, 0) for g in out]))


def _collector_main(rank: int, env_factory, shards: list[tuple[int, int, int]], groups_total: int, seed: int,
                    client_kwargs: dict, requests, responses: list, commands, data,
                    total_batches: int | None = None, beats=None) -> None:
    """A collector process: one :class:`CollectorShard` per ``(shard, groups, first group)`` of ``shards``,
    each stepped by a thread of its own, all driven by the main process's commands.

    The threads share the process's one core's worth of Python (the GIL). A shard waiting for the
    engine server's answer releases it, so another shard of the process steps its games meanwhile:
    the generation of one shard overlaps the game stepping of the other (with one shard per
    process, a process would sit idle for the whole generation of every step)."""
    parent, built = os.getppid(), []
    if beats is not None:
        _start_heartbeat(beats, 1 + rank, parent)
    # the env's worker processes (env.num_workers) are children of this one, which multiprocessing refuses to a
    # daemonic process: they die with it (die_with_parent) and the coordinator stops it, so it may have them
    mp.current_process()._config["daemon"] = False
    try:
        torch.set_num_threads(1)
        from transformers import AutoTokenizer

        from torchrl_agent.models import is_vision_model, load_processor

        model_path = client_kwargs.pop("model_path")
        vision = is_vision_model(model_path)
        for shard, groups, offset in shards:
            env = env_factory(groups)
            try:  # a tokenizer per shard: a fast tokenizer is not meant to be shared between threads
                processor = load_processor(model_path) if vision else None
                tokenizer = processor.tokenizer if vision else AutoTokenizer.from_pretrained(model_path)
                client = EngineClient(tokenizer, requests, responses[shard], shard, processor=processor,
                                      **client_kwargs)
                built.append((shard, CollectorShard(env, client, groups_total=groups_total, group_offset=offset,
                                                    seed=seed)))
            except BaseException:
                env.close()
                raise
    except BaseException:
        data.put(("error", rank, None, traceback.format_exc()))
        for _, shard in built:
            shard.close()
        return
    inboxes = [queue.SimpleQueue() for _ in built]
    threads = [threading.Thread(target=_shard_loop, args=(shard_id, shard, inbox, data, total_batches), daemon=True,
                                name=f"torchrl_agent-shard-{shard_id}")
               for (shard_id, shard), inbox in zip(built, inboxes)]
    for thread in threads:
        thread.start()
    data.put(("ready", rank, None, None))
    try:
        while True:
            command = _get_while_parent_lives(commands, parent)
            for inbox in inboxes:  # every shard runs the commands in order
                inbox.put(command)
            if command[0] == "stop":
                break
        for thread in threads:
            thread.join()
    finally:
        for _, shard in built:
            shard.close()


def _shard_loop(shard_id: int, shard: CollectorShard, inbox: queue.SimpleQueue, data,
                total_batches: int | None = None) -> None:
    """A shard's thread in a collector process: run the commands of ``inbox`` until ``("stop",)``;
    answer ``("rows", shard_id, (epoch, batch), pickled (rows, figures))`` to each ``collect``.

    After answering, a shard with no command waiting resets its games for the next batch
    (:meth:`StepCollector.prepare_next_batch`): with ``max_batches_ahead=0`` it would otherwise
    sit idle until the slowest shard is done and the consumer asks for the next batch."""
    try:
        while True:
            command = inbox.get()
            if command[0] == "stop":
                return
            if command[0] == "seed":
                shard.set_seed(command[1])
            elif command[0] == "load":
                shard.load_state_dict(command[1])
            elif command[0] == "collect":
                epoch, batch = command[1], command[2]
                # plain pickle of the packed rows: tensors travel by value (one message), not as shared-memory handles
                data.put(("rows", shard_id, (epoch, batch), pickle.dumps(shard.collect(batch))))
                if (total_batches is None or batch + 1 < total_batches) and inbox.empty():
                    shard.prepare_next_batch()
    except BaseException:
        data.put(("error", shard_id, None, traceback.format_exc()))


class _ServerTransport:
    """TorchRL ``TransportBackend``: weights to the engine server, acknowledged once loaded."""

    def __init__(self, collector: MultiProcessStepCollector):
        self.collector = collector

    def send_weights(self, weights) -> None:
        state = {k: v.detach().to("cpu").contiguous() for k, v in as_state_dict(weights).items()}
        self.collector._requests.put(("weights", pickle.dumps(state)))
        kind, detail = self.collector._wait(self.collector._acks, "the engine server's weight update")
        if kind != "updated":
            raise RuntimeError(f"engine server failed to load the weights:\n{detail}")

    def receive_weights(self, timeout=None, *, weights=None, model=None, strategy=None):
        return None

    def check_connection(self) -> bool:
        return self.collector._engine.is_alive()

    def setup_connection_and_weights_on_sender(self) -> None:
        pass

    def setup_connection_and_weights_on_receiver(self, *, worker_idx=None, weights=None, model=None, strategy=None):
        return None


class MultiProcessStepCollector(ShardedCollector):
    """:class:`~torchrl_agent.collectors.StepCollector` over ``num_collectors`` processes sharing one
    vLLM engine server (see the module notes). A TorchRL collector: iterate it, or call :meth:`collect`.

    Args:
        env_factory: ``env_factory(num_groups) -> env``, picklable (a module-level function or a
            ``functools.partial``): a transformed text environment of ``num_groups`` groups, as for
            :class:`StepCollector`. Called once in each collector process.
        engine: keyword arguments of :class:`~torchrl_agent.modules.VLLMPolicy` (``model_path``
            required; ``max_new_tokens``, ``temperature``, ``max_model_len``, ...), built in the
            engine server. With ``"engine": "transformers"`` the server runs the folder's
            transformers engine instead (:func:`~torchrl_agent.modules.vision.transformers_engine`:
            :class:`~torchrl_agent.modules.VisionPolicy` for a VLM, whose ``min_pixels`` and
            ``max_pixels`` the collector processes' clients use too), one call at a time, each
            prompt sampled from its seed: the engine of a VLM (vLLM takes no images here yet).
        num_groups: groups per batch, split as evenly as possible over the shards (in order: the
            shards of process 0 first).
        num_collectors: collector processes (at most ``num_groups``).
        shards_per_collector: shards of the groups each collector process steps, one thread each
            (default 1; at most ``num_groups`` shards in all): with 2, while one shard waits for the
            engine server, another steps its games (see :func:`_collector_main`), at the price of
            smaller engine batches (on 2 CPU cores with ALFWorld it measured slower: 1.04x the
            single process against 1.27x with 1, in an earlier run of the benchmark). The
            environments of a process's shards are then stepped from different threads: ``env_factory``'s
            environments must not share unguarded process-wide state.
        seed, total_frames, total_batches, replay_buffer, postproc: as for :class:`StepCollector`.
        max_batches_ahead: batches a shard may collect beyond the one being consumed (0: on-policy).
        start_timeout: seconds to wait for the processes to start.
        heartbeat_timeout: seconds without a heartbeat (every 0.5 s, from a thread of each process)
            after which a process counts as hung (stopped by SIGSTOP, frozen): the collector raises,
            naming it, and shuts its processes down. A process that exits is noticed within a
            second, with its exit code. Either way the collector stops with ``RuntimeError`` (the
            trainer's run stops with a message, ``resume=auto`` continues it); it never hangs.
        engine_threads: torch/OpenMP threads of the engine server (default 1: the collector processes
            step their games on the other cores, and a small model's engine step does not get faster
            with more threads; measured in ``benchmarks/collector_throughput.py``).

    Example::

        collector = MultiProcessStepCollector(partial(make_alfworld_env, tokenizer_path), engine={
            "model_path": path, "max_new_tokens": 64}, num_groups=8, num_collectors=2, total_batches=10)
        for rows in collector:
            ...
            collector.update_policy_weights_(model.state_dict())
        collector.shutdown()
    """

    def __init__(self, env_factory: Callable[[int], EnvBase], engine: dict, *, num_groups: int,
                 num_collectors: int = 2, seed: int = 0, total_frames: int = -1, total_batches: int | None = None,
                 replay_buffer=None, postproc=None, max_batches_ahead: int = 0, start_timeout: float = 600.0,
                 engine_threads: int = 1, shards_per_collector: int = 1, heartbeat_timeout: float = 60.0):
        if not heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout must be > 0, got {heartbeat_timeout}")
        self.heartbeat_timeout = float(heartbeat_timeout)
        if engine_threads < 1:
            raise ValueError(f"engine_threads must be >= 1, got {engine_threads}")
        if shards_per_collector < 1:
            raise ValueError(f"shards_per_collector must be >= 1, got {shards_per_collector}")
        self.engine_threads = engine_threads
        if "model_path" not in engine:
            raise ValueError("engine: 'model_path' is required (the VLLMPolicy keyword arguments)")
        if engine.get("engine", "vllm") not in ("vllm", "transformers"):
            raise ValueError(f"engine['engine'] must be 'vllm' or 'transformers', got {engine['engine']!r}")
        if engine.get("engine", "vllm") == "vllm":
            from torchrl_agent.models import is_vision_model

            if is_vision_model(engine["model_path"]):
                raise ValueError("engine: the engine server's vLLM engine takes no images yet (docs/vision.md); "
                                 "serve a VLM with engine['engine']='transformers'")
        super().__init__(num_groups=num_groups, num_collectors=num_collectors, seed=seed, total_frames=total_frames,
                         total_batches=total_batches, replay_buffer=replay_buffer, postproc=postproc,
                         max_batches_ahead=max_batches_ahead,
                         num_shards=min(num_groups, num_collectors * shards_per_collector))
        self._arrived: dict = {}
        self._start(env_factory, dict(engine), start_timeout)
        register_policy_scheme(self, EngineReloadScheme(_ServerTransport(self)))

    # ------------------------------------------------------------------ processes
    def _start(self, env_factory, engine: dict, timeout: float) -> None:
        ctx = mp.get_context("spawn")
        k = self.num_collectors
        self._requests, self._acks, self._data = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self._responses = [ctx.Queue() for _ in self.shards]  # one per shard (its engine client)
        self._commands = [ctx.Queue() for _ in range(k)]
        # one heartbeat slot per process (0: the engine server, 1 + r: collector process r), checked once
        # every process is ready (while starting: is_alive and start_timeout), see _check_processes
        self._beats = ctx.Array("d", [0.0] * (k + 1), lock=False)
        self._engine = ctx.Process(target=_engine_main, name="torchrl_agent-engine", daemon=True,
                                   args=(engine, self._requests, self._responses, self._acks, self.engine_threads,
                                         self._beats))
        self._engine.start()
        client = {"model_path": str(engine["model_path"]), "max_new_tokens": engine.get("max_new_tokens", 64),
                  "temperature": engine.get("temperature", 1.0),
                  **{k: engine[k] for k in ("min_pixels", "max_pixels") if k in engine}}  # a VLM's image bounds
        # process r steps shards first .. first + count - 1: (shard, groups, first group) each
        owned = [[(i, *self.shards[i]) for i in range(first, first + count)]
                 for count, first in split_groups(len(self.shards), k)]
        self._workers = [ctx.Process(target=_collector_main, name=f"torchrl_agent-collector-{r}", daemon=True,
                                     args=(r, env_factory, owned[r], self.num_groups, self.seed, dict(client),
                                           self._requests, self._responses, self._commands[r], self._data,
                                           self.total_batches, self._beats))
                         for r in range(k)]
        for w in self._workers:
            w.start()
        try:
            kind, detail = self._wait(self._acks, "the engine server to start", timeout)
            if kind != "ready":
                raise RuntimeError(f"the engine server failed to start:\n{detail}")
            self.max_prompt_tokens = detail
            for _ in range(k):
                kind, rank, _, detail = self._wait(self._data, "the collector processes to start", timeout)
                if kind != "ready":
                    raise RuntimeError(f"collector process {rank} failed to start:\n{detail}")
            self._running = True  # from now on, a process without a heartbeat is hung (see _check_processes)
            logger.info("collector processes started: %s", ", ".join(f"{p.name} (pid {p.pid})"
                                                                       for p in [self._engine, *self._workers]))
        except BaseException:
            self.shutdown()
            raise

    def _wait(self, q, what: str, timeout: float | None = None):
        """``q.get()``, raising within about a second when a process died (named, with its exit code),
        after ``heartbeat_timeout`` s without a heartbeat from a process (stopped by SIGSTOP, frozen),
        or after ``timeout`` seconds."""
        t0 = time.monotonic()
        while True:
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_processes(what)
                if timeout is not None and time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"waiting for {what}: no answer in {timeout:.0f} s") from None

    def _check_processes(self, what: str) -> None:
        """Raise ``RuntimeError`` naming every process that exited (and its exit code) or whose
        heartbeat is older than ``heartbeat_timeout`` seconds; the collector cannot go on: it shuts
        its processes down first (nothing is left for the caller to clean up, and no queue feeder
        blocked on a dead reader's pipe holds the interpreter at exit)."""
        procs = [self._engine, *self._workers]
        dead = [f"{p.name} (pid {p.pid}, exit code {p.exitcode})" for p in procs if not p.is_alive()]
        if dead:
            self._fail(f"waiting for {what}: process(es) {', '.join(dead)} exited; the collector "
                       f"stops (its processes are shut down){self._reported_errors()}")
        if not getattr(self, "_running", False):  # starting: a loading engine may hold its GIL for long
            return
        now = time.time()
        stale = [(i, p) for i, p in enumerate(procs) if 0 < self._beats[i] < now - self.heartbeat_timeout]
        for _, p in stale:  # a killed process may take a moment to be reaped: report it as exited then
            p.join(2.0)
        dead = [f"{p.name} (pid {p.pid}, exit code {p.exitcode})" for _, p in stale if not p.is_alive()]
        if dead:
            self._fail(f"waiting for {what}: process(es) {', '.join(dead)} exited; the collector "
                       f"stops (its processes are shut down){self._reported_errors()}")
        silent = [f"{p.name} (pid {p.pid}{_process_state(p.pid)}, silent for {now - self._beats[i]:.0f} s)"
                  for i, p in stale]
        if silent:
            self._fail(f"waiting for {what}: no heartbeat from {', '.join(silent)} within "
                       f"heartbeat_timeout={self.heartbeat_timeout:g} s; the collector stops (its processes "
                       "are shut down)")

    def _fail(self, message: str) -> None:
        self.shutdown()
        raise RuntimeError(message) from None

    def _reported_errors(self) -> str:
        """The tracebacks the processes sent before they exited (a failed start exits with code 0
        after sending its error), read from the queues without waiting."""
        found = []
        for q in (self._data, self._acks):
            while True:
                try:
                    message = q.get_nowait()
                except (queue.Empty, OSError, ValueError):
                    break
                if message[0] == "error":
                    found.append(f"\n{message[-1]}")
        return "".join(found)

    def _send(self, command: tuple) -> None:
        for commands in self._commands:
            commands.put(command)

    def _gather(self, batch: int) -> list:
        key = (self._epoch, batch)
        while len(self._arrived.get(key, {})) < len(self.shards):
            kind, shard, tag, payload = self._wait(self._data, f"batch {batch}")
            if kind == "error":
                self._fail(f"collector shard {shard} failed:\n{payload}")
            if tag[0] == self._epoch:  # batches of an earlier seed are dropped
                self._arrived.setdefault(tag, {})[shard] = payload
        shards = self._arrived.pop(key)
        return [pickle.loads(shards[i]) for i in range(len(self.shards))]

    def _drop_in_flight(self) -> None:
        self._arrived.clear()

    # ------------------------------------------------------------------ engine server
    def engine_stats(self) -> dict:
        """The engine server's counters: ``busy_s`` (seconds spent in ``engine.step``), ``engine_steps``
        and ``requests_x_steps`` (unfinished requests summed over the steps: over ``engine_steps``, the
        mean batch)."""
        self._requests.put(("stats",))
        kind, detail = self._wait(self._acks, "the engine server's counters")
        if kind != "stats":
            raise RuntimeError(f"engine server answered {kind!r} to a stats request: {detail}")
        return detail

    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Stop the collector processes (closing their environments) and the engine server."""
        if self._closed:
            return
        self._closed = True
        if not hasattr(self, "_engine"):  # __init__ failed before any process started
            return
        self._workers = getattr(self, "_workers", [])  # the engine started, the collectors did not
        for commands, w in zip(self._commands, self._workers):
            if w.is_alive():
                commands.put(("stop",))
        if self._engine.is_alive():
            self._requests.put(("stop",))
        # a fault (a process died or went silent): the others cannot finish their calls, do not wait for them
        now = time.time()
        beats = getattr(self, "_beats", None)
        faulted = any(not p.is_alive() for p in [*self._workers, self._engine]) or (
            beats is not None and getattr(self, "_running", False)
            and any(0 < b < now - self.heartbeat_timeout for b in beats))
        deadline = time.monotonic() + (timeout or (2.0 if faulted else 30.0))
        for p in [*self._workers, self._engine]:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()  # SIGKILL ends a stopped process too
                p.join(5)
        for q in [self._requests, self._acks, self._data, *self._responses, *self._commands]:
            q.cancel_join_thread()
            q.close()

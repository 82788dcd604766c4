"""Data-parallel training with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Launch with ``torchrun --nproc_per_node N ...``; without ``torchrun`` every helper here is a no-op
and the program runs as a single process (world size 1), unchanged.

The pieces, in the order a trainer uses them::

    rank, world, device = init_distributed()          # process group: nccl on CUDA, gloo on CPU
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard_model(model.to(device), mp_policy=policy)   # float32 master shards, bf16 compute
    optimizer = torch.optim.AdamW(model.parameters(), ...)   # after sharding: over the DTensor shards
    rows = broadcast_object(rows)                     # every rank holds the same rows
    for idx in minibatches:                           # the same order on every rank
        local, active = shard_indices(idx, rank, world)    # this rank's rows of the mini-batch
        micro = token-budget parts of `local`         # see batching.micro_batches
        weights, count = accumulation_weights([loss_units(lengths(m), aggregation) for m in micro])
        for part, weight in zip(micro, weights):      # (ranks with fewer parts run weightless ones)
            losses = loss_module(batch of rows[part])  # mask &= active
            (weight * total_loss).backward()          # FSDP2 averages gradients over ranks
        grad_norm = clip_grad_norm(model.parameters(), max_norm)
        optimizer.step()                              # (skipped when grad_norm is not finite)
    state = full_state_dict(model)                    # full weights on rank 0 (weight sync, checkpoints)
    optim = full_optimizer_state_dict(model, optimizer)   # checkpoints; load_full_*() to resume

Exactness. FSDP2 reduce-scatters gradients with an *average* over the ``W`` ranks. With
``token-mean`` the loss of a mini-batch is ``S / N`` (``S`` the sum of the per-token losses over all
its ``N`` tokens); rank ``r`` sees ``S_r / n_r`` over its own ``n_r`` tokens, and the mean over ranks
of ``S_r / n_r`` is *not* ``S / N`` when the ``n_r`` differ. :func:`distributed_loss_scale` returns
``W * n_r / N`` (``N`` all-reduced), so that ``mean_r(W * n_r / N * S_r / n_r) = S / N``: the
gradient is exactly the single-process gradient of the whole mini-batch. For the ``seq-mean-*``
aggregations the counted units are rows (with at least one token) instead of tokens. Micro-batches
are the same sum one level down: micro-batch ``m`` of rank ``r`` is weighted ``W * n_m / N``
(:func:`accumulation_weights`), and the accumulated, rank-averaged gradient is again ``S / N``'s.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "all_gather_object",
    "balanced_split",
    "barrier",
    "broadcast_object",
    "cleanup",
    "clip_grad_norm",
    "accumulation_weights",
    "decoder_layers",
    "distributed_loss_scale",
    "full_optimizer_state_dict",
    "full_state_dict",
    "full_weights",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed",
    "is_main_process",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "loss_units",
    "most_over_ranks",
    "reduce_mean",
    "shard_indices",
    "shard_model",
    "split_over_ranks",
]

logger = logging.getLogger("torchrl_agent")


# ---------------------------------------------------------------------- process group
def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def init_distributed(device: str | torch.device | None = None, *, backend: str | None = None,
                     timeout_s: float = 1800.0) -> tuple[int, int, torch.device]:
    """Joins the process group when launched by ``torchrun``; returns ``(rank, world_size, device)``.

    ``torchrun`` is detected by the ``RANK`` and ``WORLD_SIZE`` environment variables (it also sets
    ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``). Then the default process group is created
    (``nccl`` when the device is CUDA, ``gloo`` on CPU) and a CUDA rank is bound to
    ``cuda:LOCAL_RANK``. Without them no process group is created and ``(0, 1, device)`` is returned.
    Calling it again once the group exists returns the same values.

    Args:
        device: ``"cpu"`` or ``"cuda"`` (or a ``torch.device``) to force a device type; by default CUDA
            when available, else CPU.

    Keyword Args:
        backend: the process-group backend; by default ``nccl`` for CUDA and ``gloo`` for CPU.
        timeout_s: collective timeout in seconds.
    """
    if device is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        try:
            device_type = torch.device(device).type
        except (RuntimeError, TypeError):
            device_type = None
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"`device` must be 'cpu' or 'cuda', got {device!r}")
        if device_type == "cuda" and not torch.cuda.is_available():
            raise ValueError("`device` is 'cuda' but torch.cuda.is_available() is False")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, torch.device(device_type)
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"environment: RANK={rank} must be in [0, WORLD_SIZE={world})")
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA device(s)")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
    return rank, world, dev


def is_distributed() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """True on rank 0 (and in a single process): the one that logs, evaluates and writes checkpoints."""
    return get_rank() == 0


def barrier() -> None:
    """Waits for every rank (no-op in a single process)."""
    if is_distributed():
        dist.barrier()


def cleanup() -> None:
    """Destroys the process group, if any."""
    if is_distributed():
        dist.destroy_process_group()


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Returns rank ``src``'s (picklable) ``obj`` on every rank, e.g. the collected rows."""
    if not is_distributed():
        return obj
    box = [obj if get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's (picklable) ``obj``, in rank order, on every rank (``[obj]`` in a single process).
    Tensors inside ``obj`` should be on CPU."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def most_over_ranks(count: int) -> int:
    """The largest ``count`` over the ranks: how many collective passes (e.g. FSDP2 forwards) every
    rank must run when each has ``count`` of its own (a rank with fewer runs empty ones)."""
    if not is_distributed():
        return int(count)
    t = torch.tensor([int(count)], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def balanced_split(costs: list[int], parts: int) -> list[list[int]]:
    """Indices ``0 .. len(costs) - 1`` split into ``parts`` lists of about equal total cost; each index
    in exactly one list, every list in increasing order. Longest first onto the least loaded part
    (ties: the lower part), so the split is the same on every rank for the same ``costs``."""
    if parts < 1:
        raise ValueError(f"`parts` must be >= 1, got {parts}")
    load = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        p = min(range(parts), key=lambda r: (load[r], r))
        out[p].append(i)
        load[p] += costs[i]
    return [sorted(o) for o in out]


def _collective_device() -> torch.device:
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_mean(value: float | torch.Tensor) -> float:
    """The mean of a scalar over the ranks (for logging; the value itself in a single process)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
    if not is_distributed():
        return float(value)
    t = torch.as_tensor(value, dtype=torch.float64).detach().reshape(()).to(_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t) / get_world_size()


# ---------------------------------------------------------------------- sharding the model
def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model``: ``model.model.layers`` for Hugging Face causal LMs, else
    every module whose class name ends with ``DecoderLayer`` (outermost first, none nested)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.Sequential)) and len(layers) > 0:
        return list(layers)
    found: list[nn.Module] = []
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer") and not any(
                module is not outer and any(m is module for m in outer.modules()) for outer in found):
            found.append(module)
    return found


def shard_model(model: nn.Module, *, mp_policy=None, reshard_after_forward: bool = True,
                mesh=None) -> nn.Module:
    """Applies FSDP2 ``fully_shard`` to each decoder layer, then to the root; returns ``model``.

    The embeddings, the final norm and the LM head stay in the root's group, so tied input/output
    embeddings (``tie_word_embeddings=True``) remain one shared parameter. Move the model to its
    device first; build the optimizer *after* this call (its parameters become ``DTensor`` shards).
    Without a process group (a single process not launched by ``torchrun``) the model is returned
    unchanged.

    Args:
        model: a causal LM (any ``nn.Module`` with decoder layers; else only the root is sharded).

    Keyword Args:
        mp_policy (torch.distributed.fsdp.MixedPrecisionPolicy, optional): e.g.
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: bf16
            compute over fp32 master weights.
        reshard_after_forward (bool): free the gathered parameters of each layer after its forward
            (ZeRO-3, less memory) or keep them to the backward (ZeRO-2, less communication).
        mesh (DeviceMesh, optional): a 1-D mesh; by default all ranks, on the model's device type.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
    if not is_distributed():
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        param = next(model.parameters(), None)
        device_type = param.device.type if param is not None else "cpu"
        if device_type == "meta":
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, (get_world_size(),))
    kwargs = dict(mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(),
                  reshard_after_forward=reshard_after_forward)
    layers = decoder_layers(model)
    if not layers:
        logger.warning("shard_model: no decoder layers found in %s; sharding the root only",
                       type(model).__name__)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict, on CPU, on rank 0; an empty dict on the other ranks.

    Every rank must call it (it all-gathers). For weight sync into a rollout engine and for
    checkpoints. In a single process: ``model.state_dict()`` copied to CPU (detached).
    """
    if not is_distributed():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_weights(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on EVERY rank, floating tensors cast to ``dtype``: what each rank
    loads into its own rollout engine after an update. Every rank must call it (each ``DTensor``
    shard is all-gathered, one tensor at a time, in the same order everywhere), so at most one full
    float32 tensor beyond the result exists at once. Tensors stay on the model's device (the engine
    of a rank shares it). In a single process: ``model.state_dict()`` detached and cast."""
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        full = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()
        out[name] = full.to(dtype) if dtype is not None and full.is_floating_point() else full
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Loads a full state dict held by rank 0 (other ranks pass ``{}``) into a sharded ``model``;
    every rank must call it. ``state_dict`` itself is left unchanged."""
    if not is_distributed():
        model.load_state_dict(state_dict)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # a shallow copy: the loader replaces the dict's values with the local shards
    set_model_state_dict(model, dict(state_dict),
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state, keyed by parameter name (``{"state": {fqn: {...}}, "param_groups"}``),
    on CPU, on rank 0 (an empty dict on the other ranks). Every rank must call it. The format is the
    same with or without a process group, so a checkpoint of N ranks resumes on M."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                   state_dict: dict[str, Any]) -> None:
    """Loads :func:`full_optimizer_state_dict`'s output (held by rank 0; other ranks pass ``{}``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if state_dict:  # a structural copy (tensors shared): the loader may replace values in place
        state_dict = {**state_dict, "state": {k: dict(v) for k, v in state_dict.get("state", {}).items()},
                      "param_groups": [dict(g) for g in state_dict.get("param_groups", [])]}
    set_optimizer_state_dict(model, optimizer, state_dict,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=is_distributed()))


# ---------------------------------------------------------------------- data parallelism
def shard_indices(indices: torch.Tensor | list[int], rank: int | None = None,
                  world_size: int | None = None) -> tuple[list[int], bool]:
    """This rank's part of a mini-batch: ``indices[rank::world_size]``; returns ``(local, active)``.

    Every rank must run the same number of forward/backward passes (FSDP2's collectives), so a rank
    left without rows (a mini-batch smaller than the world) gets ``indices[:1]`` and
    ``active=False``: the caller zeroes its mask (``mask & active``), which makes its loss and its
    token count 0 while it still takes part in the collectives.
    """
    rank = get_rank() if rank is None else rank
    world_size = get_world_size() if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"`rank` must be in [0, world_size={world_size}), got {rank}")
    indices = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
    if not indices:
        raise ValueError("`indices` is empty: a mini-batch needs at least one row")
    local = indices[rank::world_size]
    return (local, True) if local else (indices[:1], False)


def split_over_ranks(compute, costs: list[int], batches) -> tuple[list[Any], list[int]]:
    """Per-item results computed once over the ranks: each rank its share, then gathered.

    Items ``0 .. len(costs) - 1`` (e.g. rows, ``costs`` their token counts) are split by
    :func:`balanced_split`; this rank runs ``compute(part)`` (one result per item of ``part``, e.g.
    a no-grad forward of the sharded model) over ``batches(share)`` (its share cut into passes, e.g.
    token-budget micro-batches). Every rank runs the same number of passes (FSDP2's forwards are
    collective): a rank with fewer repeats ``compute([0])`` and drops the result. The results
    (moved to CPU) are all-gathered, so every rank returns all of them, in item order, and the
    items it computed itself (its share). In a single process: every item, in the same passes as
    ``batches(list(range(len(costs))))``.
    """
    share = balanced_split(costs, get_world_size())[get_rank()]
    passes = batches(share) if share else []
    mine: dict[int, Any] = {}
    for k in range(most_over_ranks(len(passes))):
        if k >= len(passes):
            compute([0])  # an empty pass, for the collectives of the ranks with more
            continue
        for i, value in zip(passes[k], compute(passes[k])):
            mine[i] = value.cpu() if torch.is_tensor(value) else value
    out: list[Any] = [None] * len(costs)
    for part in all_gather_object(mine):
        for i, value in part.items():
            out[i] = value
    return out, share


def loss_units(response_lengths: torch.Tensor | list[int], aggregation: str = "token-mean") -> int:
    """What a loss ``aggregation`` averages over, counted for rows of these response lengths: tokens
    for ``token-mean``, rows with at least one token for ``seq-mean-token-sum`` / ``seq-mean-token-mean``."""
    from torchrl_agent.objectives.clip_loss import AGGREGATIONS

    if aggregation not in AGGREGATIONS:
        raise ValueError(f"`aggregation` must be one of {AGGREGATIONS}, got {aggregation!r}")
    lengths = torch.as_tensor(response_lengths, dtype=torch.long).reshape(-1)
    return int(lengths.sum()) if aggregation == "token-mean" else int((lengths > 0).sum())


def accumulation_weights(units: list[int]) -> tuple[list[float], int]:
    """Loss weights for gradient accumulation over micro-batches, exact over ranks.

    This rank runs its rows of a mini-batch as micro-batches holding ``units[m]`` loss units each
    (:func:`loss_units`). Micro-batch ``m``'s loss (a mean over its own units) is weighted by
    ``W * units[m] / N``, ``N`` the units of the whole mini-batch summed over the ``W`` ranks, so the
    sum of the weighted losses, averaged over ranks by FSDP2, is the whole mini-batch's loss (see the
    module docstring). Every rank must call it. Returns the weights and the number of micro-batches
    every rank must run: the most any rank has (a rank with fewer runs weightless ones, with a zero
    mask, so that FSDP2's collectives match). In a single process: ``units[m] / sum(units)``.
    """
    local = torch.tensor([float(sum(units)), float(len(units))], dtype=torch.float64)
    total, count = float(local[0]), len(units)
    if is_distributed():
        both = local.to(_collective_device())
        summed, most = both[:1].clone(), both[1:].clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        total, count = float(summed), int(most)
    return [get_world_size() * u / max(total, 1.0) for u in units], count


def distributed_loss_scale(mask: torch.Tensor, aggregation: str = "token-mean") -> torch.Tensor:
    """The factor for this rank's loss so that FSDP2's averaged gradient is the whole mini-batch's.

    ``W * n_r / N``: ``n_r`` counts this rank's units, ``N`` their sum over the ranks (all-reduced),
    ``W`` the world size: :func:`accumulation_weights` for one micro-batch. Units are tokens for
    ``token-mean`` and rows with at least one token for ``seq-mean-token-sum`` /
    ``seq-mean-token-mean`` (see the module docstring). Multiply the summed loss terms by it before
    ``backward``; ``reduce_mean(scale * loss)`` is then the mini-batch's loss. Every rank must call
    it. In a single process it is ``1``.

    Args:
        mask: ``[N, T]`` bool, True on this rank's response tokens.
        aggregation: the loss module's aggregation.
    """
    if mask.ndim != 2:
        loss_units([], aggregation)  # names a bad aggregation first
        raise ValueError(f"`mask` must have shape [N, T], got {tuple(mask.shape)}")
    units = loss_units(mask.bool().sum(-1), aggregation)
    if not is_distributed():
        return torch.ones((), dtype=torch.float32, device=mask.device)
    (weight,), _ = accumulation_weights([units])
    return torch.tensor(weight, dtype=torch.float32, device=mask.device)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over plain or FSDP2 (``DTensor``) parameters; returns the
    total norm (over all shards) as a plain scalar tensor."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach()

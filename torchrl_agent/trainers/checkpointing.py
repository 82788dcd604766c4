"""Checkpoint files: written atomically, verified when read, loaded without running any code.

A checkpoint is a ``torch.save`` archive that ``torch.load(path, weights_only=True)`` reads: tensors
and plain containers (dict, list, tuple) of str / int / float / bool / None, nothing whose
unpickling runs code (a pickled object's ``__reduce__`` can run anything when the file is opened).
Its entries::

    "format"     str    FORMAT
    "checksum"   str    SHA-256 of every other entry (tensor bytes, dtypes, shapes and plain values)
    "iteration"  int    the last finished iteration
    "model", "optimizer", "collector", "algorithm"   state dicts
    "rng"        dict   torch (uint8 tensor), python (tuple), numpy (plain_numpy_state)
    "evals", "config"   the held-out curve and the run's config
    "history_records", "history_sha256"   how many metrics records the run had written (its
                        ``metrics.jsonl``, the history kept once in the run folder) and their digest
                        (``run_dir.records_digest``); a checkpoint of an earlier version holds the
                        records themselves, ``"history"``

Written to ``NAME.tmp`` beside ``NAME``, flushed and ``fsync``-ed, then renamed over ``NAME`` and the
folder ``fsync``-ed: a checkpoint on disk is whole or absent, whatever kills the writer. No fixed
free-space margin: the write is attempted, and a full disk (``ENOSPC``) or any other failed write
leaves the previous checkpoint as it was and raises :class:`CheckpointError`.

Under torchrun (an FSDP2-sharded model) the weights and the optimizer state are not gathered: each
rank writes its own shards with ``torch.distributed.checkpoint`` (DCP) into the folder ``NAME.shards``
beside ``NAME.pt`` (:func:`write_shards`), and rank 0's ``NAME.pt`` holds the rest, with::

    "shards"     dict   {"dir": "NAME.shards", "files": {file: SHA-256}, "model_shapes": {name: shape}}

in place of ``"model"`` and ``"optimizer"``. The shards are written to ``NAME.shards.tmp``, fsync-ed,
the folder renamed to ``NAME.shards``, and only then ``NAME.pt`` is written (atomically, as above):
``NAME.pt`` on disk means its shards are whole. DCP reshards on load, so a checkpoint of N ranks
resumes on M (one process included: :func:`load_weights`). A single process keeps the one-file
format: it holds the whole state anyway, and one file is the simplest thing to copy or evaluate.

Read by :func:`read_checkpoint`: ``torch.load(weights_only=True)`` then the checksum recomputed, so
a truncated file, a text file, flipped bytes, a missing or changed shard, or a pickled (older) checkpoint is refused with
:class:`CheckpointLoadError`, a one-line message naming the file, the reason and the next step.
:func:`find_resumable` (``resume=auto``, ``resume=RUN_DIR``) takes the newest checkpoint *by
iteration* that reads and verifies, and says which it skipped and why.

A checkpoint written by an older torchrl-agent (pickled with ``weights_only=False``) is refused; a
trusted one is converted with::

    python -m torchrl_agent.trainers.checkpointing convert OLD.pt NEW.pt

The weights of either format, as a Hugging Face folder (safetensors) for serving (:func:`export_hf`)::

    python -m torchrl_agent.trainers.checkpointing export RUN/checkpoints/last.pt OUT_DIR
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import pickle
import re
import shutil
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import torch

__all__ = ["FORMAT", "RESUME_IDENTITY", "RESUME_MAY_CHANGE", "CheckpointError", "CheckpointLoadError", "ShardWrite",
           "check_model_state", "check_resume_config", "checksum", "convert", "export_hf", "find_resumable", "fsync_path",
           "load_shards", "load_weights", "model_shapes", "numpy_state", "plain_numpy_state", "prune_checkpoints",
           "read_checkpoint", "read_weights", "remove_unfinished", "resolve_resume", "save_weights", "shards_dir",
           "start_shards", "write_checkpoint", "write_shards"]

logger = logging.getLogger("torchrl_agent")

FORMAT = "torchrl_agent.checkpoint/2"
CONVERT = "python -m torchrl_agent.trainers.checkpointing convert"
_ITERATION_NAME = re.compile(r"iteration_(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (no space, a failed write, non-finite weights); the
    message says why and which earlier checkpoint is intact."""


class CheckpointLoadError(ValueError):
    """A checkpoint file that cannot be used; the one-line message names the file, why, and what to do."""


# ----------------------------------------------------------------------------------- plain state
def plain_numpy_state(state=None) -> dict:
    """numpy's global RNG state (``np.random.get_state()``) as plain types and a tensor."""
    name, keys, pos, has_gauss, cached = np.random.get_state() if state is None else state
    return {"bit_generator": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def numpy_state(plain: dict) -> tuple:
    """The inverse of :func:`plain_numpy_state`, for ``np.random.set_state``."""
    return (plain["bit_generator"], plain["keys"].numpy().astype(np.uint32), plain["pos"], plain["has_gauss"],
            plain["cached_gaussian"])


def to_plain(obj, where: str = "state"):
    """``obj`` with every value one that ``torch.load(weights_only=True)`` reads: tensors (numpy
    arrays become tensors), dict / list / tuple, str / int / float / bool / None (numpy scalars and
    paths are converted). Raises ``TypeError`` naming the entry of anything else."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, dict):  # OrderedDict too (a state_dict): a plain dict, in the same order
        return {k: to_plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return tuple(out) if isinstance(obj, tuple) else out
    raise TypeError(f"{where}: a {type(obj).__name__} cannot go into a checkpoint (tensors and plain values only)")


def checksum(state: dict) -> str:
    """SHA-256 over every entry of ``state`` except ``"checksum"``: the bytes, dtype and shape of
    each tensor and the type and value of each plain value, in order."""
    digest = hashlib.sha256()

    def feed(obj) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
        elif isinstance(obj, dict):
            digest.update(f"D{len(obj)}".encode())
            for k, v in obj.items():
                feed(k)
                feed(v)
        elif isinstance(obj, (list, tuple)):
            digest.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}".encode())
            for v in obj:
                feed(v)
        else:
            digest.update(f"{type(obj).__name__}:{obj!r};".encode())

    feed({k: v for k, v in state.items() if k != "checksum"})
    return digest.hexdigest()


# ----------------------------------------------------------------------------------- write
def fsync_path(path: Path) -> None:
    """``fsync`` a file or a folder, if it can be opened (a missing file, or a platform without
    directory file descriptors: nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_checkpoint(state: dict, path: str | Path, *, kept: str = "") -> int:
    """Write ``state`` (made plain by :func:`to_plain`, with ``format`` and ``checksum`` added) to
    ``path`` atomically (``PATH.tmp``, fsync, rename, fsync of the folder); returns its size in bytes.

    Any failed write (a full disk, a file-size limit, an I/O error) removes the ``.tmp``, leaves
    ``path`` as it was and raises :class:`CheckpointError` naming the file, the cause, the free space
    and ``kept`` (which earlier checkpoint is intact)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": FORMAT, **to_plain({k: v for k, v in state.items() if k not in ("format", "checksum")})}
    state["checksum"] = checksum(state)
    tmp = path.with_name(path.name + ".tmp")
    f = None
    try:
        with open(tmp, "wb") as raw:
            f = _Writer(raw)
            torch.save(state, f)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)  # never a half-written checkpoint under the real name
    except (OSError, RuntimeError) as err:
        try:
            free = f"{_free_bytes(path.parent) / 1e6:.1f} MB free in {path.parent}"
        except OSError:
            free = f"free space of {path.parent} unknown"
        tmp.unlink(missing_ok=True)
        cause = (f is not None and f.error) or err  # torch reports a failed write as "unexpected pos"
        text = str(cause).splitlines()[0] if str(cause) else ""
        raise CheckpointError(f"writing {path} failed ({type(cause).__name__}: {text}); {free} (disk full?)"
                              + (f"; {kept}" if kept else "")) from err
    fsync_path(path.parent)
    return path.stat().st_size


class _Writer:
    """The file ``torch.save`` writes to, keeping the first ``OSError`` of a write (``ENOSPC``,
    ``EFBIG``): torch reports it as an unrelated ``RuntimeError``."""

    def __init__(self, raw):
        self.raw, self.error = raw, None

    def write(self, data) -> int:
        try:
            return self.raw.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.raw.flush()


def _free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


# ----------------------------------------------------------------------------------- read
def _problem(path: Path) -> str | None:
    """Why ``path`` cannot be a checkpoint archive, from its first bytes (``None``: it may be one)."""
    if not path.is_file():
        return "no such file"
    size = path.stat().st_size
    if size == 0:
        return "empty (0 bytes)"
    if zipfile.is_zipfile(path):
        return None
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith(b"PK"):
        return f"truncated ({size} bytes, the archive's directory is missing)"
    if head.startswith(b"\x80"):
        return f"a pickle in torch's legacy format (may run code when loaded); if you trust it: {CONVERT} {path} NEW.pt"
    try:
        head.decode("utf-8")
        return f"a text file ({size} bytes), not a checkpoint"
    except UnicodeDecodeError:
        return f"not a torch.save archive ({size} bytes)"


def read_checkpoint(path: str | Path, *, verify: bool = True) -> dict:
    """The state of checkpoint ``path``, read with ``torch.load(weights_only=True)`` (no code of the
    file runs) and checked against its checksum. Raises :class:`CheckpointLoadError` naming the file
    and what is wrong: missing, empty, truncated, a text file, bytes changed since it was written,
    or an older pickled checkpoint (then how to convert a trusted one)."""
    path = Path(path)
    problem = _problem(path)
    if problem is not None:
        raise CheckpointLoadError(f"checkpoint {path}: {problem}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # a global outside the allowed types: an older, pickled checkpoint
        first = str(err).strip().splitlines()
        found = next((x.strip() for x in first if "Unsupported global" in x or "GLOBAL" in x), first[0] if first else "")
        raise CheckpointLoadError(
            f"checkpoint {path}: refused, it holds pickled objects that would run code when loaded ({found[:120]}); "
            f"it was written by an older torchrl-agent or by someone else. If you trust it, convert it: "
            f"{CONVERT} {path} NEW.pt") from None
    except Exception as err:  # a damaged archive (flipped bytes in its records, a truncated record)
        raise CheckpointLoadError(f"checkpoint {path}: damaged, it does not load ({type(err).__name__}: "
                                  f"{str(err).strip().splitlines()[0][:160] if str(err).strip() else ''})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or "checksum" not in state:
        raise CheckpointLoadError(
            f"checkpoint {path}: not a {FORMAT} checkpoint (no format/checksum entry: written by an older "
            f"torchrl-agent or another program); if you trust it, convert it: {CONVERT} {path} NEW.pt")
    if verify and checksum(state) != state["checksum"]:
        raise CheckpointLoadError(f"checkpoint {path}: damaged, its content does not match its checksum (bytes "
                                  "changed after it was written: a disk, copy or transfer error); use an earlier one")
    if verify and "shards" in state and (problem := _check_shards(path, state["shards"])) is not None:
        raise CheckpointLoadError(f"checkpoint {path}: {problem}; use an earlier one")
    return state


def check_model_state(model_state: dict, expected: dict, path: str | Path, config: dict | None = None) -> None:
    """Raise :class:`CheckpointLoadError` (one line) when the checkpoint's weights ``model_state``
    (tensors, or their shapes: :func:`model_shapes`) do not fit the model (``expected``: ``name -> shape`` of its state dict): another model size or
    architecture. Names the first difference and the checkpoint's own ``model`` config."""
    have = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v) for k, v in model_state.items()
            if isinstance(v, (torch.Tensor, list, tuple))}
    want = {k: tuple(s) for k, s in expected.items()}
    shape = [k for k in want if k in have and have[k] != want[k]]
    missing = [k for k in want if k not in have]
    extra = [k for k in have if k not in want]
    if not (shape or missing or extra):
        return
    if shape:
        first = f"{shape[0]} is {list(have[shape[0]])} in the file, {list(want[shape[0]])} in this model"
    else:
        first = f"first missing: {missing[0]}" if missing else f"first unexpected: {extra[0]}"
    trained = ""
    model_cfg = (config or {}).get("model") or {}
    if model_cfg:
        trained = f"; it was trained with model.name={model_cfg.get('name')} model.path={model_cfg.get('path')}"
    raise CheckpointLoadError(
        f"checkpoint {path} holds the weights of another model ({len(shape)} tensors of another shape, "
        f"{len(missing)} missing, {len(extra)} unexpected; {first}){trained}: pass the same model as its run")


# ----------------------------------------------------------------------------------- sharded (torchrun)
def shards_dir(path: str | Path) -> Path:
    """The folder of checkpoint ``path``'s shards: ``NAME.shards`` beside ``NAME.pt``."""
    path = Path(path)
    return path.with_name(path.stem + ".shards")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _local(value):
    """The part of a (``DTensor``) state entry this rank holds."""
    return value.to_local() if hasattr(value, "to_local") else value


def write_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path, *,
                 kept: str = "", reference: torch.nn.Module | None = None) -> dict:
    """Every rank (under torchrun) writes its shards of ``model``'s weights and ``optimizer``'s state
    (and of ``reference``'s weights when given: the KL reference, when it is not the loaded model)
    into ``NAME.shards`` beside checkpoint ``path`` with ``torch.distributed.checkpoint`` (nothing
    is gathered: each rank writes what it holds, in parallel); returns, on every rank, the
    checkpoint's ``"shards"`` entry: the folder's name, each file's SHA-256, the model's full
    shapes and whether the reference is in it. Written to ``NAME.shards.tmp``, fsync-ed, renamed;
    ``NAME.pt`` (rank 0, :func:`write_checkpoint`) comes after. Raises :class:`CheckpointError` on
    every rank, the previous checkpoint intact, for NaN/inf weights or a failed write."""
    return start_shards(model, optimizer, path, kept=kept, reference=reference).result()


def _async_group():
    """The process group of asynchronous shard writes (gloo, created once, by every rank together):
    their collectives run in DCP's background thread, apart from the training's."""
    global _ASYNC_GROUP
    if _ASYNC_GROUP is None:
        _ASYNC_GROUP = torch.distributed.new_group(backend="gloo")
    return _ASYNC_GROUP


_ASYNC_GROUP = None


def start_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path, *,
                 kept: str = "", reference: torch.nn.Module | None = None, asynchronous: bool = False) -> ShardWrite:
    """:func:`write_shards` in two halves: this one (every rank) checks the weights and starts the
    write; :meth:`ShardWrite.result` (every rank, together) finishes it. With ``asynchronous`` the
    shards are copied to CPU memory (DCP's staging) and written by a background thread
    (``dcp.async_save``), so training goes on while they are written: the checkpoint is the state
    at this call, whatever the steps taken before :meth:`~ShardWrite.result`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    from torchrl_agent.trainers.distributed import all_gather_object, barrier, is_main_process

    path = Path(path)
    final = shards_dir(path)
    tmp = final.with_name(final.name + ".tmp")
    model_state, optimizer_state = get_state_dict(model, optimizer)  # this rank's shards (DTensors), no copy
    tensors = {"model": model_state, "optimizer": optimizer_state}
    if reference is not None:
        tensors["reference"] = get_model_state_dict(reference)
    bad = [k for k, v in model_state.items() if torch.is_tensor(v) and v.is_floating_point()
           and not torch.isfinite(_local(v)).all()]
    bad = sorted({k for part in all_gather_object(bad) for k in part})
    if bad:
        raise CheckpointError(f"not writing {path}: {len(bad)} weight tensors hold NaN/inf (first: {bad[0]}); the "
                              f"training diverged (lower algorithm.lr, kl_coef or entropy_coef)"
                              + (f"; {kept}" if kept else ""))
    if is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    shapes = {k: list(v.shape) for k, v in model_state.items() if torch.is_tensor(v)}
    write = ShardWrite(path, kept, shapes, reference is not None)
    writer = dcp.FileSystemWriter(tmp, sync_files=True)
    try:  # DCP gathers the ranks' write errors: every rank raises (in result() when asynchronous)
        if asynchronous:
            write.future = dcp.async_save(tensors, storage_writer=writer, process_group=_async_group())
        else:
            dcp.save(tensors, storage_writer=writer)
    except (Exception, CheckpointException) as err:
        write.error = err
    return write


class ShardWrite:
    """A sharded checkpoint's write, started by :func:`start_shards`; :meth:`result` finishes it."""

    def __init__(self, path: Path, kept: str, shapes: dict, reference: bool):
        self.path, self.kept, self.shapes, self.reference = path, kept, shapes, reference
        self.future = None  # dcp.async_save's, when asynchronous
        self.error: BaseException | None = None

    def result(self) -> dict:
        """Every rank, together: waits for the write, then each rank's files' SHA-256 gathered, the
        folder fsync-ed and renamed to ``NAME.shards``; returns the checkpoint's ``"shards"`` entry.
        Raises :class:`CheckpointError` on every rank (the folder removed) when any rank's write failed."""
        from torch.distributed.checkpoint.api import CheckpointException

        from torchrl_agent.trainers.distributed import all_gather_object, barrier, get_rank, is_main_process

        final = shards_dir(self.path)
        tmp = final.with_name(final.name + ".tmp")
        try:
            if self.error is not None:
                raise self.error
            if self.future is not None:
                self.future.result()
            mine = {p.name: _sha256_file(p) for p in tmp.glob(f"__{get_rank()}_*")}
            if is_main_process():
                mine[".metadata"] = _sha256_file(tmp / ".metadata")
        except (Exception, CheckpointException) as err:  # (DCP's is a BaseException) as text: not every exception pickles
            rank, cause = get_rank(), err
            if isinstance(err, CheckpointException) and err.failures:  # the first failed rank's own error
                rank, (cause, _) = next(iter(sorted(err.failures.items(), key=lambda kv: kv[0])))
            text = str(cause).strip().splitlines()[0][:200] if str(cause).strip() else ""
            mine = f"rank {rank}: {type(cause).__name__}: {text}"
        parts = all_gather_object(mine)
        failed = next((p for p in parts if isinstance(p, str)), None)
        kept = f"; {self.kept}" if self.kept else ""
        if failed is not None:
            if is_main_process():
                shutil.rmtree(tmp, ignore_errors=True)
            try:
                free = f"{_free_bytes(self.path.parent) / 1e6:.1f} MB free in {self.path.parent}"
            except OSError:
                free = f"free space of {self.path.parent} unknown"
            raise CheckpointError(f"writing {final} failed ({failed}); {free} (disk full?){kept}")
        files = dict(sorted({k: v for part in parts for k, v in part.items()}.items()))
        if is_main_process():
            fsync_path(tmp)
            old = final.with_name(final.name + ".old")
            if final.exists():  # the same name again (last.shards): the new folder replaces it
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            fsync_path(final.parent)
        barrier()
        return {"dir": final.name, "files": files, "model_shapes": self.shapes, "reference": self.reference}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: only DCP's own metadata classes, ``torch.Size``, dtypes,
    layouts and paths are let through; any other global is refused, so reading it runs no code."""

    ALLOWED = {("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a checkpoint's shard metadata")


def _read_metadata(folder: Path):
    with open(folder / ".metadata", "rb") as f:
        return _MetadataUnpickler(f).load()


def _reader(folder: Path):
    """A ``FileSystemReader`` of ``folder`` whose ``.metadata`` is read by :class:`_MetadataUnpickler`
    (DCP reads the shards' non-tensor entries with ``torch.load(weights_only=True)`` itself)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = _read_metadata(folder)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(folder)


def _check_shards(path: Path, shards: dict) -> str | None:
    """Why the shards of checkpoint ``path`` cannot be used (``None``: every file is there, as written)."""
    folder = path.parent / shards["dir"]
    if not folder.is_dir():
        return f"its shards folder {folder.name} is missing"
    for name, want in shards["files"].items():
        if not (folder / name).is_file():
            return f"shard {folder.name}/{name} is missing"
        if _sha256_file(folder / name) != want:
            return f"shard {folder.name}/{name} does not match its checksum (changed after it was written)"
    try:
        _read_metadata(folder)
    except Exception as err:
        return f"shard metadata {folder.name}/.metadata refused ({type(err).__name__}: {err})"
    return None


@contextlib.contextmanager
def _single_process_quiet():
    """Without DCP's warning on every load without a process group (the one-process load meant here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path, shards: dict,
                reference: torch.nn.Module | None = None) -> None:
    """Every rank (or a single process): the weights and optimizer state of sharded checkpoint
    ``path`` (its ``"shards"`` entry, verified by :func:`read_checkpoint`) into ``model`` and
    ``optimizer`` (and its KL reference into ``reference``, when given and the checkpoint holds one),
    resharded to this world size by DCP (each rank reads the parts it holds)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    model_state, optimizer_state = get_state_dict(model, optimizer)  # the tensors DCP loads into, in place
    state = {"model": model_state, "optimizer": optimizer_state}
    with_reference = reference is not None and shards.get("reference", False)
    if with_reference:
        state["reference"] = get_model_state_dict(reference)
    with _single_process_quiet():
        dcp.load(state, storage_reader=_reader(Path(path).parent / shards["dir"]),
                 no_dist=not torch.distributed.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if with_reference:
        set_model_state_dict(reference, state["reference"])


def read_weights(path: str | Path, state: dict | None = None) -> dict[str, torch.Tensor]:
    """The full weights (``name -> tensor``, CPU) of checkpoint ``path`` (its verified ``state``;
    read now when ``None``) in one process, whatever its format: a sharded checkpoint's shards are
    assembled (DCP, no process group). For evaluation and conversion."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    state = read_checkpoint(path) if state is None else state
    if "shards" not in state:
        return state["model"]
    folder = Path(path).parent / state["shards"]["dir"]
    metadata = _read_metadata(folder)
    weights = {k[len("model."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
               for k, m in metadata.state_dict_metadata.items()
               if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    loaded = {"model": dict(weights)}
    with _single_process_quiet():
        dcp.load(loaded, storage_reader=_reader(folder), no_dist=True)
    return loaded["model"]


def model_shapes(state: dict) -> dict[str, list[int]]:
    """``name -> shape`` of a checkpoint's weights (either format), for :func:`check_model_state`."""
    if "shards" in state:
        return state["shards"]["model_shapes"]
    return {k: list(v.shape) for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


def save_weights(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path, *,
                 kept: str = "", reference: torch.nn.Module | None = None) -> dict:
    """Every rank: the entries of checkpoint ``path`` that hold the weights and the optimizer state,
    and ``reference``'s weights when given (the KL reference, when it is not the model that
    ``model.name`` loads: the warm-started policy). Under torchrun ``{"shards": ...}``: each rank has
    written its own shards (:func:`write_shards`), nothing is gathered. In a single process
    ``{"model", "optimizer"[, "reference"]}``: the full state, for :func:`write_checkpoint`'s one
    file. Raises :class:`CheckpointError` for NaN/inf weights."""
    from torchrl_agent.trainers.distributed import full_optimizer_state_dict, full_state_dict, is_distributed

    if is_distributed():
        return {"shards": write_shards(model, optimizer, path, kept=kept, reference=reference)}
    model_state = full_state_dict(model)
    bad = [k for k, v in model_state.items() if torch.is_tensor(v) and v.is_floating_point()
           and not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"not writing {path}: {len(bad)} weight tensors hold NaN/inf (first: {bad[0]}); the "
                              f"training diverged (lower algorithm.lr, kl_coef or entropy_coef)"
                              + (f"; {kept}" if kept else ""))
    weights = {"model": model_state, "optimizer": full_optimizer_state_dict(model, optimizer)}
    if reference is not None:
        weights["reference"] = full_state_dict(reference)
    return weights


def load_weights(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path, state: dict,
                 reference: torch.nn.Module | None = None) -> bool:
    """Every rank: the weights and optimizer state of checkpoint ``path`` (``state``: its verified
    state on rank 0, ``{}`` on the others) into ``model`` and ``optimizer``, whatever the number of
    ranks it was written on: shards through DCP (:func:`load_shards`), a one-file checkpoint
    broadcast from rank 0. With ``reference``: the checkpoint's KL reference into it, when it holds
    one. Returns whether it did (on every rank)."""
    from torchrl_agent.trainers.distributed import (
        broadcast_object,
        is_distributed,
        load_full_optimizer_state_dict,
        load_full_state_dict,
    )

    shards = state.get("shards")
    has_reference = "reference" in state or bool(shards and shards.get("reference"))
    if is_distributed():
        shards, has_reference = broadcast_object((shards, has_reference))
    if shards is not None:
        load_shards(model, optimizer, path, shards, reference)
        return reference is not None and has_reference
    load_full_state_dict(model, state.get("model", {}))
    load_full_optimizer_state_dict(model, optimizer, state.get("optimizer", {}))
    if reference is not None and has_reference:
        load_full_state_dict(reference, state.get("reference", {}))
    return reference is not None and has_reference


def remove_unfinished(folder: str | Path) -> list[Path]:
    """Remove what a killed writer left in checkpoint ``folder``: ``*.tmp`` files and folders, and
    a ``NAME.shards`` (or ``.shards.old``) with no ``NAME.pt`` (killed between the two renames).
    Returns the removed paths."""
    folder = Path(folder)
    removed = []
    for p in sorted(folder.glob("*.tmp")) + sorted(folder.glob("*.shards.old")) + [
            p for p in sorted(folder.glob("*.shards")) if not p.with_suffix(".pt").exists()]:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


# ----------------------------------------------------------------------------------- the same experiment
#: config keys (a section stands for all its keys) that make the experiment: ``resume=`` with
#: another value is refused, unless ``resume_allow_changes`` names the key
RESUME_IDENTITY = ("env", "model", "memory", "algorithm", "rollout.max_new_tokens", "rollout.temperature", "seed")
#: keys inside :data:`RESUME_IDENTITY` that may change on resume (how fast, not what is learned);
#: every key outside it may change too. Each change is listed in the run log.
RESUME_MAY_CHANGE = ("env.num_workers", "model.gradient_checkpointing", "algorithm.lr", "algorithm.lr_warmup_ratio",
                     "algorithm.lr_schedule", "algorithm.min_lr_ratio", "algorithm.micro_batch_tokens",
                     "algorithm.logprob_chunk_tokens", "algorithm.max_skipped_steps")
_NOT_COMPARED = ("resume", "resume_allow_changes", "run_dir")


def _flatten(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _under(key: str, names) -> bool:
    """Whether ``key`` is one of ``names`` or inside one of them (``env`` holds ``env.name``)."""
    return any(key == n or key.startswith(n + ".") for n in names)


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def _compared(key: str, old: dict, new: dict) -> bool:
    """Both configs have ``key``, or one has a value above it (``env.kwargs`` ``{}`` against
    ``env.kwargs.level``); a key of one schema version only is not compared."""
    parts = key.split(".")
    above = {".".join(parts[:i]) for i in range(1, len(parts))}
    return (key in old and key in new) or bool(above & (old.keys() | new.keys()))


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_resume_config(saved: dict | None, current: dict, path: str | Path) -> dict[str, tuple]:
    """Refuse (:class:`CheckpointLoadError`, one line naming the keys) to continue checkpoint
    ``path``, written with config ``saved``, under ``current`` (both ``dataclasses.asdict`` of a
    ``TrainConfig``) when a key of :data:`RESUME_IDENTITY` changed (another env, algorithm, model,
    group layout, memory or seed), except the :data:`RESUME_MAY_CHANGE` ones and those that
    ``current["resume_allow_changes"]`` names (``all``: every key). Returns ``key -> (saved,
    current)`` of the changes allowed, and logs them. Keys only one side has (another version's
    schema) are not compared."""
    if not saved:
        logger.warning("resume: checkpoint %s holds no config: whether it is the same experiment is not checked", path)
        return {}
    allow = list(current.get("resume_allow_changes") or [])
    old, new = _flatten(saved), _flatten(current)
    changed = {k: (old.get(k, _ABSENT), new.get(k, _ABSENT)) for k in {**old, **new}
               if _compared(k, old, new) and old.get(k, _ABSENT) != new.get(k, _ABSENT) and not _under(k, _NOT_COMPARED)}
    changed = dict(sorted(changed.items()))
    refused = [k for k in changed if _under(k, RESUME_IDENTITY) and not _under(k, RESUME_MAY_CHANGE)
               and "all" not in allow and not _under(k, allow)]
    if refused:
        listed = ", ".join(f"{k} ({_short(changed[k][0])} -> {_short(changed[k][1])})" for k in refused)
        raise CheckpointLoadError(
            f"resume: checkpoint {path} is of another experiment: {listed}; continue it with its own values, "
            f"start a new run_dir, or (experts) pass resume_allow_changes=[{','.join(refused)}]")
    if changed:
        logger.info("resume: changed since checkpoint %s: %s", path,
                       ", ".join(f"{k} {_short(a)} -> {_short(b)}" for k, (a, b) in changed.items()))
    return changed


# ----------------------------------------------------------------------------------- retention
def prune_checkpoints(folder: str | Path, keep: int, scores: dict[int, float]) -> list[Path]:
    """Remove the periodic checkpoints (``iteration_N.pt``, and ``iteration_N.shards``) of ``folder`` but the newest ``keep``
    and the best one by ``scores`` (``N -> held-out success of checkpoint N's weights``; ties: the
    newest). ``last.pt`` and other names are never removed; ``keep <= 0`` removes nothing.
    Returns the removed paths."""
    found = sorted((int(m.group(1)), p) for p in Path(folder).glob("iteration_*.pt")
                   if (m := _ITERATION_NAME.search(p.name)))
    if keep <= 0 or len(found) <= keep:
        return []
    kept = {it for it, _ in found[-keep:]}
    scored = [(scores[it], it) for it, _ in found if scores.get(it) is not None]
    if scored:
        kept.add(max(scored)[1])
    removed = [p for it, p in found if it not in kept]
    for p in removed:
        p.unlink(missing_ok=True)
        shutil.rmtree(shards_dir(p), ignore_errors=True)  # a sharded checkpoint's folder
    if removed:
        logger.info("checkpoint_keep=%d: removed %s", keep, ", ".join(p.name for p in removed))
    return removed


# ----------------------------------------------------------------------------------- which checkpoint
def _candidates(folder: Path) -> list[tuple[int, int, Path]]:
    """``(iteration, tie-break, path)`` of every ``*.pt`` under ``folder`` and ``folder/checkpoints``.

    The iteration is read from the name (``iteration_00012.pt``) or, for another name (``last.pt``),
    from the file (memory-mapped, so its tensors are not read); ``-1`` when it cannot be read."""
    found = []
    for d in (folder, folder / "checkpoints"):
        if not d.is_dir():
            continue
        for p in d.glob("*.pt"):
            if not p.is_file():
                continue
            match = _ITERATION_NAME.search(p.name)
            if match:
                found.append((int(match.group(1)), 0, p))
                continue
            iteration = -1
            if _problem(p) is None:
                try:
                    iteration = int(torch.load(p, map_location="cpu", weights_only=True, mmap=True)["iteration"])
                except Exception:
                    iteration = -1
            found.append((iteration, 1 if p.name == "last.pt" else 0, p))
    return sorted(found, key=lambda t: (t[0], t[1], t[2].name), reverse=True)


def find_resumable(folder: str | Path) -> tuple[Path | None, dict | None, list[tuple[Path, str]]]:
    """The newest checkpoint (by iteration, not file time) under ``folder`` or ``folder/checkpoints``
    that reads and verifies: ``(path, state, skipped)``, where ``skipped`` lists ``(path, reason)``
    of each newer one that did not. ``(None, None, skipped)`` when none does."""
    skipped: list[tuple[Path, str]] = []
    for _, _, path in _candidates(Path(folder)):
        try:
            return path, read_checkpoint(path), skipped
        except CheckpointLoadError as err:
            skipped.append((path, str(err).split(": ", 1)[-1]))
    return None, None, skipped


def resolve_resume(resume: str | None, run_dir: str | Path | None) -> tuple[Path | None, dict | None]:
    """The checkpoint ``resume=`` means and its verified state: a checkpoint file (it must verify),
    a run directory (its newest checkpoint that verifies) or ``auto`` (the same in ``run_dir``;
    ``(None, None)`` when it holds no checkpoint file at all). Skipped checkpoints are logged with
    their reasons; raises :class:`CheckpointLoadError` when no checkpoint can be used."""
    if resume is None:
        return None, None
    if resume == "auto":
        if run_dir is None:
            raise CheckpointLoadError("resume=auto needs run_dir= (the run directory to continue)")
        folder = Path(run_dir)
    else:
        folder = Path(resume)
        if folder.is_file() or not folder.exists():
            if not folder.exists():
                raise CheckpointLoadError(f"resume={resume}: no such file or directory")
            return folder, read_checkpoint(folder)
    path, state, skipped = find_resumable(folder)
    for bad, reason in skipped:
        logger.warning("resume: skipped checkpoint %s: %s", bad, reason)
    if path is None and skipped:
        raise CheckpointLoadError(
            f"resume={resume}: none of the {len(skipped)} checkpoint(s) in {folder} can be used (newest: "
            f"{skipped[0][0].name}: {skipped[0][1]}); pass resume=FILE of a good one, or choose another run_dir")
    if path is None and resume != "auto":
        raise CheckpointLoadError(f"resume={resume}: no checkpoint (*.pt) in {folder} or {folder / 'checkpoints'}")
    if path is not None and skipped:
        logger.warning("resume: continuing from %s (iteration %d), the newest checkpoint that verifies",
                       path, state["iteration"])
    return path, state


# ----------------------------------------------------------------------------------- convert
def _convert_state(old: dict) -> dict:
    """An older checkpoint's state in this format: numpy RNG state as plain values, the rest made plain."""
    state = dict(old)
    rng = dict(state.get("rng") or {})
    if isinstance(rng.get("numpy"), tuple):
        rng["numpy"] = plain_numpy_state(rng["numpy"])
    if rng:
        state["rng"] = rng
    if "evals" in state:
        state["evals"] = [list(e) for e in state["evals"]]
    return state


def convert(old: str | Path, new: str | Path) -> Path:
    """Convert a *trusted* older checkpoint (pickled, read with ``weights_only=False``: this runs any
    code the file holds) into this format, verified by reading it back."""
    old, new = Path(old), Path(new)
    if new.exists():
        raise FileExistsError(f"{new} exists: choose another name")
    state = torch.load(old, map_location="cpu", weights_only=False)
    if not isinstance(state, dict):
        raise ValueError(f"{old}: not a checkpoint (a {type(state).__name__}, expected a dict)")
    write_checkpoint(_convert_state(state), new)
    read_checkpoint(new)
    return new


def export_hf(path: str | Path, out: str | Path) -> Path:
    """The weights of checkpoint ``path`` (either format, verified; a sharded one assembled in one
    process) as a Hugging Face folder ``out`` for serving: ``model.safetensors`` (no pickle), the
    model's ``config.json`` and its tokenizer, for the ``model`` config the checkpoint was trained
    with. A LoRA run's checkpoint (adapter weights over a base model) is refused."""
    from torchrl_agent.models import load_model
    from torchrl_agent.trainers.config import ModelConfig

    path, out = Path(path), Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: choose another folder")
    state = read_checkpoint(path)
    model_cfg = dict((state.get("config") or {}).get("model") or {})
    if not model_cfg:
        raise CheckpointLoadError(f"checkpoint {path} holds no model config: which model it trained is unknown")
    if model_cfg.get("lora_rank", 0) > 0:
        raise CheckpointLoadError(f"checkpoint {path} is of a LoRA run (model.lora_rank={model_cfg['lora_rank']}): "
                                  "exporting adapters over their base model is not supported")
    known = {f for f in ModelConfig.__dataclass_fields__}
    model, tokenizer = load_model(ModelConfig(**{k: v for k, v in model_cfg.items() if k in known}),
                                  dtype=torch.float32)
    check_model_state(model_shapes(state), {k: v.shape for k, v in model.state_dict().items()}, path,
                      state.get("config"))
    model.load_state_dict(read_weights(path, state))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchrl_agent.trainers.checkpointing",
                                     description="Check or convert torchrl-agent checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="convert a TRUSTED older (pickled) checkpoint: loading it runs its code")
    c.add_argument("old")
    c.add_argument("new")
    v = sub.add_parser("verify", help="read and verify checkpoints (no code runs)")
    v.add_argument("paths", nargs="+")
    e = sub.add_parser("export", help="the weights as a Hugging Face folder (safetensors), either format")
    e.add_argument("checkpoint")
    e.add_argument("out")
    args = parser.parse_args(argv)
    if args.command == "export":
        try:
            print(f"exported {args.checkpoint} -> {export_hf(args.checkpoint, args.out)}")
        except (OSError, CheckpointLoadError) as err:
            print(f"export: {err}", file=sys.stderr)
            return 1
        return 0
    if args.command == "convert":
        try:
            print(f"converted {args.old} -> {convert(args.old, args.new)}")
        except (OSError, ValueError, CheckpointError, pickle.UnpicklingError, RuntimeError) as err:
            print(f"convert: {err}", file=sys.stderr)
            return 1
        return 0
    code = 0
    for p in args.paths:
        try:
            state = read_checkpoint(p)
            print(f"{p}: ok, iteration {state.get('iteration')}")
        except CheckpointLoadError as err:
            print(err, file=sys.stderr)
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())


"""Checkpoint save and load at scale: the full state gathered on rank 0 (one file) against the
sharded format (torch.distributed.checkpoint: each rank writes and reads its own shards).

N ranks (gloo on CPU, forked with the environment torchrun gives them) hold an FSDP2-sharded MLP
of ``layers`` square ``Linear(hidden, hidden)`` layers (each layer its own FSDP group, as
``shard_model`` does with decoder layers) and its AdamW state (fp32 weights + 2 moments: 12 bytes
per parameter). For each model size and each format, what the Trainer does:

- ``full``: ``full_state_dict`` + ``full_optimizer_state_dict`` (every rank gathers, rank 0 holds
  the whole state) and rank 0's ``write_checkpoint`` (checksum, one file, fsync, rename); loading:
  rank 0 ``read_checkpoint`` (the checksum over the whole state), then ``load_weights`` (broadcast
  from rank 0, each rank keeps its shard);
- ``sharded``: ``save_weights`` (each rank writes its shards, fsync, rename; their SHA-256 into
  rank 0's small file); loading: rank 0 ``read_checkpoint`` (every shard's digest, read from disk),
  then ``load_weights`` (each rank reads the parts it holds).

Measured: seconds (the slowest rank, between barriers) and rank 0's peak resident memory above
what it held before (its RSS sampled every 2 ms, after ``malloc_trim``), the sizes on disk, and
full / sharded ratios (``null`` where the sharded figure is 0).
Prints one JSON object as its LAST line::

    python benchmarks/checkpoint_scale.py                        # 2 ranks, 2 sizes: 4.2M, 16.8M parameters
    python benchmarks/checkpoint_scale.py --ranks 4 --sizes 2048x16
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed.checkpoint.state_dict  # noqa: E402,F401  (imported once, before the ranks are forked)
import torch.distributed.fsdp  # noqa: E402,F401
from torch import nn  # noqa: E402

from torchrl_agent.trainers import checkpointing as ckpt  # noqa: E402
from torchrl_agent.trainers import distributed as D  # noqa: E402

_LIBC = ctypes.CDLL("libc.so.6")


class PeakRSS:
    """The peak resident memory (MB) of this process above its level at start, sampled every 2 ms
    (glibc's free memory returned with ``malloc_trim`` first, so a reuse of it cannot hide a peak)."""

    def __enter__(self):
        _LIBC.malloc_trim(0)  # memory freed earlier back to the system: the next allocations show in the RSS
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.mb = (self.peak - self.base) / 2**20

    def _poll(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed(fn, *args) -> tuple[float, float]:
    """(seconds of the slowest rank, rank 0's peak MB) of ``fn(*args)`` run by every rank between barriers."""
    D.barrier()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        fn(*args)
        D.barrier()
        seconds = time.perf_counter() - t0
    return max(D.all_gather_object(seconds)), mem.mb


def _model(hidden: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, hidden)).sum().backward()
    optimizer.step()  # the optimizer's moments exist
    optimizer.zero_grad()
    return model, optimizer


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _save(model, optimizer, path: Path, fmt: str) -> None:
    """A checkpoint of ``model`` and ``optimizer`` at ``path`` in format ``fmt`` (every rank calls it)."""
    if fmt == "full":  # every rank gathers, rank 0 holds the whole state and writes one file
        state = {"model": D.full_state_dict(model), "optimizer": D.full_optimizer_state_dict(model, optimizer)}
    else:  # each rank writes its shards
        state = ckpt.save_weights(model, optimizer, path)
    if D.is_main_process():
        ckpt.write_checkpoint({**state, "iteration": 0}, path)


def _load(model, optimizer, path: Path) -> None:
    """Rank 0 reads and verifies the checkpoint; every rank loads its part (either format)."""
    ckpt.load_weights(model, optimizer, path, ckpt.read_checkpoint(path) if D.is_main_process() else {})


def _measure(hidden: int, layers: int, folder: Path) -> dict:
    model, optimizer = _model(hidden, layers)
    main = D.is_main_process()
    parameters = sum(p.numel() for p in model.parameters())
    # the whole state: fp32 weights and AdamW's two moments (what the full format gathers on rank 0)
    out = {"hidden": hidden, "layers": layers, "parameters": parameters, "state_mb": round(12 * parameters / 2**20, 1)}
    for fmt in ("sharded", "full"):  # sharded first: pages the full format frees and keeps cannot hide its peak
        where = folder / fmt
        path = where / "iteration_00000.pt"
        if main:
            where.mkdir(parents=True, exist_ok=True)

        save_s, save_mb = _timed(_save, model, optimizer, path, fmt)
        load_s, load_mb = _timed(_load, model, optimizer, path)
        out[fmt] = {"save_s": round(save_s, 3), "load_s": round(load_s, 3), "rank0_save_peak_mb": round(save_mb, 1),
                    "rank0_load_peak_mb": round(load_mb, 1), "disk_mb": round(_size(where) / 2**20, 1),
                    "rank0_file_mb": round(path.stat().st_size / 2**20, 3) if main else None}
        D.barrier()
        if main:
            shutil.rmtree(where)
    f, s = out["full"], out["sharded"]
    out["full_over_sharded"] = {k: round(f[k] / s[k], 2) if s[k] else None
                                for k in ("save_s", "load_s", "rank0_save_peak_mb", "rank0_load_peak_mb")}
    return out


def _rank(rank: int, world: int, port: int, sizes: list[tuple[int, int]], folder: str, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    D.init_distributed("cpu")
    results = [_measure(h, n, Path(folder) / f"{h}x{n}") for h, n in sizes]
    if rank == 0:
        queue.put(results)
    D.cleanup()


def run(world: int, sizes: list[tuple[int, int]], folder: Path) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, world, port, sizes, str(folder), queue)) for r in range(world)]
    for p in ranks:
        p.start()
    results = queue.get(timeout=3600)
    for p in ranks:
        p.join()
    if any(p.exitcode for p in ranks):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in ranks]}")
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--sizes", nargs="+", default=["1024x4", "2048x4"], help="HIDDENxLAYERS")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary folder)")
    args = parser.parse_args(argv)
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes]
    folder = Path(args.dir or tempfile.mkdtemp(prefix="checkpoint_scale_"))
    out = {"benchmark": "checkpoint_scale", "torch": torch.__version__, "cpu_threads_per_rank": 1, "runs": []}
    try:
        for world in args.ranks:
            for result in run(world, sizes, folder / f"ranks{world}"):
                out["runs"].append({"ranks": world, **result})
                print(json.dumps(out["runs"][-1]), flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()

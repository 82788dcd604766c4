"""Sharded checkpoints (torch.distributed.checkpoint) under FSDP2: each rank writes its own shards,
nothing gathered; a checkpoint of 2 ranks resumes in 1 process and on 4 ranks, one of 1 process on
2 ranks, and all continue with the same steps as an uninterrupted single-process run; a changed
shard or a shard metadata that would run code is refused; a write that fails on one rank raises on
every rank and leaves nothing; retention and a killed writer's leftovers; an asynchronous write holds the state of when it started.

The worker halves (``worker``, ``worker_4``) run on 2 and 4 ranks (gloo on CPU) forked by the
``launch`` fixture with the environment torchrun gives them (torch imported once); ``worker`` by
hand: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/test_checkpoint_shards.py OUT``."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import resource
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.state_dict  # noqa: F401  (imported once, before the ranks are forked)
import torch.distributed.fsdp  # noqa: F401
from torch import nn

from torchrl_agent.trainers.checkpointing import (
    CheckpointError,
    CheckpointLoadError,
    load_weights,
    prune_checkpoints,
    read_checkpoint,
    read_weights,
    remove_unfinished,
    save_weights,
    shards_dir,
    start_shards,
    write_checkpoint,
)

STEPS = 3  # steps 0..2; the checkpoints come after step 0 (single process) and step 1 (2 ranks)


def _model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A small MLP (seed 0) and its fixed batch: 8 rows, halves per rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(STEPS, 8, 6, generator=g), torch.randn(STEPS, 8, 3, generator=g)


def _step(model, optimizer, x, y) -> None:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()  # each rank its half: FSDP2 averages the gradients
    optimizer.step()


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _reference(seed: int = 7) -> nn.Module:
    """A frozen KL reference that is not the model's initial weights (the warm-started policy, in a run)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).requires_grad_(False)


def _save(model, optimizer, path: Path, iteration: int, reference=None) -> None:
    """What the trainer's checkpointer does: every rank :func:`save_weights`, rank 0 the file."""
    from torchrl_agent.trainers.distributed import is_main_process

    state = save_weights(model, optimizer, path, reference=reference)
    if is_main_process():
        write_checkpoint({**state, "iteration": iteration}, path)


def worker(out: str) -> None:
    """Each of 2 ranks: resume the single-process checkpoint (step 0), step 1, a sharded checkpoint,
    step 2, the full weights to OUT/rank0_final.pt."""
    from torchrl_agent.trainers.distributed import full_weights, get_rank, init_distributed, shard_model

    out = Path(out)
    rank, world, _ = init_distributed("cpu")
    model, x, y = _model()
    model = shard_model(model)
    optimizer = _optimizer(model)
    reference = shard_model(_reference(seed=3))  # other weights: the checkpoint's must replace them
    path = out / "single" / "iteration_00000.pt"
    assert load_weights(model, optimizer, path, read_checkpoint(path) if rank == 0 else {}, reference)
    half = slice(4 * rank, 4 * rank + 4)
    _step(model, optimizer, x[1, half], y[1, half])
    _save(model, optimizer, out / "dist" / "iteration_00001.pt", 1, reference)
    # rank 1's disk "full" (a file-size limit: EFBIG) for the next checkpoint: every rank raises
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limits[1]))
    try:
        _save(model, optimizer, out / "dist" / "iteration_00002.pt", 2)
        (out / f"rank{rank}_error.txt").write_text("")
    except CheckpointError as err:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        (out / f"rank{rank}_error.txt").write_text(str(err))
    # an asynchronous write (checkpoint_async): started before step 2, finished after it
    path = out / "async" / "iteration_00001.pt"
    write = start_shards(model, optimizer, path, asynchronous=True)
    _step(model, optimizer, x[2, half], y[2, half])
    shards = write.result()
    if rank == 0:
        write_checkpoint({"shards": shards, "iteration": 1}, path)
    weights, reference_weights = full_weights(model), full_weights(reference)
    if get_rank() == 0:
        torch.save(weights, out / "rank0_final.pt")
        torch.save(reference_weights, out / "rank0_reference.pt")
    torch.distributed.destroy_process_group()


def worker_4(out: str) -> None:
    """Each of 4 ranks: resume the 2 ranks' sharded checkpoint (step 1), step 2 (a quarter of the
    batch each), the full weights to OUT/rank0_final_4.pt."""
    from torchrl_agent.trainers.distributed import full_weights, get_rank, init_distributed, shard_model

    out = Path(out)
    rank, _, _ = init_distributed("cpu")
    model, x, y = _model()
    model = shard_model(model)
    optimizer = _optimizer(model)
    reference = shard_model(_reference(seed=3))
    path = out / "dist" / "iteration_00001.pt"
    assert load_weights(model, optimizer, path, read_checkpoint(path) if rank == 0 else {}, reference)
    _step(model, optimizer, x[2, 2 * rank:2 * rank + 2], y[2, 2 * rank:2 * rank + 2])
    weights, reference_weights = full_weights(model), full_weights(reference)
    if get_rank() == 0:
        torch.save(weights, out / "rank0_final_4.pt")
        torch.save(reference_weights, out / "rank0_reference_4.pt")
    torch.distributed.destroy_process_group()


def _rank(target, rank: int, world: int, port: int, out: str) -> None:
    """One of ``world`` ranks, as torchrun would start it (its environment), then ``target(out)``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    target(out)


def _launch(target, world: int, out: Path) -> None:
    with socket.socket() as sock:  # a free port for the ranks' rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("fork")  # forked from this process: torch is imported once
    ranks = [ctx.Process(target=_rank, args=(target, rank, world, port, str(out))) for rank in range(world)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)
    assert [p.exitcode for p in ranks] == [0] * world


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """A single-process run of the 3 steps (a checkpoint after step 0, the weights after each step),
    then the 2-rank worker resuming that checkpoint, then 4 ranks resuming the 2 ranks' one."""
    out = tmp_path_factory.mktemp("shards")
    model, x, y = _model()
    optimizer = _optimizer(model)
    steps = []
    for i in range(STEPS):
        _step(model, optimizer, x[i], y[i])
        steps.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if i == 0:
            _save(model, optimizer, out / "single" / "iteration_00000.pt", 0, _reference())
    _launch(worker, 2, out)
    _launch(worker_4, 4, out)
    return out, steps


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_each_rank_writes_its_shards_and_a_2_rank_checkpoint_resumes_in_one_process(launch):
    out, steps = launch
    path = out / "dist" / "iteration_00001.pt"
    state = read_checkpoint(path)  # the checksum, then every shard's digest
    assert "model" not in state and "optimizer" not in state  # nothing gathered into rank 0's file
    files = set(state["shards"]["files"])
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= files
    assert {p.name for p in shards_dir(path).iterdir()} == files
    assert not list((out / "dist").glob("*.tmp"))
    assert state["shards"]["model_shapes"]["0.weight"] == [16, 6] and state["shards"]["reference"]
    _close(read_weights(path, state), steps[1])  # the full weights (not the reference's), assembled in one process
    # resume in one process: the next step is the one the uninterrupted run took
    model, x, y = _model()
    optimizer = _optimizer(model)
    load_weights(model, optimizer, path, state)
    _close(model.state_dict(), steps[1])
    _step(model, optimizer, x[2], y[2])
    _close(model.state_dict(), steps[2])


def test_a_single_process_checkpoint_resumes_on_2_ranks_and_a_2_rank_one_on_4_and_continue_the_same(launch):
    out, steps = launch  # the 2 ranks resumed step 0's one-file checkpoint, took steps 1 and 2
    _close(torch.load(out / "rank0_final.pt", weights_only=True), steps[2])
    # 4 ranks resumed the 2 ranks' shards (each reading the parts it holds), took step 2
    _close(torch.load(out / "rank0_final_4.pt", weights_only=True), steps[2])
    # the KL reference (not the model's initial weights) came with each checkpoint: 1 -> 2 ranks, 2 -> 4
    for name in ("rank0_reference.pt", "rank0_reference_4.pt"):
        _close(torch.load(out / name, weights_only=True), _reference().state_dict())
    model, x, y = _model()  # a checkpoint without a reference leaves the given one as it was
    plain = out / "plain.pt"
    _save(model, _optimizer(model), plain, 0)
    reference = _reference(seed=3)
    assert not load_weights(model, _optimizer(model), plain, read_checkpoint(plain), reference)
    _close(reference.state_dict(), _reference(seed=3).state_dict())


def test_an_asynchronous_write_holds_the_state_when_it_started_while_training_goes_on(launch):
    out, steps = launch  # started after step 1, finished after step 2 was taken
    path = out / "async" / "iteration_00001.pt"
    _close(read_weights(path, read_checkpoint(path)), steps[1])
    assert not (out / "async" / "iteration_00001.shards.tmp").exists()


def test_a_failed_shard_write_on_one_rank_raises_on_every_rank_and_leaves_nothing(launch):
    out, _ = launch
    errors = [(out / f"rank{r}_error.txt").read_text() for r in range(2)]
    for text in errors:  # the same one line on both ranks: the rank, the cause, the intact checkpoint
        assert "iteration_00002.shards failed (rank 1: OSError: [Errno 27] File too large)" in text, text
    assert sorted(p.name for p in (out / "dist").iterdir()) == ["iteration_00001.pt", "iteration_00001.shards"]


def test_a_changed_shard_or_a_metadata_that_would_run_code_is_refused(launch, tmp_path):
    import shutil

    out, _ = launch
    src = out / "dist" / "iteration_00001.pt"
    path = tmp_path / "iteration_00001.pt"
    shutil.copy(src, path)
    shutil.copytree(shards_dir(src), shards_dir(path))
    shard = shards_dir(path) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointLoadError, match=r"__1_0.distcp does not match its checksum"):
        read_checkpoint(path)
    shard.unlink()
    with pytest.raises(CheckpointLoadError, match=r"__1_0.distcp is missing"):
        read_checkpoint(path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    shutil.rmtree(shards_dir(path))
    shutil.copytree(shards_dir(src), shards_dir(path))
    (shards_dir(path) / ".metadata").write_bytes(pickle.dumps(Evil()))
    state = read_checkpoint(src)  # re-signed with the new digest: only the unpickler stands in the way
    state["shards"]["files"][".metadata"] = __import__("hashlib").sha256(
        (shards_dir(path) / ".metadata").read_bytes()).hexdigest()
    write_checkpoint(state, path)
    with pytest.raises(CheckpointLoadError, match=r"\.metadata refused .*posix.system is not allowed"):
        read_checkpoint(path)
    assert not (tmp_path / "pwned").exists()


def test_retention_and_a_killed_writers_leftovers_remove_the_shard_folders(tmp_path):
    for it in range(4):
        (tmp_path / f"iteration_{it:05d}.pt").write_bytes(b"x")
        (tmp_path / f"iteration_{it:05d}.shards").mkdir()
    removed = prune_checkpoints(tmp_path, 2, {0: 0.9, 1: 0.1})
    assert [p.name for p in removed] == ["iteration_00001.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iteration_00000.pt", "iteration_00000.shards", "iteration_00002.pt", "iteration_00002.shards",
        "iteration_00003.pt", "iteration_00003.shards"]
    (tmp_path / "iteration_00004.shards.tmp").mkdir()  # killed in dcp.save
    (tmp_path / "iteration_00005.shards").mkdir()  # killed between the folder's rename and the file's
    (tmp_path / "iteration_00006.pt.tmp").write_bytes(b"x")
    assert sorted(p.name for p in remove_unfinished(tmp_path)) == [
        "iteration_00004.shards.tmp", "iteration_00005.shards", "iteration_00006.pt.tmp"]
    assert (tmp_path / "iteration_00003.shards").is_dir()


if __name__ == "__main__":
    worker(sys.argv[1])


def test_export_writes_a_hugging_face_folder_of_the_checkpoints_weights(tmp_path, tiny_path, capsys):
    """``python -m torchrl_agent.trainers.checkpointing export CKPT OUT``: safetensors (no pickle),
    the config and the tokenizer; the folder loads with transformers and holds the trained weights."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from torchrl_agent.models import load_model
    from torchrl_agent.trainers.checkpointing import main
    from torchrl_agent.trainers.config import ModelConfig

    model, _ = load_model(ModelConfig(), dtype=torch.float32)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # "trained": not the weights the model folder holds
    path = tmp_path / "last.pt"
    write_checkpoint({**save_weights(model, _optimizer(model), path), "iteration": 0,
                      "config": {"model": dataclasses.asdict(ModelConfig())}}, path)
    assert main(["export", str(path), str(tmp_path / "hf")]) == 0
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in names and "config.json" in names and not any(n.endswith((".bin", ".pt")) for n in names)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    _close(exported.state_dict(), model.state_dict())
    assert main(["export", str(path), str(tmp_path / "hf")]) == 1  # never over a folder in use
    assert "exists and is not empty" in capsys.readouterr().err

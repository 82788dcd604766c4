"""The worker half of the torchrun tests, run by conftest's ``torchrun_launch`` under ``python -m
torch.distributed.run --standalone --nproc_per_node 2 tests/torchrun_worker.py OUT MODEL``: each
rank runs tests/test_distributed.py's worker (FSDP2 steps, the Trainer) and then
tests/test_distributed_rollout.py's (a Trainer with a vLLM engine per rank) in one process group,
and writes what they hold into OUT for the tests to read."""

from __future__ import annotations

import importlib.util
import os
import sys

import test_distributed

from torchrl_agent.trainers.distributed import barrier, cleanup

if __name__ == "__main__":
    out, model_path = sys.argv[1], sys.argv[2]
    test_distributed.worker(os.path.join(out, "rank0.pt"), model_path)
    barrier()
    if importlib.util.find_spec("vllm") is not None:  # test_distributed_rollout.py is skipped without it
        import test_distributed_rollout

        test_distributed_rollout.worker(out, os.path.join(out, "colocated_run"))
        barrier()
    cleanup()

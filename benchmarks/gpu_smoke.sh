#!/usr/bin/env bash
# Training smoke + throughput of the shipped training step (Trainer.update under FSDP2: float32 master
# weights, bf16 compute, token-budget micro-batches, chunked log-probs, sharded KL reference; see
# benchmarks/gpu_smoke.py); the LAST line of its output is one JSON object (tokens/s for generation
# and training, MFU, memory).
#
#   benchmarks/gpu_smoke.sh                                   # CUDA: a Qwen2.5-0.5B-architecture model, bf16
#   benchmarks/gpu_smoke.sh --model /path/to/Qwen2.5-1.5B-Instruct --iterations 4
#   benchmarks/gpu_smoke.sh --cpu --dtype bfloat16            # the same path on CPU, tiny model and sizes
#   NPROC=2 benchmarks/gpu_smoke.sh --cpu                     # 2 CPU processes (gloo)
#
# Environment: NPROC (processes, default 1), PYTHON (default: .venv/bin/python if present, else
# python3), SMOKE_TIMEOUT (seconds, default 540: under a 10-minute device call). Wheels carried in
# .whl/ (see the device README) are installed into /tmp/site first when torchrl is not importable.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import torchrl, tensordict, transformers" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "gpu_smoke: installing carried wheels from .whl/ into /tmp/site" >&2
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "gpu_smoke: torchrl/tensordict/transformers are not importable and no .whl/ folder" >&2
        exit 2
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
fi
exec timeout "${SMOKE_TIMEOUT:-540}" "$PYTHON" -m torch.distributed.run --standalone \
    --nproc_per_node "${NPROC:-1}" benchmarks/gpu_smoke.py "$@"

#!/usr/bin/env bash
# GPU smoke + throughput at the ALFWorld recipe's shape (benchmarks/gpu_smoke.py): a random-weight
# Qwen2.5-1.5B-architecture model built from its config (no download, no vLLM), 256 prompts of about
# 1,500 tokens, up to 512 new tokens each with the transformers engine, then one training update
# (FSDP2, bf16 compute over float32 master weights, a KL reference) and the weight sync. The LAST
# line of its output is one JSON object: gen_tokens_per_s, train_tokens_per_s, mfu,
# peak_memory_gib, weight_sync_s. Made for one H200 in under 8 minutes. --vl: the same JSON for the
# VLM path (the tiny VLM, image observations, the Trainer's collection and update).
#
#   benchmarks/gpu_smoke.sh                                   # CUDA, the ALFWorld shape
#   benchmarks/gpu_smoke.sh --gradient-checkpointing          # the same with activation recomputation
#   benchmarks/gpu_smoke.sh --tiny                            # CPU, tiny model and shape (GPU_SMOKE_TINY=1 too)
#   NPROC=2 benchmarks/gpu_smoke.sh --tiny                    # 2 CPU processes (gloo)
#   benchmarks/gpu_smoke.sh --vl                              # CUDA, the VL shape: the tiny VLM trained on
#                                                             # Sokoban frames (81 image tokens, bf16; GPU_SMOKE_VL=1 too)
#   benchmarks/gpu_smoke.sh --vl --tiny                       # CPU, the VL shape at a tiny size
#
# Environment: NPROC (processes, default 1), PYTHON (default: .venv/bin/python if present, else
# python3), SMOKE_TIMEOUT (seconds, default 480: 8 minutes), GPU_SMOKE_TINY=1 (= --tiny). Wheels
# carried in .whl/ (see the device README) are installed into /tmp/site first when torchrl is not
# importable.
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
exec timeout "${SMOKE_TIMEOUT:-480}" "$PYTHON" -m torch.distributed.run --standalone \
    --nproc_per_node "${NPROC:-1}" benchmarks/gpu_smoke.py "$@"

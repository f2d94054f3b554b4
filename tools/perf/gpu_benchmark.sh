#!/usr/bin/env bash
# Run the same benchmark (tools/perf/run.py) on a machine with an NVIDIA GPU.
#
# NOT RUN YET: the development machine has no GPU (2 CPU cores only), so nothing below has been
# exercised; whoever runs it on a GPU host: add the resulting benchmarks/results/<date>-<host>-gpu.md
# to BENCHMARKS.md (section "GPU").
#
# What changes against the CPU run (same workloads, scenarios, perf_analyzer flags, baselines):
#   - the repository is built with --target gpu: Python models on KIND_GPU with
#     FORCE_CPU_ONLY_INPUT_TENSORS "no" (tensors stay on the GPU between models, DLPack), preprocessing
#     and stitching on the GPU through CuPy (install cupy-cuda12x into .venv first), fold networks traced
#     with CUDA autocast (--precision fp16, FP16 OUTPUT__0) and batched forwards (per_sample_forward off);
#   - the fold runner is the Python runner (torch.jit.load on cuda) because the embedded tritonserver
#     (pytriton 0.7.0) has no libtorch backend; see "libtorch" below for the NGC container;
#   - nnUNetPredictor and the monolith run with device cuda (perform_everything_on_device=True), the
#     network floor times the forwards on the GPU (torch.cuda.synchronize around each).
#
# Usage (from the repository root, after `make setup` and `pip install cupy-cuda12x`):
#   tools/perf/gpu_benchmark.sh                 # full benchmark, both workloads
#   QUICK=1 tools/perf/gpu_benchmark.sh         # fixture only
#   PRECISION=fp32 TILE_BATCH_SIZE=8 tools/perf/gpu_benchmark.sh
#
# libtorch instead of the Python runner (NGC container nvcr.io/nvidia/tritonserver:24.10-py3 = 2.51):
#   python -m repository.build --model build/perf/models/Dataset950_PerfCT/nnUNetTrainer__nnUNetPlans__3d_fullres \
#       --out build/perf/repos/realistic/gpu-libtorch --target gpu --fold-runner libtorch --precision fp16
#   docker run --gpus all --rm --shm-size=8g -p8000:8000 -p8001:8001 -p8002:8002 \
#       -v "$PWD:/workspace" -w /workspace nvcr.io/nvidia/tritonserver:24.10-py3 \
#       bash -c "pip install -e . cupy-cuda12x && tritonserver --model-repository=/workspace/build/perf/repos/realistic/gpu-libtorch"
#   then the perf_analyzer command lines printed in the CPU report's "Commands" section, with
#   -u localhost:8001 (gRPC) and the same --input-data files (benchmarks/results/<stem>/raw/<workload>/).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PY:-.venv/bin/python}"
PRECISION="${PRECISION:-fp16}"
TILE_BATCH_SIZE="${TILE_BATCH_SIZE:-4}"

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "error: no nvidia-smi: this script needs an NVIDIA GPU (the CPU benchmark is 'make perf')" >&2
    exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import cupy" 2>/dev/null || echo "warning: cupy is not installed; GPU preprocessing needs it" >&2

args=(--target gpu --device cuda --precision "$PRECISION" --tile-batch-size "$TILE_BATCH_SIZE"
      --stem "$(date +%F)-$(hostname)-gpu")
if [[ -n "${QUICK:-}" ]]; then
    args+=(--quick)
fi
exec "$PY" -m tools.perf.run "${args[@]}" "$@"

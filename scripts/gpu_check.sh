#!/usr/bin/env bash
# GPU check for any CUDA machine (nanospec installed or run in place), from the repo root:
#   bash scripts/gpu_check.sh [OUT_DIR]          (default: gpu_out; logs land there)
# 1. every kernel test compiled for real on CUDA (no Triton interpreter), against its torch reference;
# 2. CUDA graphs vs eager: identical tokens for plain decode, chain and tree speculation, fp32 and bf16;
# 3. bench.py: attention-kernel bandwidth, then the nano-vllm workload with the shipped assistant;
# 4. with 2+ GPUs, tensor parallelism (scripts/gpu_tp.py): tokens at TP=2 equal TP=1, decode tok/s TP2/TP1 on
#    the Gemma 4 31B shape with random weights.
# Steps 2 and 3 need the default model (fetched into the nanospec cache on first use; offline: docs/usage.md).
# Exit status: non-zero if any step failed.
set -uo pipefail
OUT=${1:-gpu_out}
mkdir -p "$OUT"
# the repo root on the path, so that scripts/*.py import nanospec without an install too (nanospec/__init__.py
# makes kernels/ nanospec.kernels; on the path the folder never becomes the top-level `kernels`, DESIGN §1)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
rc=0
step() {  # step NAME CMD...: run CMD, log to $OUT/NAME.txt, remember a failure
  echo "== $1"
  "${@:2}" 2>&1 | tee "$OUT/$1.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "== $1 FAILED"; rc=1; }
}
step gpu sh -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv &&
  python3 -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)"'
step kernel_tests env NANOSPEC_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_kernels_*.py
step graphs python3 scripts/gpu_graphs.py
step bench_kernels python3 scripts/kernel_bench.py
step bench python3 bench.py
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  step tp python3 scripts/gpu_tp.py
fi
exit $rc

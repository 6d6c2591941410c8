#!/usr/bin/env bash
# GPU check, part 1 (needs no model weights, ~2 min on one H200): every kernel test compiled for real on CUDA
# (no interpreter) and the attention-kernel bandwidth bench. Part 2, with the real model: scripts/gpu_train.sh.
# Usage on the GPU machine, from the repo root:  OUT=/some/dir bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
[ -e nanospec/kernels ] || ln -s ../kernels nanospec/kernels  # the package-dir mapping of an install, without one
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)"
} 2>&1 | tee "$OUT/gpu.txt"
NANOSPEC_TEST_DEVICE=cuda timeout "${KERNEL_TEST_S:-90}" python3 -m pytest -q -p no:cacheprovider \
  tests/test_kernels_attention.py tests/test_kernels_basic.py tests/test_kernels_sampling.py 2>&1 \
  | tail -n 40 | tee "$OUT/kernel_tests.txt"
timeout "${BENCH_S:-60}" python3 bench.py --kernels 2>&1 | tail -n 12 | tee "$OUT/bench_kernels.txt"

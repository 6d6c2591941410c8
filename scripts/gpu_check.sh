#!/usr/bin/env bash
# The prepared GPU check (one H200 run, ~8 minutes): kernels compiled for real, CUDA graphs vs eager, bench figures.
# Usage on the GPU machine, from the repo root:  OUT=/some/dir bash scripts/gpu_check.sh
# Needs torch + triton with CUDA and transformers >= 5.23 importable (PYTHONPATH=. is used, no install).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"

# 1. every kernel test with CUDA tensors (Triton compiled for real; no interpreter)
NANOSPEC_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -x tests/test_kernels_attention.py \
  tests/test_kernels_basic.py tests/test_kernels_sampling.py 2>&1 | tail -n 30 | tee "$OUT/kernel_tests.txt"

# 2. graphs on vs off: identical greedy tokens, plain decode and speculative (random assistant), bf16 and fp32
timeout 240 python3 scripts/gpu_graphs.py 2>&1 | tee "$OUT/graphs.txt"

# 3. figures: kernel bandwidth, batch-1 latency (with/without assistant), nano-vllm workload vs HF
B="timeout 300 python3 bench.py"
$B --kernels 2>&1 | tail -n 12 | tee "$OUT/bench_kernels.txt"
$B --shape smollm2-135m --batch-1 --num-seqs 8 --max-output-len 256 2>&1 | tail -n 2 | tee "$OUT/bench_b1.txt"
$B --workload sharegpt --batch-1 --num-seqs 8 --assistant default 2>&1 | tail -n 2 | tee "$OUT/bench_b1_spec.txt"
$B --shape qwen3-0.6b --compare-hf --hf-num-seqs 8 --hf-batch-size 8 2>&1 | tail -n 3 | tee "$OUT/bench_nanovllm.txt"

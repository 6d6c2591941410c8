#!/usr/bin/env bash
# The whole GPU run on one CUDA machine, from the repo root:   bash scripts/gpu_run.sh [OUT_DIR]   (default: gpu_out)
# At most 16 minutes with the defaults: every step runs under its own time limit (seconds; a step over it fails
# with rc 124 and keeps its log so far). Logs: OUT_DIR/<step>.txt; OUT_DIR/steps.txt: rc and seconds per step.
#   compile       every kernel specialization of scripts/kernel_specs.json compiled for this GPU on all cores:
#                 the fit / spill rules, and Triton's cache warm for the steps after it               [COMPILE_S 60]
#   gpu           the device; torch, triton, transformers versions                                      [GPU_S 20]
#   kernel_tests  every kernel test compiled for real on CUDA (no Triton interpreter)          [KERNEL_TESTS_S 100]
#   graphs        CUDA graphs vs eager: the same tokens (scripts/gpu_graphs.py)                       [GRAPHS_S 100]
#                 graph_memory: the memory plan and what capture took, at the defaults and Gemma 4 E2B's shape
#                                                                                              [GRAPH_MEMORY_S 120]
#   bench         bench.py: ShareGPT batch-1 latency with the shipped assistant (bench_batch1) and without
#                 (bench_batch1_plain), BENCH_S [40] each; the nano-vllm workload on Qwen3-0.6B's shape (random
#                 weights) with HF transformers on its first 16 requests in batches of HF_BATCH [16] (bench_qwen3,
#                 BENCH_QWEN3_S [60])
#   deterministic scripts/deterministic_check.py: 50 held-out ShareGPT prompts x 128 greedy tokens in bf16, spec
#                 on vs off and batch 1 vs 32, with LLM(deterministic=...) off and on: identical prompts, token-match
#                 rate, first divergences, and the mode's slowdown                                       [DET_S 240]
#   train         regenerate: the target answers ShareGPT train-split user turns (all turns, seeded order, those
#                 no shard in DATA answers yet) with nanospec, greedy then T = 0.7 and 1.0, for REGEN_MIN [1.25]
#                 minutes; the answers become a new shard in DATA before training starts (REGEN_MIN=0: none).
#                 Then train on every shard in DATA for TRAIN_MIN [1.25] minutes (bf16 autocast), warm-started
#                 from INIT -> OUT_DIR/assistant (saved every 30 s). Limit TRAIN_S [both budgets + 90 s: loading,
#                 tokenizing ~49k prompts, saving]
#   eval          acceptance of the new assistant (eval) and of the shipped one (eval_shipped, default target
#                 only) on the same held-out ShareGPT prompts: EVAL_PROMPTS [64], EVAL_TEMPS [0]; EVAL_S [60] each
# New shards are also copied to OUT_DIR/data/ (commit them under DATA). Exit status: non-zero if a step failed.
# More environment: STEPS ["compile gpu kernel_tests graphs bench deterministic train eval"]; TARGET [the default SmolLM2-135M-Instruct]
# model dir; DATA [data/<target dir name>]; INIT [default]: the assistant to start from ("default": the shipped
# one, "none": a fresh init); LR [1e-3 warm, 2e-3 fresh]; TRAIN_EXTRA: more trainer flags; BUNDLE: a folder of
# `python scripts/offline_bundle.py` parts, unpacked into the nanospec cache first (for a machine without network).
# DRY_RUN=1: the same plumbing on CPU in seconds: STEPS "train eval", 2 prompts, 8 new tokens, a 200-token
# training run, 1 eval prompt; DATA [OUT_DIR/data_dry].
set -uo pipefail
OUT=${1:-gpu_out}
mkdir -p "$OUT/data"
# the repo root on the path, so that scripts/*.py import nanospec without an install too (nanospec/__init__.py
# makes kernels/ nanospec.kernels; on the path the folder never becomes the top-level `kernels`, DESIGN §1)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
unset TRITON_INTERPRET
if [ -n "${BUNDLE:-}" ]; then
  C=${NANOSPEC_CACHE:-$HOME/.cache/nanospec}; mkdir -p "$C" && cat "$BUNDLE"/*.tar.* | tar -xC "$C" || exit 1
fi
DRY=${DRY_RUN:-0} INIT=${INIT:-default} REGEN_MIN=${REGEN_MIN:-1.25} TRAIN_MIN=${TRAIN_MIN:-1.25}
DATA_DEFAULT=data/$(basename "${TARGET:-SmolLM2-135M-Instruct}")
[ "$DRY" = 1 ] && DATA_DEFAULT=$OUT/data_dry
DATA=${DATA:-$DATA_DEFAULT}
TARGET_ARGS=() INIT_ARGS=(--init "$INIT") PEAK=1e-3  # a warm start already sits in a minimum: half the lr
[ -n "${TARGET:-}" ] && TARGET_ARGS=(--target "$TARGET")
[ "$INIT" = none ] && INIT_ARGS=() PEAK=2e-3
REGEN=(--regenerate 0,0.7,1.0 --regen-budget-min "$REGEN_MIN" --all-turns --max-prompt-tokens 192 --max-new-tokens 256)
TRAIN=(--num-steps 5 --batch-size 48 --positions-per-seq 160 --lr "${LR:-$PEAK}" --warmup 50 --epochs 100
       --time-budget-min "$TRAIN_MIN" --save-every-min 0.5 --amp)
EVAL=(--num-prompts "${EVAL_PROMPTS:-64}" --max-tokens 64 --steps 5 --topks 1,3 --temperatures "${EVAL_TEMPS:-0}")
if [ "$DRY" = 1 ]; then  # tiny sizes, CPU
  STEPS=${STEPS:-train eval}
  REGEN=(--regenerate 0 --num-conversations 2 --max-prompt-tokens 16 --max-new-tokens 8)
  TRAIN=(--max-tokens 200 --batch-size 2 --positions-per-seq 8 --warmup 1 --epochs 1)
  EVAL=(--num-prompts 1 --max-tokens 4 --steps 1 --topks 1 --temperatures 0)
fi
[ "$REGEN_MIN" = 0 ] && REGEN=()
STEPS=" ${STEPS:-compile gpu kernel_tests graphs bench deterministic train eval} "
EVAL+=(--datasets sharegpt)
[ -n "${TARGET:-}" ] && EVAL+=(--model "$TARGET")
TRAIN_S=${TRAIN_S:-$(awk "BEGIN { print int(($REGEN_MIN + $TRAIN_MIN) * 60 + 90) }")}
rc=0
step() {  # step NAME LIMIT_S CMD...: run CMD under the limit, log to $OUT/NAME.txt, remember a failure
  local t0=$SECONDS
  echo "== $1 (at most $2 s)"
  timeout -k 10 "$2" "${@:3}" 2>&1 | tr '\r' '\n' | grep --line-buffered -v -E '^\s*$|^(train|Generating): ' \
    | tee "$OUT/$1.txt"
  local r=${PIPESTATUS[0]}
  echo "$1 rc=$r $((SECONDS - t0))s" >> "$OUT/steps.txt"
  [ "$r" -eq 0 ] || { echo "== $1 FAILED (rc $r; 124: over its limit)"; rc=1; }
}
want() { [[ $STEPS == *" $1 "* ]]; }
want compile && step compile "${COMPILE_S:-60}" python3 scripts/kernel_specs.py check --archs native \
  --workers "$(nproc)" --json "$OUT/compile.json"
want gpu && step gpu "${GPU_S:-20}" sh -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv &&
  python3 -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)"'
want kernel_tests && step kernel_tests "${KERNEL_TESTS_S:-100}" \
  env NANOSPEC_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_kernels_*.py
want kernel_tests && step no_sync "${NO_SYNC_S:-60}" python3 -m pytest -q -p no:cacheprovider tests/test_transfers.py
want graphs && step graphs "${GRAPHS_S:-100}" python3 scripts/gpu_graphs.py
# capture at the defaults (256 sequences, the assistant, S = 5) and for Gemma 4 E2B's shape: the engine prints
# its memory plan and what capture took; the plan without a GPU beside them
want graphs && step graph_memory "${GRAPH_MEMORY_S:-120}" sh -c 'python3 scripts/memory_plan.py &&
  python3 -c "from nanospec import LLM; LLM(assistant=\"default\")" &&
  python3 scripts/memory_plan.py --shape gemma4-e2b &&
  python3 bench.py --shape gemma4-e2b --assistant random --batch-1 --num-seqs 1 --max-output-len 8'
if want bench; then
  step bench_batch1 "${BENCH_S:-40}" python3 bench.py --workload sharegpt --batch-1
  step bench_batch1_plain "${BENCH_S:-40}" python3 bench.py --workload sharegpt --batch-1 --assistant none
  step bench_qwen3 "${BENCH_QWEN3_S:-60}" python3 bench.py --shape qwen3-0.6b --compare-hf --hf-num-seqs 16 \
    --hf-batch-size "${HF_BATCH:-16}"
fi
want deterministic && step deterministic "${DET_S:-240}" python3 scripts/deterministic_check.py --device cuda \
  --dtype bfloat16 --num-prompts 50 --batch 32 --max-tokens 128
if want train; then
  touch "$OUT/.train_start"  # shards written after this are the new ones
  step train "$TRAIN_S" python3 -m nanospec.tools.train "${TARGET_ARGS[@]}" "${INIT_ARGS[@]}" --data "$DATA" \
    --out "$OUT/assistant" "${REGEN[@]}" "${TRAIN[@]}" ${TRAIN_EXTRA:-}
  find "$DATA" -maxdepth 1 -type f -newer "$OUT/.train_start" -exec cp {} "$OUT/data/" \;
fi
if want eval; then
  step eval "${EVAL_S:-60}" python3 -m nanospec.tools.eval --assistant "$OUT/assistant" "${EVAL[@]}"
  [ -z "${TARGET:-}" ] && step eval_shipped "${EVAL_S:-60}" python3 -m nanospec.tools.eval --assistant default "${EVAL[@]}"
fi
cat "$OUT/steps.txt"
exit $rc

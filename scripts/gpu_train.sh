#!/usr/bin/env bash
# Distill the assistant on one GPU, from the repo root:  bash scripts/gpu_train.sh [OUT_DIR]   (default: gpu_out)
# 1. regenerate: the target answers ShareGPT user turns (all turns, seeded random order) with nanospec (bf16,
#    CUDA graphs), greedy then T = 0.7 and 1.0, until REGEN_MIN minutes are spent;
# 2. train on those answers for TRAIN_MIN minutes (bf16 autocast), warm-started from INIT;
# 3. measure acceptance of the new assistant and of the shipped one on the same held-out ShareGPT prompts.
# The assistant lands in OUT_DIR/assistant (with training_info.json); logs in OUT_DIR/{train,eval,eval_shipped}.txt.
# Environment (defaults in brackets): TARGET [the default SmolLM2-135M-Instruct] model dir; INIT [default]
# assistant to start from ("default": the shipped one, "none": a fresh init); REGEN_MIN [2.5]; TRAIN_MIN [2.5];
# LR [1e-3 warm, 2e-3 fresh]; EVAL_PROMPTS [64]; EVAL_TEMPS [0,0.7]; TRAIN_EXTRA: more trainer flags.
set -euo pipefail
OUT=${1:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
unset TRITON_INTERPRET
[ -e nanospec/kernels ] || ln -s ../kernels nanospec/kernels  # what an install's package-dir mapping provides
INIT=${INIT:-default}
TARGET_ARGS=() INIT_ARGS=(--init "$INIT") PEAK=1e-3  # a warm start already sits in a minimum: half the lr
[ -n "${TARGET:-}" ] && TARGET_ARGS=(--target "$TARGET")
[ "$INIT" = none ] && INIT_ARGS=() PEAK=2e-3
LR=${LR:-$PEAK}
python3 -m nanospec.tools.train "${TARGET_ARGS[@]}" "${INIT_ARGS[@]}" --out "$OUT/assistant" \
  --regenerate 0,0.7,1.0 --regen-budget-min "${REGEN_MIN:-2.5}" --all-turns --max-prompt-tokens 192 \
  --max-new-tokens 256 --num-steps 5 --batch-size 48 --positions-per-seq 160 --lr "$LR" --warmup 50 \
  --epochs 100 --time-budget-min "${TRAIN_MIN:-2.5}" --save-every-min 1 --amp ${TRAIN_EXTRA:-} 2>&1 \
  | tr '\r' '\n' | grep -v -E '^\s*$|^(train|Generating): ' | tee "$OUT/train.txt"
EVAL=(--num-prompts "${EVAL_PROMPTS:-64}" --max-tokens 64 --steps 5 --topks 1,3 --temperatures "${EVAL_TEMPS:-0,0.7}"
      --datasets sharegpt)
[ -n "${TARGET:-}" ] && EVAL+=(--model "$TARGET")
python3 -m nanospec.tools.eval --assistant "$OUT/assistant" "${EVAL[@]}" | tee "$OUT/eval.txt"
if [ "$INIT" = default ]; then  # the baseline to beat before replacing the shipped assistant
  python3 -m nanospec.tools.eval --assistant default "${EVAL[@]}" | tee "$OUT/eval_shipped.txt"
fi

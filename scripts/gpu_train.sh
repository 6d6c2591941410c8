#!/usr/bin/env bash
# GPU run (one H200, BUDGET_S seconds, default 540): regenerate ShareGPT responses with the target (nanospec, bf16,
# CUDA graphs), distill the Frozen-KV MTP assistant on them, evaluate its acceptance with nanospec, then (time left)
# compare CUDA graphs with eager. The assistant lands in $OUT/assistant; the log in $OUT/train.log.
# Usage on the GPU machine, from the repo root:  OUT=/some/dir BUDGET_S=540 bash scripts/gpu_train.sh
# INIT (default: default) warm-starts from that assistant (the shipped one: its 138 s of H200 training carry over);
# INIT=none trains from a fresh init.
# Needs the default model and the ShareGPT data resolvable (NANOSPEC_CACHE); scripts/gpu_pack.py brings both.
set -uo pipefail
OUT=${OUT:-gpu_out}
BUDGET_S=${BUDGET_S:-540}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
unset TRITON_INTERPRET
[ -e nanospec/kernels ] || ln -s ../kernels nanospec/kernels  # the package-dir mapping of an install, without one
left() { echo $((BUDGET_S - SECONDS)); }
upto() { local t=$(( $(left) - $1 )); echo $(( t > 10 ? t : 10 )); }  # seconds for a step that leaves $1 s
LOG="$OUT/train.log"
py() { python3 "$@" 2>&1 | tr '\r' '\n' | grep -v -E '^\s*$' | tee -a "$LOG"; }

py -c "from nanospec.loader import resolve_model_dir; print('model:', resolve_model_dir(None))"
TRAIN_MIN=${TRAIN_MIN:-2.5}
INIT=${INIT:-default}
INIT_ARGS="--init $INIT" PEAK=1e-3  # a warm start already sits in a minimum: half the fresh peak lr
[ "$INIT" = none ] && INIT_ARGS="" PEAK=2e-3
LR=${LR:-$PEAK}
TRAIN="python3 -m nanospec.train_assistant --num-steps 5 --batch-size 48 --positions-per-seq 160 \
  --lr $LR --warmup 50 $INIT_ARGS --epochs 100 --time-budget-min $TRAIN_MIN --save-every-min 1 --amp \
  --out $OUT/assistant ${TRAIN_EXTRA:-}"
echo "== train ($(left) s left)" | tee -a "$LOG"
timeout "$(upto 70)" $TRAIN --regenerate 0,0.7,1.0 --regen-budget-min ${REGEN_MIN:-2.5} --all-turns \
  --max-prompt-tokens 192 --max-new-tokens 256 2>&1 | tr '\r' '\n' | grep -v -E '^\s*$|^(train|Generating): ' \
  | tee -a "$LOG"
if [ ! -f "$OUT/assistant/model.safetensors" ]; then  # regeneration failed: original responses, torch kernels
  echo "== fallback: original responses, NANOSPEC_BACKEND=torch ($(left) s left)" | tee -a "$LOG"
  NANOSPEC_BACKEND=torch timeout "$(upto 40)" $TRAIN 2>&1 | tr '\r' '\n' | grep -v -E '^\s*$|^(train|Generating): ' \
    | tee -a "$LOG"
fi
evaluate() {  # $1 assistant, $2 output file, $3 seconds to leave: the same held-out prompts for both assistants
  echo "== eval $1 ($(left) s left)" | tee -a "$LOG"
  timeout "$(upto "$3")" python3 -m nanospec.eval_acceptance --assistant "$1" \
    --num-prompts ${EVAL_PROMPTS:-64} --max-tokens 64 --steps 5 --topks 1,3 --temperatures ${EVAL_TEMPS:-0,0.7} \
    --datasets sharegpt 2>&1 | grep -E '^\||assistant=|Error|error' | tee "$2"
}
evaluate "$OUT/assistant" "$OUT/eval.txt" 50  # leaves the baseline its time (the last 64-prompt eval took 23 s)
[ "$(left)" -gt 30 ] && evaluate default "$OUT/eval_shipped.txt" 5  # the baseline to beat before shipping
if [ "$(left)" -gt 100 ]; then
  echo "== graphs vs eager ($(left) s left)" | tee -a "$LOG"
  timeout "$(upto 10)" python3 scripts/gpu_graphs.py 2>&1 | tail -n 5 | tee "$OUT/graphs.txt"
fi
echo "== done ($(left) s left)" | tee -a "$LOG"

#!/usr/bin/env bash
# Distill the assistant on one GPU, from the repo root:  bash scripts/gpu_train.sh [OUT_DIR]   (default: gpu_out)
# The train and eval steps of scripts/gpu_run.sh (its header lists the settings), with longer budgets by default:
# regenerate for REGEN_MIN [2.5] minutes into a new shard of DATA, train on every shard for TRAIN_MIN [2.5]
# minutes, then measure the new and the shipped assistant on the same held-out prompts at EVAL_TEMPS [0,0.7].
export STEPS=${STEPS:-train eval} REGEN_MIN=${REGEN_MIN:-2.5} TRAIN_MIN=${TRAIN_MIN:-2.5}
export EVAL_TEMPS=${EVAL_TEMPS:-0,0.7} EVAL_S=${EVAL_S:-120}
exec bash "$(dirname "$0")/gpu_run.sh" "$@"

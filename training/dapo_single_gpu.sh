#!/usr/bin/env bash
# Shared runner of the per-size scripts dapo_qwen2.5-{3b,7b,14b,32b}_{nvfp4,bf16}_single_gpu.sh: DAPO with LoRA
# on one GPU with the QeRL reference's hyper-parameters. They live in the recipe configs/dapo_<dataset>_<precision>.yaml
# (and the parts it extends); this file passes only what depends on the model size: the batch, and the model.
#
# Set by the calling script: SIZE (3B, 7B, 14B, 32B), PRECISION (nvfp4 or bf16), BATCH (the per-device batch and
# num_generations, as in the reference: one prompt x BATCH samples per step). From the user: MODEL_PATH (required for
# nvfp4: the NVFP4 checkpoint folder; default for bf16: Qwen/Qwen2.5-$SIZE-Instruct), DATA_NAME=gsm8k|bigmath|dapomath
# (default gsm8k for both precisions; the reference's BF16 scripts default to bigmath), CKPTS_DIR (default
# ./ckpt/<run name>), PYTHON, DRY_RUN=1 (print the command instead of running it). Extra flags override the
# recipe. Re-running continues from the newest checkpoint in CKPTS_DIR, as the reference does.
# One GPU, so the decoder layers are compiled for the training passes (--compile-layers: at 32B an update's passes
# took 5.5 s instead of 8.6, for ~1 min of compilation at the first step; docs/benchmarks.md, "The whole step").
set -euo pipefail
cd "$(dirname "$0")/.."

: "${SIZE:?set by the calling script}" "${PRECISION:?set by the calling script}" "${BATCH:?set by the calling script}"
DATA_NAME="${DATA_NAME:-gsm8k}"
PYTHON="${PYTHON:-python}"
if [ "$PRECISION" = nvfp4 ]; then
    MODEL_NAME="qwen2.5-${SIZE}-single-gpus-quantized"
    MODEL_PATH="${MODEL_PATH:?set MODEL_PATH to the NVFP4 checkpoint folder (make it with python -m qerl.quantize)}"
else
    MODEL_NAME="qwen2.5-${SIZE}-single-gpus"
    MODEL_PATH="${MODEL_PATH:-Qwen/Qwen2.5-${SIZE}-Instruct}"
fi
runname=${MODEL_NAME}_${DATA_NAME}_b${BATCH}
CKPTS_DIR="${CKPTS_DIR:-./ckpt/${runname}}"

${DRY_RUN:+echo} "$PYTHON" -m qerl.train \
    --config "configs/dapo_${DATA_NAME}_${PRECISION}.yaml" \
    --model-name "$MODEL_PATH" \
    --output-dir "$CKPTS_DIR" \
    --run-name "$runname" \
    --per-device-train-batch-size "$BATCH" \
    --num-generations "$BATCH" \
    --resume-from-checkpoint true \
    --compile-layers true \
    "$@"

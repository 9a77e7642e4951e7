#!/usr/bin/env bash
# Shared runner of the per-size scripts dapo_qwen2.5-{3b,7b,14b,32b}_{nvfp4,bf16}_single_gpu.sh: DAPO with LoRA
# on one GPU with the QeRL reference's hyper-parameters. configs/dapo_<dataset>_<precision>.yaml holds the
# shared recipe; this file sets what the reference's scripts set on the command line.
#
# Set by the calling script: SIZE (3B, 7B, 14B, 32B), PRECISION (nvfp4 or bf16), BATCH (prompts = samples
# per step). From the user: MODEL_PATH (required for nvfp4: the NVFP4 checkpoint folder; default for bf16:
# Qwen/Qwen2.5-$SIZE-Instruct), DATA_NAME=gsm8k|bigmath|dapomath (default gsm8k), CKPTS_DIR (default
# ./ckpt/<run name>), PYTHON, DRY_RUN=1 (print the command instead of running it). Extra flags override the
# recipe. Re-running continues from the newest checkpoint in CKPTS_DIR, as the reference does.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${SIZE:?set by the calling script}" "${PRECISION:?set by the calling script}" "${BATCH:?set by the calling script}"
DATA_NAME="${DATA_NAME:-gsm8k}"
PYTHON="${PYTHON:-python}"
if [ "$PRECISION" = nvfp4 ]; then
    MODEL_NAME="qwen2.5-${SIZE}-single-gpus-quantized"
    MODEL_PATH="${MODEL_PATH:?set MODEL_PATH to the NVFP4 checkpoint folder (make it with llm-compressor/quantize_nvfp4.py)}"
    lr=1e-5
    aqn_flags=(--sigma-start 1e-2 --sigma-end 1e-4 --num-stages 10)
else
    MODEL_NAME="qwen2.5-${SIZE}-single-gpus"
    MODEL_PATH="${MODEL_PATH:-Qwen/Qwen2.5-${SIZE}-Instruct}"
    lr=5e-6
    aqn_flags=()
fi
gradient_accumulation_steps=1
lora_rank=16
lora_alpha=16
ln=True
epsilon_high=0.28

runname=${MODEL_NAME}_${lr}_${epsilon_high}_${DATA_NAME}_b${BATCH}_g${gradient_accumulation_steps}_r${lora_rank}_${ln}
CKPTS_DIR="${CKPTS_DIR:-./ckpt/${runname}}"

${DRY_RUN:+echo} "$PYTHON" -m qerl.train \
    --config "configs/dapo_${DATA_NAME}_${PRECISION}.yaml" \
    --model-name "$MODEL_PATH" \
    --dataset "$DATA_NAME" \
    --output-dir "$CKPTS_DIR" \
    --run-name "$runname" \
    --per-device-train-batch-size "$BATCH" \
    --num-generations "$BATCH" \
    --gradient-accumulation-steps "$gradient_accumulation_steps" \
    --learning-rate "$lr" \
    --lora-rank "$lora_rank" \
    --lora-alpha "$lora_alpha" \
    --ln "$ln" \
    --epsilon-high "$epsilon_high" \
    "${aqn_flags[@]}" \
    --random-state 2025 \
    --resume-from-checkpoint true \
    "$@"

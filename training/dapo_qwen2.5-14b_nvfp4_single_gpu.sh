#!/usr/bin/env bash
# QeRL: DAPO on Qwen2.5-14B-Instruct with an NVFP4 base + LoRA + Adaptive Quantization Noise, on one GPU.
# Hyper-parameters of the QeRL reference script training/dapo_qwen2.5-14b_nvfp4_single_gpu.sh
# (configs/dapo_<dataset>_nvfp4.yaml holds the shared recipe; the lines below set what this size changes).
#
# Usage: MODEL_PATH=/models/Qwen2.5-14B-Instruct-NVFP4 bash training/dapo_qwen2.5-14b_nvfp4_single_gpu.sh [--flag value ...]
#   DATA_NAME=gsm8k|bigmath|dapomath (default gsm8k), CKPTS_DIR=... (default ./ckpt/<run name>),
#   DRY_RUN=1 prints the command instead of running it. Extra flags override the recipe.
# Re-running continues from the newest checkpoint in CKPTS_DIR, as the reference does.
# Make the NVFP4 checkpoint first:
#   python llm-compressor/quantize_nvfp4.py --model Qwen/Qwen2.5-14B-Instruct --output /models/Qwen2.5-14B-Instruct-NVFP4
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL_NAME="qwen2.5-14B-single-gpus-quantized"
MODEL_PATH="${MODEL_PATH:?set MODEL_PATH to the NVFP4 checkpoint folder}"
DATA_NAME="${DATA_NAME:-gsm8k}"
PYTHON="${PYTHON:-python}"

perdevice_train_batch_size=2
gradient_accumulation_steps=1
lora_rank=16
lora_alpha=16
lr=1e-5
ln=True
epsilon_high=0.28
sigma_start=1e-2
sigma_end=1e-4
num_stages=10

runname=${MODEL_NAME}_${lr}_${epsilon_high}_${DATA_NAME}_b${perdevice_train_batch_size}_g${gradient_accumulation_steps}_r${lora_rank}_${ln}
CKPTS_DIR="${CKPTS_DIR:-./ckpt/${runname}}"

${DRY_RUN:+echo} "$PYTHON" -m qerl.train \
    --config "configs/dapo_${DATA_NAME}_nvfp4.yaml" \
    --model-name "$MODEL_PATH" \
    --dataset "$DATA_NAME" \
    --output-dir "$CKPTS_DIR" \
    --run-name "$runname" \
    --per-device-train-batch-size "$perdevice_train_batch_size" \
    --num-generations "$perdevice_train_batch_size" \
    --gradient-accumulation-steps "$gradient_accumulation_steps" \
    --learning-rate "$lr" \
    --lora-rank "$lora_rank" \
    --lora-alpha "$lora_alpha" \
    --ln "$ln" \
    --epsilon-high "$epsilon_high" \
    --sigma-start "$sigma_start" \
    --sigma-end "$sigma_end" \
    --num-stages "$num_stages" \
    --random-state 2025 \
    --resume-from-checkpoint true \
    "$@"

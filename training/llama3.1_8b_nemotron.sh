#!/usr/bin/env bash
# QeRL: DAPO on an NVFP4 Llama-3.1-8B (the reference trains nvidia/Llama-3.1-Nemotron-Nano-8B-v1) + LoRA + AQN on
# one GPU; the QeRL reference's training/llama3.1_8b_nemotron.sh. Settings, and where they differ from the
# reference's and why: configs/llama3.1_8b_gsm8k_nvfp4.yaml (batch 4 x gradient accumulation 16, lr 1e-5, gsm8k).
# Usage: MODEL_PATH=/models/Llama-3.1-Nemotron-Nano-8B-v1-NVFP4 bash training/llama3.1_8b_nemotron.sh [--flag value ...]
# Make the NVFP4 checkpoint first (any Llama-3.x 8B works the same way):
#   python -m qerl.quantize --model nvidia/Llama-3.1-Nemotron-Nano-8B-v1 \
#       --output /models/Llama-3.1-Nemotron-Nano-8B-v1-NVFP4
# Also: CKPTS_DIR (default ./ckpt/<run name>), PYTHON, DRY_RUN=1 (print the command). Extra flags override the
# recipe. Re-running continues from the newest checkpoint in CKPTS_DIR, as the reference does.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL_PATH="${MODEL_PATH:?set MODEL_PATH to the NVFP4 checkpoint folder (make it with python -m qerl.quantize)}"
PYTHON="${PYTHON:-python}"
runname=Llama-3.1-Nemotron-Nano-8B-v1-NVFP4A16_gsm8k_b4_g16
CKPTS_DIR="${CKPTS_DIR:-./ckpt/${runname}}"

${DRY_RUN:+echo} "$PYTHON" -m qerl.train \
    --config configs/llama3.1_8b_gsm8k_nvfp4.yaml \
    --model-name "$MODEL_PATH" \
    --output-dir "$CKPTS_DIR" \
    --run-name "$runname" \
    --resume-from-checkpoint true \
    "$@"

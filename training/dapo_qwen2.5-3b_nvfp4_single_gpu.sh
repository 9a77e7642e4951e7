#!/usr/bin/env bash
# QeRL: DAPO on Qwen2.5-3B-Instruct with an NVFP4 base + LoRA + Adaptive Quantization Noise, on one GPU;
# the QeRL reference's training/dapo_qwen2.5-3b_nvfp4_single_gpu.sh.
# Settings: the recipe (see dapo_single_gpu.sh); this script sets the batch of its size.
# Usage: MODEL_PATH=/models/Qwen2.5-3B-Instruct-NVFP4 bash training/dapo_qwen2.5-3b_nvfp4_single_gpu.sh [--flag value ...]
# Make the NVFP4 checkpoint first:
#   python -m qerl.quantize --model Qwen/Qwen2.5-3B-Instruct --output /models/Qwen2.5-3B-Instruct-NVFP4
SIZE=3B PRECISION=nvfp4 BATCH=2 exec bash "$(dirname "$0")/dapo_single_gpu.sh" "$@"

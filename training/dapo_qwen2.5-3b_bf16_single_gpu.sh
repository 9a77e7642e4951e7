#!/usr/bin/env bash
# QeRL: DAPO on Qwen2.5-3B-Instruct with a BF16 base + LoRA (the baseline), on one GPU;
# the QeRL reference's training/dapo_qwen2.5-3b_bf16_single_gpu.sh.
# Settings: the recipe (see dapo_single_gpu.sh); this script sets the batch of its size.
# Usage: bash training/dapo_qwen2.5-3b_bf16_single_gpu.sh [--flag value ...]   (MODEL_PATH defaults to Qwen/Qwen2.5-3B-Instruct)
SIZE=3B PRECISION=bf16 BATCH=2 exec bash "$(dirname "$0")/dapo_single_gpu.sh" "$@"

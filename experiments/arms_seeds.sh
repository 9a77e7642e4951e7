#!/usr/bin/env bash
# Seeds of the four arms on a lent machine (issue 42), in device calls of at most 10 minutes:
#   bash experiments/arms_seeds.sh start   copy the tree, start the whole run in its own session, then wait
#   bash experiments/arms_seeds.sh wait    wait up to WAIT_S seconds (default 540)
# Every exit packs the records written so far and the logs' tails into $OUT/arms-records.tar.gz: untar it in the
# checkout's root and commit results/arms/ (a run recorded there is never run again).
# The run: the model from $GGUF (converted, quantized), then two `experiments.arms train` at once:
#   MPS_GPUS (default 1,2,3): PER_GPU runs each (default 4) sharing the GPU through CUDA MPS; the bases, then every
#   arm at SEEDS (seed by seed)
#   ALONE_GPU (default 0): one run at a time (no MPS), ALONE_ARM (bf16_lora) at ALONE_SEEDS
# Neither starts a run that would end after FINISH_BY (unix time): a run is expected to take RUN_MINUTES (10) /
# ALONE_MINUTES (6) until one has finished, then as long as the longest finished (on four H200s: 8-11 / 6 min).
# Environment: GGUF (required), FINISH_BY (required), QERL_COMMIT (the commit the tree is), MODEL, STEPS (51), LR
# (3e-4, the sweep's: docs/benchmarks.md), SEEDS (0-9), ALONE_SEEDS (0,1,2), DATA (../shared/data/gsm8k), WAIT_S.
set -uo pipefail
cd "$(dirname "$0")/.."
src=/tmp/qerl-arms-src
work=${ARMS_WORK:-/tmp/qerl-arms}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
running() { pgrep -f -- "experiments/arms_seeds.sh run" > /dev/null; }
pack() {
  [ -n "${OUT:-}" ] || return 0
  mkdir -p "$work/tails"
  for log in "$work"/*.log "$work"/runs/*/log.txt; do
    [ -f "$log" ] && tail -n 30 "$log" > "$work/tails/$(basename "$(dirname "$log")")-$(basename "$log")"
  done
  tar -C "$src" -czf "$OUT/arms-records.tar.gz" results/arms 2>/dev/null
  tar -C "$work" -czf "$OUT/arms-logs.tar.gz" tails 2>/dev/null
}
case "${1:-}" in
  start)
    if running; then echo "already running"; else
      rm -rf "$src" && mkdir -p "$src" "$work"
      tar --exclude=./.git --exclude=./runs --exclude=./.carry --exclude=./.whl -cf - . | tar -xf - -C "$src"
      (cd "$src" && setsid nohup bash experiments/arms_seeds.sh run >> "$work/seeds.log" 2>&1 < /dev/null &)
      echo "started: $work/seeds.log"
    fi ;;
  run)
    : "${GGUF:?GGUF: the GGUF file of the model}" "${FINISH_BY:?FINISH_BY: unix time by which runs must end}"
    model=${MODEL:-qwen2.5-coder-1.5b-instruct}
    data=${DATA:-../shared/data/gsm8k}
    common=(--model "$model" --checkpoint-dir "$work/ckpt" --out "$work/runs" --train-data "$data/train.jsonl"
            --test-data "$data/test.jsonl" --lr "${LR:-3e-4}" --steps "${STEPS:-51}" --checkpoints 0
            --finish-by "$FINISH_BY")
    "$py" -m qerl.models fetch "$model" --output "$work/ckpt/$model" --gguf "$GGUF" || exit 1
    "$py" -m experiments.arms prepare "${common[@]}" || exit 1
    "$py" -m experiments.arms train "${common[@]}" --gpu-ids "${MPS_GPUS:-1,2,3}" --per-gpu "${PER_GPU:-4}" --mps \
      --bases --seeds "${SEEDS:-0,1,2,3,4,5,6,7,8,9}" --run-minutes "${RUN_MINUTES:-10}" > "$work/mps.log" 2>&1 &
    "$py" -m experiments.arms train "${common[@]}" --gpu-ids "${ALONE_GPU:-0}" --per-gpu 1 \
      --arms "${ALONE_ARM:-bf16_lora}" --seeds "${ALONE_SEEDS:-0,1,2}" --run-minutes "${ALONE_MINUTES:-6}" \
      > "$work/alone.log" 2>&1 &
    wait
    echo "finished"
    exit 0 ;;
  wait) ;;
  *) echo "usage: $0 start|wait"; exit 2 ;;
esac
deadline=$((SECONDS + ${WAIT_S:-540}))
while running && [ $SECONDS -lt $deadline ]; do sleep 10; done
running && echo "still running: call wait again" || echo "not running"
tail -n 5 "$work/seeds.log" 2>/dev/null
grep -h "done in\|FAILED\|skipped" "$work"/mps.log "$work"/alone.log 2>/dev/null | tail -n 30
pack

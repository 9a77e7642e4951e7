#!/usr/bin/env bash
# experiments.multi_gpu_suite on the GPU machine, for a runner whose calls last at most 10 minutes:
#   bash experiments/multi_gpu_suite.sh start [more suite flags]   start it in its own session (outlives the call),
#                                                                   then wait as `wait` does
#   bash experiments/multi_gpu_suite.sh wait     wait up to WAIT_S seconds (default 540) for it to end
#   bash experiments/multi_gpu_suite.sh bundle   only write the bundle
# Every exit writes the summary so far, results.json and the logs' tails to $OUT (the device runner's folder). A second
# `start` on the same machine redoes only the jobs without a result; on a fresh machine, `start --restore FILE` with
# the last results.json brought along (in a carried folder) does the same (the models are rebuilt; give FILE as an
# absolute path: the suite runs from a copy of the tree). `start` runs the
# suite from a copy of the tree (SUITE_SRC, /tmp/qerl-suite-src): the device runner copies the caller's tree into
# place again at every call, and one launch that imported a module meanwhile failed ("No module named
# benchmarks.step"). Environment: SUITE_OUT (runs/issue34), GGUF (the Qwen2.5-Coder-1.5B-Instruct GGUF: adds the
# real-model phase), GPUS (4), WAIT_S, PYTHON (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${SUITE_OUT:-runs/issue34}")
src=${SUITE_SRC:-/tmp/qerl-suite-src}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
running() { [ -f "$out/suite.pid" ] && kill -0 "$(cat "$out/suite.pid")" 2>/dev/null; }
bundle() {
  "$py" -m experiments.multi_gpu_suite summarize --out "$out" --gpus "${GPUS:-4}" ${OUT:+--bundle "$OUT"} > /dev/null
  cp "$out/suite.log" "${OUT:-$out}/suite.log" 2>/dev/null || true
}
command=${1:-start}
shift || true
case "$command" in
  start)
    if running; then
      echo "already running (pid $(cat "$out/suite.pid"))"
    else
      rm -rf "$src" && mkdir -p "$src"
      if git rev-parse --git-dir > /dev/null 2>&1; then  # tracked and not-ignored files, as the runner sends them
        git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$src"
      else
        tar --exclude=./.git --exclude=./runs -cf - . | tar -xf - -C "$src"
      fi
      (cd "$src" && setsid nohup "$py" -m experiments.multi_gpu_suite run --out "$out" --gpus "${GPUS:-4}" \
        ${GGUF:+--gguf "$(realpath "$GGUF")"} "$@" >> "$out/suite.log" 2>&1 < /dev/null &
       echo $! > "$out/suite.pid")
      echo "started (pid $(cat "$out/suite.pid")), log $out/suite.log"
    fi ;;
  wait | bundle) ;;
  *) echo "usage: $0 start|wait|bundle [suite flags]"; exit 2 ;;
esac
if [ "$command" != bundle ]; then
  deadline=$((SECONDS + ${WAIT_S:-540}))
  while running && [ $SECONDS -lt $deadline ]; do sleep 10; done
  if running; then echo "still running after ${WAIT_S:-540} s: call wait again"; else echo "finished"; fi
fi
tail -n 40 "$out/suite.log"
bundle

#!/usr/bin/env bash
# A suite (python -m MODULE run / summarize: experiments.multi_gpu_suite, experiments.speed_suite) on the GPU machine,
# for a runner whose calls last at most 10 minutes:
#   bash experiments/suite.sh MODULE start [suite flags]   start it in its own session (outlives the call), then wait
#   bash experiments/suite.sh MODULE wait     wait up to WAIT_S seconds (default 540) for it to end
#   bash experiments/suite.sh MODULE bundle   only write the bundle
# Every exit writes the summary so far, results.json and the logs' tails to $OUT (the device runner's folder). A second
# `start` on the same machine redoes only the jobs without a result. `start` runs the suite from a copy of the tree
# (SUITE_SRC, /tmp/qerl-suite-src): the device runner copies the caller's tree into place again at every call, and one
# launch that imported a module meanwhile failed ("No module named benchmarks.step"). Environment: SUITE_OUT (the
# suite's --out, default runs/MODULE), GPUS (default: all), WAIT_S, PYTHON (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
module=${1:?usage: $0 MODULE start|wait|bundle [suite flags]}
shift
out=$(realpath -m "${SUITE_OUT:-runs/${module##*.}}")
src=${SUITE_SRC:-/tmp/qerl-suite-src}
py=${PYTHON:-python3}
gpus=${GPUS:+--gpus $GPUS}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# By its command line: on the GPU machine the pid that `$!` gave was seen dead while the suite ran on.
running() { pgrep -f -- "-m $module run --out $out( |\$)" > /dev/null; }
bundle() {
  "$py" -m "$module" summarize --out "$out" $gpus ${OUT:+--bundle "$OUT"} > /dev/null
  cp "$out/suite.log" "${OUT:-$out}/suite.log" 2>/dev/null || true
}
command=${1:-start}
shift || true
case "$command" in
  start)
    if running; then
      echo "already running: $(pgrep -af -- "-m $module run --out $out( |\$)")"
    else
      rm -rf "$src" && mkdir -p "$src"
      if git rev-parse --git-dir > /dev/null 2>&1; then  # tracked and not-ignored files, as the runner sends them
        git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$src"
      else
        tar --exclude=./.git --exclude=./runs -cf - . | tar -xf - -C "$src"
      fi
      (cd "$src" && setsid nohup "$py" -m "$module" run --out "$out" $gpus "$@" >> "$out/suite.log" 2>&1 < /dev/null &)
      echo "started, log $out/suite.log"
    fi ;;
  wait | bundle) ;;
  *) echo "usage: $0 MODULE start|wait|bundle [suite flags]"; exit 2 ;;
esac
if [ "$command" != bundle ]; then
  deadline=$((SECONDS + ${WAIT_S:-540}))
  while running && [ $SECONDS -lt $deadline ]; do sleep 10; done
  if running; then echo "still running after ${WAIT_S:-540} s: call wait again"; else echo "finished"; fi
fi
tail -n 40 "$out/suite.log"
bundle

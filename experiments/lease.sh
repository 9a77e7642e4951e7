#!/usr/bin/env bash
# A long experiment on a lent GPU machine, driven by device calls of at most 10 minutes each:
#   bash experiments/lease.sh start NAME -- COMMAND...   copy the tree to /tmp/qerl-NAME/src and start COMMAND there in
#                                                        a session of its own (it outlives the call), then wait
#   bash experiments/lease.sh wait NAME                  wait while it runs
# Each call waits up to WAIT_S seconds (default 540), prints the end of the log, and packs what the experiment wrote
# so far under results/ (the records to commit: untar in the checkout's root) into $OUT/NAME-results.tar.gz and the
# tails of every log into $OUT/NAME-logs.tar.gz, so that a lease that ends early still leaves its records.
# Name the ignored data the command reads (.data) in the carry of the `start` call itself: the runner drops an
# ignored folder that a later call does not carry (seen 2026-11-29), and `start` copies the tree as it is then.
set -uo pipefail
cd "$(dirname "$0")/.."
action=${1:-}; name=${2:-}
[ -n "$name" ] || { echo "usage: $0 start NAME -- COMMAND... | wait NAME" >&2; exit 2; }
work=/tmp/qerl-$name
running() { [ -f "$work/pid" ] && kill -0 "$(cat "$work/pid")" 2> /dev/null; }
case "$action" in
  start)
    shift 2; [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || { echo "start: no command" >&2; exit 2; }
    if running; then echo "$name: already running"; else
      rm -rf "$work/src" && mkdir -p "$work/src"
      tar --exclude=./.git --exclude=./runs --exclude=./.carry --exclude=./.whl -cf - . | tar -xf - -C "$work/src"
      # setsid as the background command itself: its pid is the new session's, which a kill of the group stops.
      (cd "$work/src" && { setsid nohup "$@" >> "$work/run.log" 2>&1 < /dev/null & echo $! > "$work/pid"; })
      echo "$name: started $*; log $work/run.log"
    fi ;;
  wait) ;;
  *) echo "usage: $0 start NAME -- COMMAND... | wait NAME" >&2; exit 2 ;;
esac
deadline=$((SECONDS + ${WAIT_S:-540}))
while running && [ $SECONDS -lt $deadline ]; do sleep 2; done
running && echo "$name: still running: call wait again" || echo "$name: not running"
tail -n "${TAIL:-25}" "$work/run.log" 2> /dev/null
if [ -n "${OUT:-}" ]; then
  rm -rf "$work/tails" && mkdir -p "$work/tails"
  find "$work" -path "$work/tails" -prune -o \( -name "*.log" -o -name "log.txt" \) -type f -print |
    while read -r log; do tail -n 40 "$log" > "$work/tails/$(echo "${log#"$work"/}" | tr / _)"; done
  [ -d "$work/src/results" ] && tar -C "$work/src" -czf "$OUT/$name-results.tar.gz" results
  tar -C "$work" -czf "$OUT/$name-logs.tar.gz" tails
fi
exit 0

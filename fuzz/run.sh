#!/usr/bin/env bash
# Runs libFuzzer targets for SECONDS each, JOBS at a time, and fails when any of them finds something
# (a crash, a sanitizer report, a timeout or an out-of-memory: libFuzzer exits non-zero).
#   fuzz/run.sh BUILD_DIR SECONDS JOBS TARGET...
# The committed seeds (fuzz/corpus/<target>) are read only; new inputs go to BUILD_DIR/fuzz-corpus/<target>,
# findings to BUILD_DIR/fuzz-artifacts/<target>-*, logs to BUILD_DIR/fuzz-logs/<target>.log.
set -uo pipefail
build=$1 seconds=$2 jobs=$3
shift 3
src=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$build/fuzz-logs" "$build/fuzz-artifacts"

run_one() {
  local t=$1 log="$build/fuzz-logs/$1.log"
  mkdir -p "$build/fuzz-corpus/$t"
  "$build/fuzz/${t}_fuzz" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$build/fuzz-artifacts/$t-" "$build/fuzz-corpus/$t" "$src/corpus/$t" >"$log" 2>&1
}

declare -A pid_of
status=0
running=0
for t in "$@"; do
  if [ ! -x "$build/fuzz/${t}_fuzz" ]; then echo "fuzz: $build/fuzz/${t}_fuzz is missing (build first)"; exit 2; fi
done
for t in "$@"; do
  if [ "$running" -ge "$jobs" ]; then wait -n || true; running=$((running - 1)); fi
  echo "fuzz: $t for ${seconds}s"
  run_one "$t" &
  pid_of[$t]=$!
  running=$((running + 1))
done
for t in "$@"; do
  if wait "${pid_of[$t]}"; then rc=0; else rc=$?; fi
  log="$build/fuzz-logs/$t.log"
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  corp=$(grep -Eo 'corp: [0-9]+/[0-9]+[a-zA-Z]*' "$log" | tail -1)
  if [ "$rc" -eq 0 ]; then
    echo "fuzz: $t: ok, ${runs:-?} executions, ${rate:-?} exec/s, $corp"
  else
    status=1
    echo "fuzz: $t: FINDING (exit $rc), ${runs:-?} executions; log $log, artifacts $build/fuzz-artifacts/$t-*"
    grep -E 'ERROR: |runtime error|layer_fuzz: |error without|SUMMARY|Test unit written' "$log" | head -8 | sed 's/^/  /'
  fi
done
exit $status

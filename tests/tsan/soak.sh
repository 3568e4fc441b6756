#!/usr/bin/env bash
# ThreadSanitizer soak of the rank-thread rendezvous (core/thread_world) and the in-process
# communicator: the communicator unit tests, built with -fsanitize=thread, repeated many times
# while the machine is kept busy (busy loops on every core plus a second copy of the tests),
# so that thread interleavings vary. Any data race or failed assertion fails the soak.
#   tests/tsan/soak.sh [REPEATS]      (default 200; build dir build-tsan/, created if missing)
set -euo pipefail
cd "$(dirname "$0")/../.."
repeats=${1:-200}
if [ ! -f build-tsan/build.ninja ]; then
  meson setup build-tsan -Db_sanitize=thread -Db_lundef=false -Dgpu=disabled -Dmpi=disabled \
    -Doptimization=1 -Ddebug=false >/dev/null
fi
ninja -C build-tsan tests/unit/inproc_comm-test >/dev/null
test_bin=build-tsan/tests/unit/inproc_comm-test
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"

# Load: one busy loop per core, stopped on exit.
load_pids=()
cleanup() { for p in "${load_pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for _ in $(seq "$(nproc)"); do
  (while :; do :; done) &
  load_pids+=($!)
done

start=$(date +%s)
# Two copies at once (more threads than cores), each repeating the whole suite.
"$test_bin" --gtest_repeat="$repeats" --gtest_brief=1 >build-tsan/soak-a.log 2>&1 &
a=$!
"$test_bin" --gtest_repeat="$repeats" --gtest_brief=1 --gtest_shuffle >build-tsan/soak-b.log 2>&1 &
b=$!
rc=0
wait "$a" || rc=1
wait "$b" || rc=1
elapsed=$(( $(date +%s) - start ))
races=$(cat build-tsan/soak-a.log build-tsan/soak-b.log | grep -c "WARNING: ThreadSanitizer" || true)
failed=$(cat build-tsan/soak-a.log build-tsan/soak-b.log | grep -c "^\[  FAILED  \]" || true)
echo "tsan soak: 2 × ${repeats} repeats of $(basename "$test_bin") under load in ${elapsed} s:" \
  "${races} race report(s), ${failed} failed test line(s)"
if [ "$rc" -ne 0 ] || [ "$races" -ne 0 ]; then
  grep -m 40 -A 30 "WARNING: ThreadSanitizer\|FAILED" build-tsan/soak-a.log build-tsan/soak-b.log || true
  exit 1
fi

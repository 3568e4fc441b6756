#!/usr/bin/env bash
# Deadlines that survive load (issue 47): the watchdog test (watchdog-test.sh) with a CPU hog on
# every core beside it, as a shared cluster node or a CI machine running other jobs would be.
# Its verdicts must not change: the watchdog judges progress (busy heartbeats, data arriving),
# and the test's own time limits are measured against the same job's healthy run on the loaded
# machine, not fixed wall times.
# Usage: loaded-test.sh path/to/seqpar path/to/mpiexec path/to/failing_rank_check
set -u
# One hog for every core but one: meson runs this test beside the suite's other tests (two at a
# time on 2 cores), which load the last core; a hog there too only burned CPU the other tests
# need (2026-12-02: ~100 CPU-seconds of every CI run, with the whole suite waiting on it).
# Run alone (`meson test mpi-watchdog-loaded`), its own ranks load that core.
cores=$(nproc)
hogs=()
for _ in $(seq 1 $((cores > 1 ? cores - 1 : 1))); do
  (while :; do :; done) &
  hogs+=($!)
done
trap 'kill "${hogs[@]}" 2> /dev/null' EXIT
echo "loaded: ${#hogs[@]} CPU hog(s) on $cores cores beside the test"
bash "$(dirname "$0")/watchdog-test.sh" "$@"

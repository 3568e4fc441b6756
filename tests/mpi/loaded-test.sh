#!/usr/bin/env bash
# Deadlines that survive load (issue 47): the watchdog test (watchdog-test.sh) with a CPU hog on
# every core beside it, as a shared cluster node or a CI machine running other jobs would be.
# Its verdicts must not change: the watchdog judges progress (busy heartbeats, data arriving),
# and the test's own time limits are measured against the same job's healthy run on the loaded
# machine, not fixed wall times.
# Usage: loaded-test.sh path/to/seqpar path/to/mpiexec path/to/failing_rank_check
set -u
hogs=()
for _ in $(seq 1 "$(nproc)"); do
  (while :; do :; done) &
  hogs+=($!)
done
trap 'kill "${hogs[@]}" 2> /dev/null' EXIT
echo "loaded: ${#hogs[@]} CPU hog(s) beside the test"
bash "$(dirname "$0")/watchdog-test.sh" "$@"

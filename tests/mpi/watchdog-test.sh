#!/usr/bin/env bash
# The MPI watchdog and flight records (issue 18): a rank that stops without dying (SIGSTOP) is
# named by the ranks waiting for it within the deadline, every rank that can leave its flight
# record does, and `seqpar replay DIR` on the records names the same rank; a rank that throws
# is named by the replay of the records too; a long reference on rank 0 (heartbeats) is not a
# stall.
# Usage: watchdog-test.sh path/to/seqpar path/to/mpiexec path/to/failing_rank_check
set -u
seqpar=$1
mpiexec=$2
failing=$3
. "$(dirname "$0")/../support/harness.sh"
command -v jq > /dev/null || { echo "SKIP: jq is needed"; exit 77; }

# replay_names DIR RANK CASE: replay exits 1, its first MISSING_RANK finding names RANK, and
# any other rank it names is one blocked behind RANK.
replay_names() {
  local dir=$1 rank=$2 name=$3 out rc
  out=$("$seqpar" replay --json "$dir" 2> "$tmp/replay.err")
  rc=$?
  if [ "$rc" -ne 1 ]; then
    fail "$name: replay $dir exit $rc (want 1): $(head -3 "$tmp/replay.err")"
    return
  fi
  # The first hang finding names the rank; a rank blocked behind it may follow, as a
  # consequence (its cause says where it is blocked).
  local first others
  first=$(jq '[.problems[] | select(.category == "MISSING_RANK")][0].rank' <<< "$out")
  others=$(jq "[.problems[] | select(.category == \"MISSING_RANK\" and .rank != $rank and (.cause | test(\"is itself blocked in\") | not))] | length" <<< "$out")
  if [ "$first" != "$rank" ] || [ "$others" -ne 0 ]; then
    fail "$name: replay's first hang finding names rank $first (want $rank), $others other rank(s) named as causes: $(jq -c '[.problems[] | {category, rank, cause}]' <<< "$out" | head -c 900)"
  else ok; fi
}

# job_ends NAME MAX_S 'glob' -- command…: the job exits 2 within MAX_S seconds with *glob*.
job_ends() {
  local name=$1 max=$2 words=$3
  shift 4
  local t0 dt rc
  t0=$(date +%s)
  timeout 90 "$@" > "$tmp/$name.out" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  echo "$name: exit $rc after ${dt} s"
  if [ "$rc" -ne 2 ] || [ "$dt" -gt "$max" ] || [[ "$(cat "$tmp/$name.out")" != *$words* ]]; then
    fail "$name: exit $rc after ${dt} s (want 2 within $max s, output with '$words'): $(head -c 800 "$tmp/$name.out")"
    return 1
  fi
  ok
}

small=(--ulysses 2 --ring 2 --layers 1 --docs 8,12 --heads 4 --kv-heads 1)

# 1. Rank 2 stops itself (SIGSTOP) at three stages — its first Ulysses all-to-all (the group's
#    first contact), a ring step (send/recv) and the loss all_reduce: the others name it within
#    the 2 s deadline (plus start-up and the 3 s grace for acknowledgements).
for stage in L0.attn.q.fwd L0.attn.ring.fwd.step0 loss.sum; do
  dir="$tmp/stop-$stage"
  if job_ends "stop-$stage" 20 'the wait ends at rank 2 (silent for' -- \
      "$mpiexec" -n 4 "$failing" --stop-at "2:$stage" --timeout 2 --flight-record "$dir" "${small[@]}"; then
    files=$(ls "$dir" 2> /dev/null | tr '\n' ' ')
    [ "$files" = "rank-0.jsonl rank-1.jsonl rank-3.jsonl " ] && ok || fail "stop at $stage: flight records: '$files' (want ranks 0, 1, 3)"
    grep -q '"state":"started"' "$dir/rank-0.jsonl" "$dir/rank-3.jsonl" && ok || fail "stop at $stage: no call in flight in the records"
    replay_names "$dir" 2 "stop at $stage"
  fi
done

# 2. Rank 1 throws at loss.sum: every rank leaves its record; replay names rank 1, the one
#    that never made the call the others are inside.
if job_ends throw-at 20 'injected failure: rank 1 throws' -- \
    "$mpiexec" -n 2 "$failing" --throw-at 1:loss.sum --flight-record "$tmp/throw" --ulysses 2 --ring 1 --layers 1 --docs 9,6 --heads 4 --kv-heads 2; then
  [ "$(ls "$tmp/throw" | wc -l)" -eq 2 ] && ok || fail "throw-at: want 2 flight records, got: $(ls "$tmp/throw")"
  grep -q "Flight records of 2 rank(s)" "$tmp/throw-at.out" && ok || fail "throw-at: the error does not say where the records are"
  replay_names "$tmp/throw" 1 throw-at
fi

# 3. A real `seqpar check --backend mpi`: rank 2 is stopped from outside (SIGSTOP) once the SP
#    step has begun; the job ends naming it, and the replay of the records names it.
#    The SP step must outlast the stop's delay by far, even on a loaded machine (with the faster
#    attention, 6000 tokens took 0.9 s and the stop could land after it, where no watchdog runs).
big=(--ulysses 2 --ring 2 --layers 2 --docs 3000,3000 --heads 4 --kv-heads 2)
long=(--ulysses 4 --ring 1 --layers 2 --docs 8000,8000 --heads 4 --kv-heads 2)
#    Pure Ulysses (U 4): every rank waits for rank 2 in the same group. In the hybrid (U 2 × R 2)
#    a rank can wait for a member that itself waits for rank 2 in another group, and twice in CI
#    (with --timeout 2 and 6) rank 1 named rank 0 silent before any other rank's deadline named
#    rank 2 (rank 0 sent no heartbeat and left no flight record; not reproduced outside CI, see
#    docs/status.md).
(cd "$tmp" && exec "$mpiexec" -n 4 sh -c 'echo $$ > "pid.$PMI_RANK"; exec "$0" "$@"' "$seqpar" \
   check --backend mpi --timeout 6 --flight-record "$tmp/ext" "${long[@]}") > "$tmp/ext.out" 2>&1 &
job=$!
t0=$(date +%s)
for _ in $(seq 1 300); do
  grep -q "SP step" "$tmp/ext.out" 2> /dev/null && [ -f "$tmp/pid.2" ] && break
  sleep 0.05
done
sleep 0.3
if [ -f "$tmp/pid.2" ]; then
  kill -STOP "$(cat "$tmp/pid.2")"
  wait "$job"
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  kill -KILL "$(cat "$tmp/pid.2")" 2> /dev/null
  echo "external SIGSTOP: exit $rc after ${dt} s"
  if [ "$rc" -ne 2 ] || [ "$dt" -gt 30 ] || ! first_watchdog_names 2 "$tmp/ext.out"; then
    fail "external SIGSTOP: exit $rc after ${dt} s, want 2 naming rank 2: $(head -c 800 "$tmp/ext.out")"
  else
    ok
    [ ! -f "$tmp/ext/rank-2.jsonl" ] && [ -f "$tmp/ext/rank-0.jsonl" ] && ok || fail "external SIGSTOP: flight records: $(ls "$tmp/ext")"
    replay_names "$tmp/ext" 2 "external SIGSTOP"
  fi
else
  wait "$job"
  fail "external SIGSTOP: rank 2 never started: $(head -c 400 "$tmp/ext.out")"
fi

# 4. Not a stall: rank 0's reference (≈ 2 s) is longer than the 0.5 s deadline, but its
#    heartbeats keep the ranks waiting for the verdict from giving up.
out=$(cd "$tmp" && timeout 90 "$mpiexec" -n 4 "$seqpar" check --backend mpi -q --timeout 0.5 --flight-record "$tmp/none" "${big[@]}" 2>&1)
rc=$?
if [ "$rc" -ne 0 ] || [ -e "$tmp/none" ]; then
  fail "heartbeats: a slow reference with --timeout 0.5 exit $rc (want 0, no flight record): $(tail -c 600 <<< "$out")"
else ok; fi

finish

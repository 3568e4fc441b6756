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
  others=$(jq "[.problems[] | select(.category == \"MISSING_RANK\" and .rank != $rank and (.cause | test(\"is itself blocked in|a consequence of rank\") | not))] | length" <<< "$out")
  if [ "$first" != "$rank" ] || [ "$others" -ne 0 ]; then
    fail "$name: replay's first hang finding names rank $first (want $rank), $others other rank(s) named as causes: $(jq -c '[.problems[] | {category, rank, cause}]' <<< "$out" | head -c 900)"
  else ok; fi
}

# first_watchdog_names RANK FILE: the first watchdog message in FILE says where the wait
# ends: at RANK, silent.
first_watchdog_names() {
  local first
  first=$(grep -m1 "watchdog: " "$2")
  [[ "$first" == *"the wait ends at rank $1 (silent"* ]]
}

# launch NAME -- command…: starts the job in the background, each process writing its pid to
# $tmp/NAME.pid.<rank> (a shell that execs the command keeps its pid); output in $tmp/NAME.out.
launch() {
  local name=$1
  shift 2
  local mpiexec_=$1 np=$2 n=$3
  shift 3
  (cd "$tmp" && exec "$mpiexec_" "$np" "$n" sh -c "echo \$\$ > $name.pid.\$PMI_RANK; exec \"\$0\" \"\$@\"" "$@") \
    > "$tmp/$name.out" 2>&1 &
  job=$!
}

# wait_for NAME WORDS RANK: until the job's output has WORDS (none: "") and rank RANK's pid is
# known; 0 then, 1 when the job ends first or after 3× the healthy job's time on this machine
# (measured below, before the first use) plus 12 s. A loaded machine reaches a phase later: a
# fixed 12 s once read "the reference never started" beside two CPU hogs and a compiler, where
# the healthy job took 25 s.
wait_for() {
  local until=$((SECONDS + 3 * ${healthy:-0} + 12)) alive=1
  while [ $SECONDS -lt $until ] && [ $alive = 1 ]; do
    kill -0 "$job" 2> /dev/null || alive=0  # one more look after the job ended
    { [ -z "$2" ] || grep -q "$2" "$tmp/$1.out" 2> /dev/null; } && [ -f "$tmp/$1.pid.$3" ] && return 0
    sleep 0.02
  done
  return 1
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

# 3. A real `seqpar check --backend mpi` on the hybrid layout (U 2 × R 2): rank 2 is stopped
#    from outside (SIGSTOP) once the SP step has begun. A rank may wait for a member that itself
#    waits for rank 2 in another group: the watchdog follows the chain, so the first message
#    names rank 2 wherever the deadlines fire (tests/soak/stop_soak.py measures it over 200
#    random victims and moments). The replay of the records names it too.
hybrid=(--ulysses 2 --ring 2 --layers 2 --docs 8192,4096,4096)
# Time limits judge progress, not wall time alone: a verdict cannot come before the work the job
# does up to the fault, which a loaded machine stretches (loaded-test.sh runs this test beside a
# CPU hog on every core). The healthy run of the same job, timed now, is added to each limit
# below that covers the SP step or the reference.
t0=$(date +%s)
(cd "$tmp" && timeout 300 "$mpiexec" -n 4 "$seqpar" check --backend mpi -q "${hybrid[@]}" > /dev/null 2>&1)
healthy=$(( $(date +%s) - t0 ))
echo "the healthy hybrid job takes ${healthy} s here now"
launch ext -- "$mpiexec" -n 4 "$seqpar" check --backend mpi --timeout 4 --flight-record "$tmp/ext" "${hybrid[@]}"
t0=$(date +%s)
if wait_for ext "SP step" 2; then
  sleep 0.5
  kill -STOP "$(cat "$tmp/ext.pid.2")"
  wait "$job"
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  kill -KILL "$(cat "$tmp/ext.pid.2")" 2> /dev/null
  echo "external SIGSTOP: exit $rc after ${dt} s"
  if [ "$rc" -ne 2 ] || [ "$dt" -gt $((30 + healthy)) ] || ! first_watchdog_names 2 "$tmp/ext.out"; then
    fail "external SIGSTOP: exit $rc after ${dt} s, want 2 naming rank 2 first: $(grep -m1 watchdog "$tmp/ext.out" | head -c 800)"
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

# 5. Every phase (issue 33). Before MPI is up: rank 2 stops before MPI_Init, the others wait
#    inside it, where no heartbeat runs; the phase guard ends each of them at the deadline
#    (start-up's: at least 5 s, so that a busy node's slow spawn is not taken for a stop).
t0=$(date +%s)
timeout 60 "$mpiexec" -n 4 "$failing" --stop-at 2:init --timeout 2 "${small[@]}" > "$tmp/init.out" 2>&1
rc=$?
dt=$(( $(date +%s) - t0 ))
echo "stop before MPI_Init: exit $rc after ${dt} s"
if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || [ "$dt" -gt 25 ] || ! grep -q "watchdog: MPI_Init did not finish within 5 s" "$tmp/init.out"; then
  fail "stop before MPI_Init: exit $rc after ${dt} s: $(head -c 600 "$tmp/init.out")"
else ok; fi

# 6. The reference and the verdict's final reduction, stopped from outside when rank 0 starts
#    the non-SP reference: rank 0 itself (the others wait for the verdict, kept patient by its
#    heartbeats until they stop), or rank 2 (waiting in the verdict's reduction, which can then
#    never finish): the others name the stopped rank.
for victim in 0 2; do
  launch ref$victim -- "$mpiexec" -n 4 "$seqpar" check --backend mpi --timeout 2 --flight-record "$tmp/ref$victim" "${hybrid[@]}"
  if wait_for ref$victim "non-SP reference on rank 0" $victim; then
    kill -STOP "$(cat "$tmp/ref$victim.pid.$victim")"
    t0=$(date +%s)
    wait "$job"
    rc=$?
    dt=$(( $(date +%s) - t0 ))
    kill -KILL "$(cat "$tmp/ref$victim.pid.$victim")" 2> /dev/null
    echo "rank $victim stopped in the reference phase: exit $rc after ${dt} s"
    if [ "$rc" -ne 2 ] || [ "$dt" -gt $((20 + healthy)) ] || ! first_watchdog_names $victim "$tmp/ref$victim.out"; then
      fail "rank $victim stopped in the reference phase: exit $rc after ${dt} s: $(grep -m1 watchdog "$tmp/ref$victim.out" | head -c 600)"
    else ok; fi
  else
    wait "$job"
    fail "rank $victim stopped in the reference phase: the reference never started: $(tail -c 400 "$tmp/ref$victim.out")"
  fi
done

# 8. A flight record that cannot be written (a FIFO where rank 1's file goes: its write blocks
#    as on a stalled file system): rank 0 throws, rank 1 never acknowledges; the job still ends
#    within the 3 s grace, with the records of the others.
mkdir -p "$tmp/fifo"
launch fifo -- "$mpiexec" -n 4 "$failing" --throw-at 0:loss.sum --timeout 2 --flight-record "$tmp/fifo" "${hybrid[@]}"
if wait_for fifo "" 1; then
  mkfifo "$tmp/fifo/rank-1.jsonl.seqpar-tmp-$(cat "$tmp/fifo.pid.1")"
  t0=$(date +%s)
  wait "$job"
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  echo "stalled record: exit $rc after ${dt} s"
  recs=$(cd "$tmp/fifo" && ls rank-*.jsonl 2> /dev/null | tr '\n' ' ')
  # Exit 2 (the abort's code); on a loaded machine Hydra may report 9 instead, the SIGKILL it
  # had to send the rank blocked in its write (its own guard would end it only after 10 s).
  if { [ "$rc" -ne 2 ] && [ "$rc" -ne 9 ]; } || [ "$dt" -gt 25 ] || [ "$recs" != "rank-0.jsonl rank-2.jsonl rank-3.jsonl " ] || ! grep -q "injected failure: rank 0 throws" "$tmp/fifo.out"; then
    fail "stalled record: exit $rc after ${dt} s, records '$recs': $(head -c 600 "$tmp/fifo.out")"
  else ok; fi
else
  wait "$job"
  fail "stalled record: the job never started: $(head -c 400 "$tmp/fifo.out")"
fi

finish

#!/usr/bin/env bash
# `seqpar check --backend mpi` under mpiexec: the same rows as --backend sim (bitwise: both sum
# in group order), exit 2 with the fix when P != U·R, and no hang when a rank throws or dies.
# The failing ranks run the same distributed check in failing_rank_check, whose communicator
# wrapper throws or raises SIGKILL at a chosen call (tests/support/failing_comm.hpp).
# Usage: check-mpi-test.sh path/to/seqpar path/to/mpiexec path/to/failing_rank_check \
#          path/to/stop_in_launcher_barrier.so
set -u
seqpar=$1
mpiexec=${2:-mpiexec}
failing=$3
stop_so=$4
. "$(dirname "$0")/../support/harness.sh"

# rows_equal NAME NP -- scenario flags: --backend mpi on NP processes gives sim's rows exactly.
rows_equal() {
  local name=$1 np=$2
  shift 3
  local t0 rc
  "$seqpar" check --backend sim --json -q "$@" > "$tmp/$name.sim.json" 2> "$tmp/$name.sim.err"
  rc=$?
  [ "$rc" -eq 0 ] || { fail "$name: sim exit $rc: $(head -3 "$tmp/$name.sim.err")"; return; }
  t0=$(date +%s%N)
  timeout 60 "$mpiexec" -n "$np" "$seqpar" check --backend mpi --json -q "$@" \
    > "$tmp/$name.mpi.json" 2> "$tmp/$name.mpi.err"
  rc=$?
  echo "$name: mpiexec -n $np … exit $rc in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  [ "$rc" -eq 0 ] || { fail "$name: mpi exit $rc: $(head -5 "$tmp/$name.mpi.err")"; return; }
  [ "$(wc -l < "$tmp/$name.mpi.json")" -eq 1 ] || { fail "$name: more than one report (only rank 0 prints)"; return; }
  [ "$(jq -r .backend "$tmp/$name.mpi.json")" = mpi ] || { fail "$name: backend is not mpi"; return; }
  if ! diff <(jq -S -c '{pass, dtype, scenario, tolerance, rows}' "$tmp/$name.sim.json") \
            <(jq -S -c '{pass, dtype, scenario, tolerance, rows}' "$tmp/$name.mpi.json") > /dev/null; then
    fail "$name: mpi rows differ from sim rows"
    diff <(jq -c '.rows[]' "$tmp/$name.sim.json") <(jq -c '.rows[]' "$tmp/$name.mpi.json") | head -6
    return
  fi
  [ "$(jq '.rows | length' "$tmp/$name.mpi.json")" -ge 10 ] || { fail "$name: too few rows"; return; }
  ok
}

# xorl picks async Ulysses here (U 2 <= Hkv 2): nonblocking all-to-alls through MPI_Ialltoallv.
rows_equal ulysses2 2 -- --ulysses 2 --ring 1 --layers 1 --docs 9,6 --heads 4 --kv-heads 2
# Async forced with U 4 > Hkv 2 (K, V repeated before their all-to-alls), biases, LayerNorm q/k.
rows_equal async4-veomni 4 -- --profile veomni --ulysses 4 --ring 1 --layers 2 --docs 9,14,3 \
  --heads 8 --kv-heads 2 --qkv-bias --o-bias --qk-norm-type layernorm --ulysses-strategy async
rows_equal ulysses2-f32-veomni 2 -- --profile veomni --ulysses 2 --ring 1 --layers 1 --docs 7,4 --heads 4 --kv-heads 2 --dtype f32
rows_equal hybrid4 4 -- --ulysses 2 --ring 2 --layers 1 --docs 8,12 --heads 4 --kv-heads 1
# GatedDeltaNet: Qwen3.5's hybrid (three linear layers, one softmax) on 4 processes.
rows_equal qwen3.5 4 -- --scenario qwen3.5
# DeepSpeed ALST: the micro-step's rows and the SP-over-DP rows (every micro-step's SP step run
# by the processes, DP over the same samples on rank 0) equal the in-process check's.
rows_equal alst4-sp-over-dp 4 -- --profile deepspeed --layers 1
if [ "$(jq '[.rows[] | select(.tensor | startswith("sp_over_dp"))] | length' "$tmp/alst4-sp-over-dp.mpi.json")" -ge 5 ]; then
  ok
else fail "alst4: the MPI check has no SP-over-DP rows"; fi

# The report of rank 0 only, in text form, and the exit code every process agrees on.
out=$(timeout 60 "$mpiexec" -n 2 "$seqpar" check --backend mpi -q --ulysses 1 --ring 2 --layers 1 --docs 8,4 --ring-backward ring 2>&1)
rc=$?
if [ "$rc" -ne 0 ] || [ "$(grep -c '^PASS:' <<< "$out")" -ne 1 ]; then
  fail "text report under mpiexec -n 2 (exit $rc): $(tail -3 <<< "$out")"
else ok; fi

# expect_exit CODE "words" NP -- args: exit code, message printed exactly once.
expect_exit() {
  local code=$1 words=$2 np=$3
  shift 4
  local out rc
  out=$(timeout 60 "$mpiexec" -n "$np" "$seqpar" "$@" 2>&1)
  rc=$?
  if [ "$rc" -ne "$code" ] || [[ "$out" != *"$words"* ]]; then
    fail "mpiexec -n $np seqpar $* → exit $rc (want $code), output lacks '$words': $(head -5 <<< "$out")"
  elif [ "$(grep -c "seqpar: error" <<< "$out")" -ne 1 ]; then
    fail "mpiexec -n $np seqpar $*: the error should be printed once: $out"
  else ok; fi
}
expect_exit 2 "mpiexec started P=2 processes but --backend mpi runs one cp rank per process and ulysses U=2 × ring R=2 needs 4; launch mpiexec -n 4" \
  2 -- check --backend mpi --ulysses 2 --ring 2 --docs 8 --layers 1
expect_exit 2 "mpiexec started P=2 processes but --backend mpi runs one cp rank per process and ulysses U=1 × ring R=1 needs 1; launch mpiexec -n 1" \
  2 -- check --backend mpi --ulysses 1 --ring 1 --docs 8 --layers 1
expect_exit 2 "num_heads=6 is not divisible by ulysses=4" 4 -- check --backend mpi --ulysses 4 --heads 6 --kv-heads 6
expect_exit 2 "--dtype 'f16' is unknown" 2 -- check --backend mpi --ulysses 2 --dtype f16

# failing_job NAME NP 'glob' -- failing_rank_check args…: the job ends (not 0, not the
# timeout) within 20 s, and its output matches *glob*.
failing_job() {
  local name=$1 np=$2 words=$3
  shift 4
  local t0 out rc dt
  t0=$(date +%s)
  out=$(timeout 60 "$mpiexec" -n "$np" "$failing" "$@" 2>&1)
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  echo "$name: exit $rc after ${dt} s"
  if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || [ "$dt" -gt 20 ] || [[ "$out" != *$words* ]]; then
    fail "$name: exit $rc after ${dt} s: $(head -12 <<< "$out")"
  else ok; fi
}

# A rank that throws mid-run: it prints the error naming itself and aborts the job (MPI_Abort),
# the other ranks do not wait in the collective.
failing_job "throwing rank" 2 \
  'seqpar: error: rank 1 on *injected failure: rank 1 throws at all_reduce (loss.sum)' \
  -- --throw-at 1:loss.sum --ulysses 2 --ring 1 --layers 1 --docs 9,6 --heads 4 --kv-heads 2

# A failing check names where the step first departs, under MPI as in one process: every
# process reruns its rank's step with its collectives, layer boundaries and attention stages
# recorded, and rank 0 judges them all. Each transport fault kind (all-to-all, ring message,
# reduction, all-gather): the same first departure and note as --backend sim.
hybrid=(--ulysses 2 --ring 2 --layers 1 --docs 8,12 --heads 4 --kv-heads 1)
for f in drop_chunk:rank=1 duplicate_chunk:rank=2 permute_chunks:rank=0 swap_peers:rank=3 \
         drop_chunk:op=send_recv,rank=2 drop_chunk:op=all_reduce,rank=1 \
         duplicate_chunk:op=all_gather,rank=0; do
  "$seqpar" check --json -q "${hybrid[@]}" --fault "$f" > "$tmp/dep.sim.json" 2> /dev/null
  timeout 60 "$mpiexec" -n 4 "$seqpar" check --backend mpi --json -q "${hybrid[@]}" \
    --fault "$f" > "$tmp/dep.mpi.json" 2> "$tmp/dep.mpi.err"
  rc=$?
  sim=$(jq -c '[.first_departure, .departure_note]' "$tmp/dep.sim.json")
  mpi=$(jq -c '[.first_departure, .departure_note]' "$tmp/dep.mpi.json" 2> /dev/null)
  line=$(jq -r '.[0].line // empty' <<< "$mpi" 2> /dev/null)
  if [ "$rc" -ne 1 ] || [[ "$line" != "first departure: "* ]]; then
    fail "--fault $f under mpi: exit $rc (want 1) and no first departure: $(head -3 "$tmp/dep.mpi.err")"
  elif [ "$sim" != "$mpi" ]; then
    fail "--fault $f: mpi's first departure differs from sim's: $mpi vs $sim"
  else ok; fi
done
# A compute bug (no collective departs): the layer boundaries and the attention's stages of
# every process, judged on rank 0, name the KV heads repeated blockwise on the right ranks.
out=$(timeout 60 "$mpiexec" -n 4 "$failing" --bug kv_heads_repeated_blockwise --ulysses 4 \
  --ring 1 --heads 8 --kv-heads 2 --docs 9,14,3 2> "$tmp/bug.err")
rc=$?
want="in attention: call L0.attn first differs at stage k.gathered on ranks 1, 2"
if [ "$rc" -ne 1 ] || [[ "$out" != *"all 36 collectives of the SP step delivered what their senders sent; layer L0, forward"* ]] \
   || [[ "$out" != *"$want"* ]] || [[ "$out" != *"holds KV head 1 where head 0 was expected"* ]]; then
  fail "compute bug under mpi (exit $rc): $out $(head -3 "$tmp/bug.err")"
else ok; fi

# A rank stopped past the job's last barrier, inside the launcher's final one (its request sent):
# the others end; after 10 s stopped its sentinel resumes it and it ends with the verdict's
# code, so mpiexec exits 0 for the PASS it printed (killed instead, the job exited 9), the whole
# job within 30 s. The count of launcher barriers (MPI_Init makes some) is the MPI's: counted on
# a healthy run first, the last one is where the rank stops.
stop_env=(-genv LD_PRELOAD "$stop_so" -genv SEQPAR_STOP_RANK 1)
stop_args=(check --backend mpi -q --timeout 2 --ulysses 2 --ring 2 --layers 1 --docs 8,12 --heads 4 --kv-heads 1)
# stopped_job WHAT COUNT_ENV LINE STOP_ENV [-genv NAME VALUE…]: counts rank 1's LINEs on a
# healthy run (COUNT_ENV set), stops it at the last one (STOP_ENV = the count) and wants the
# PASS, exit 0 and 10-30 s (resumed by its sentinel after 10 s).
stopped_job() {
  local what=$1 count_env=$2 line=$3 stop_at=$4
  shift 4
  timeout 60 "$mpiexec" -n 4 "${stop_env[@]}" -genv "$count_env" 1 "$seqpar" "${stop_args[@]}" \
    > /dev/null 2> "$tmp/count.err"
  local last t0 rc took
  last=$(grep -c "^$line\$" "$tmp/count.err")
  t0=$(date +%s%N)
  timeout 60 "$mpiexec" -n 4 "${stop_env[@]}" -genv "$stop_at" "$last" "$@" "$seqpar" \
    "${stop_args[@]}" > "$tmp/stopped.out" 2> "$tmp/stopped.err"
  rc=$?
  took=$(( ($(date +%s%N) - t0) / 1000000 ))
  echo "$what ($line $last of rank 1): exit $rc in $took ms"
  if [ "$last" -lt 1 ] || [ "$rc" -ne 0 ] || ! grep -q '^PASS:' "$tmp/stopped.out" \
     || [ "$took" -lt 9000 ] || [ "$took" -gt 30000 ]; then
    fail "$what: exit $rc (want the verdict's 0) after $took ms (want 10-30 s: resumed by its" \
      "sentinel after 10 s), $last of $line counted: $(tail -3 "$tmp/stopped.err")"
  else ok; fi
}
stopped_job "stopped past the last barrier" SEQPAR_COUNT_BARRIERS barrier_in SEQPAR_STOP_AT

# A rank stopped inside the job's last MPI barrier (its arrival sent: the others pass it), before
# its job is finished, then resumed by its sentinel and starved for 1 s: it comes to the
# launcher's final barrier after the others' guards on that barrier have ended them. It must
# not enter it (completed then, mpiexec wrote its answer to their closed proxies and exited 255
# after a PASS): it ends with the verdict's code, mpiexec exits 0 within 30 s. Its last
# point-to-point send is its arrival there, counted on a healthy run first.
stopped_job "stopped inside the last MPI barrier, resumed late" SEQPAR_COUNT_ISENDS isend \
  SEQPAR_STOP_ISEND -genv SEQPAR_RESUME_LAG_MS 1000

# A rank killed by SIGKILL mid-run (n = 4, inside the hybrid step): mpiexec ends the job.
failing_job "killed rank" 4 'BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES' \
  -- --die-at 3:loss.sum --ulysses 2 --ring 2 --layers 1 --docs 8,12 --heads 4 --kv-heads 1

finish

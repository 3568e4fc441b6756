#!/usr/bin/env bash
# Every CPU benchmark of issue 12 in one run, in turn, on an otherwise idle machine: the numbers
# of docs/benchmarks.md come from one invocation of this script.
#   bench/run_all.sh [OUT_DIR] [--quick] [--then]
# OUT_DIR (default bench-run-<date>) receives each program's table (NAME.txt) and JSON report
# (NAME.json), run.log (what ran, when, the machine) and, from bench/report.py, report.md (the
# tables docs/benchmarks.md shows) and scale.svg (time and bytes per token against tokens).
#   --quick  small sizes (minutes; a smoke run of the whole chain, not numbers to quote)
#   --then   also bench/property_then_now.sh: property throughput against the tree issue 12 was
#            measured on, and against the first tree with the async generator (builds those
#            trees once, in /tmp; ~5 minutes more)
# Exit status: 0, 1 when a program reports #wrong > 0, 2 on a usage error or a failed program.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="" quick=() then=0
for a in "$@"; do
  case "$a" in
    --quick) quick=(--quick) ;;
    --then) then=1 ;;
    -h | --help)
      sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    -*)
      echo "run_all: unknown flag '$a' (flags: --quick, --then)" >&2
      exit 2
      ;;
    *) out=$a ;;
  esac
done
out=${out:-bench-run-$(date +%Y%m%d-%H%M%S)}
if [ -e "$out" ] && [ -n "$(ls -A "$out" 2>/dev/null)" ]; then
  echo "run_all: '$out' exists and is not empty; name a new directory (a run never mixes with" \
    "another's files)" >&2
  exit 2
fi
mkdir -p "$out" || exit 2
build=${BUILD_DIR:-$root/build}
[ -f "$build/build.ninja" ] || { echo "run_all: no build in $build (run ./setup.sh first)" >&2; exit 2; }
echo "run_all: building the benchmarks (ninja -C $build bench)" >&2
ninja -C "$build" bench >/dev/null || { echo "run_all: the benchmarks did not build" >&2; exit 2; }

log=$out/run.log
{
  echo "# bench/run_all.sh ${quick[*]} $([ "$then" = 1 ] && echo --then)"
  echo "tree: $(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet || echo '+changes')"
  echo "start: $(date -u +%FT%TZ)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
  echo "memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$log"

worst=0
# step NAME PROGRAM ARGS…: the table to NAME.txt (and the terminal), the report to NAME.json.
step() {
  local name=$1 prog=$2
  shift 2
  echo "run_all: $name ($prog $*)" >&2
  local t0=$SECONDS rc
  "$build/bench/$prog" "$@" "${quick[@]}" -J "$out/$name.json" | tee "$out/$name.txt"
  rc=${PIPESTATUS[0]}
  echo "$name: $prog $* ${quick[*]} -> exit $rc in $((SECONDS - t0)) s" >>"$log"
  if [ "$rc" -gt "$worst" ]; then worst=$rc; fi
}

step isa_and_attention attention_bench
step a2a_2ranks a2a_bench -t 2
step a2a_4ranks a2a_bench -t 4
step reference_threads reference_bench
if [ ${#quick[@]} -eq 0 ]; then
  # The issue's 32K check (documents 16384, 8192, 8192): whole check on 1 thread vs every core.
  step whole_check_threads reference_bench --whole-check -b 16M -e 16M
else
  step whole_check_threads reference_bench --whole-check
fi
step scale scale_bench
step departure departure_bench
step window window_bench
# The float64 oracle's attention per option against native GEMM: the scenario's head_dim 16, and
# today's models' 64.
step oracle_options oracle_bench
if [ ${#quick[@]} -eq 0 ]; then
  step oracle_options_d64 oracle_bench --head-dim 64 -b 16M -e 32M
fi
if [ ${#quick[@]} -eq 0 ]; then
  step import import_bench -b 16M -e 1G -f 4   # the issue's 1 GB per-rank profiler trace
else
  step import import_bench
fi
step property_throughput property_bench
if [ "$then" = 1 ]; then
  echo "run_all: property_then_now" >&2
  t0=$SECONDS
  # The tree issue 12 was measured on (ulysses, ring), and the first tree with the async
  # generator (async Ulysses came after issue 12 was filed).
  sizes=()
  [ ${#quick[@]} -eq 0 ] || sizes=(20 1)
  rc=0
  for rev in "65daf39^" 970f46d; do
    "$root/bench/property_then_now.sh" "$rev" "${sizes[@]}" | tee -a "$out/property_then_now.txt"
    st=${PIPESTATUS[0]}
    if [ "$st" -gt "$rc" ]; then rc=$st; fi
    echo >>"$out/property_then_now.txt"
  done
  echo "property_then_now: exit $rc in $((SECONDS - t0)) s" >>"$log"
  if [ "$rc" -gt "$worst" ]; then worst=$rc; fi
fi
echo "end: $(date -u +%FT%TZ)" >>"$log"

python3 "$root/bench/report.py" "$out" || worst=2
echo "run_all: $out/report.md, $out/scale.svg (exit $worst)" >&2
exit "$worst"

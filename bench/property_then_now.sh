#!/usr/bin/env bash
# Property throughput then and now: the same generated scenarios (the property suite's ulysses
# and ring generators, fixed seeds) through verify::run_check with its default options, built
# from an earlier tree and from this one, timed in turns in the same run (issue 12's "2× today's":
# the default REV is the tree issue 12 was measured on, before any of its changes).
#   bench/property_then_now.sh [REV] [COUNT] [ROUNDS]
# The earlier tree is exported (git archive) to $THEN_DIR (default /tmp/seqpar-then-REV) and
# configured with its own defaults; bench/property_rate.cpp is built in both.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rev=${1:-65daf39^}
count=${2:-200}
rounds=${3:-3}
short=$(git -C "$root" rev-parse --short "$rev")
then_dir=${THEN_DIR:-/tmp/seqpar-then-$short}
if [ ! -f "$then_dir/meson.build" ]; then
  mkdir -p "$then_dir"
  git -C "$root" archive "$short" | tar -x -C "$then_dir"
fi
cp "$root/bench/property_rate.cpp" "$then_dir/bench/property_rate.cpp"
grep -q "'property_rate'" "$then_dir/bench/meson.build" ||
  echo "executable('property_rate', 'property_rate.cpp', build_by_default : false," \
    "include_directories : include_directories('..'), dependencies : [verify_dep, rc_dep])" \
    >>"$then_dir/bench/meson.build"
[ -f "$then_dir/build/build.ninja" ] || meson setup "$then_dir/build" "$then_dir" >/dev/null
echo "property_then_now: building $short (then) and this tree (now)" >&2
ninja -C "$then_dir/build" bench/property_rate >/dev/null
ninja -C "$root/build" bench/property_rate >/dev/null
then_bin=$then_dir/build/bench/property_rate
now_bin=$root/build/bench/property_rate
echo "# scenarios/s of run_check with default options; $count scenarios per run, $rounds rounds, then/now in turns"
echo "# then = $short, now = $(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet || echo '+changes')"
printf '%-8s %5s %10s %10s %7s\n' generator round then now ratio
for g in ulysses ring async; do
  for r in $(seq 1 "$rounds"); do
    rc=0
    t=$("$then_bin" "$g" "$count" 1 2>/dev/null | awk '{print $4}') || rc=$?
    if [ "$rc" -eq 3 ]; then
      echo "$g: not in $short (measure against a later REV)"
      break
    fi
    n=$("$now_bin" "$g" "$count" 1 | awk '{print $4}')
    printf '%-8s %5d %10.1f %10.1f %7.2f\n' "$g" "$r" "$t" "$n" "$(awk -v a="$n" -v b="$t" 'BEGIN{print a/b}')"
  done
done

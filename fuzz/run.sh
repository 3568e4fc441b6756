#!/usr/bin/env bash
# fuzz/run.sh SECONDS [JOBS]: builds the libFuzzer harness with clang in build-fuzz/ and fuzzes
# the trace and batch readers for SECONDS (default 60) with bounded memory, seeded with the
# traces of traces/ and the collate fixtures. Crashes land in build-fuzz/fuzz-artifacts/.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
jobs=${2:-1}
if [ ! -f build-fuzz/build.ninja ]; then
  CXX=clang++ CC=clang meson setup build-fuzz -Dfuzz=enabled -Dtests=disabled -Dgpu=disabled \
    -Dmpi=disabled >/dev/null
fi
ninja -C build-fuzz fuzz/trace_fuzz
corpus=build-fuzz/fuzz-corpus
seeds=build-fuzz/fuzz-seeds
mkdir -p "$corpus" "$seeds" build-fuzz/fuzz-artifacts
# Seeds: byte 0 selects the target (even: trace reader + replay, odd: batch reader).
for f in traces/*.jsonl; do
  { printf '\x00'; head -c 60000 "$f"; } >"$seeds/trace-$(basename "$f")"
done
i=0
for f in tests/equivalence/data/collate/*.json; do
  [ -f "$f" ] || continue
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); b=d.get("batch", d.get("input", d)); sys.stdout.buffer.write(b"\x01"+json.dumps(b).encode()[:20000])' "$f" \
    >"$seeds/batch-$i.json" 2>/dev/null || rm -f "$seeds/batch-$i.json"
  i=$((i + 1))
  [ $i -ge 8 ] && break
done
printf '\x01{"input_ids":[1,2,3],"labels":[2,3,-100],"position_ids":[0,1,2]}' >"$seeds/batch-min.json"
par=()
# -jobs>1 forks workers that log to fuzz-N.log in the current directory: run them in build-fuzz.
[ "$jobs" -gt 1 ] && par=(-jobs="$jobs" -workers="$jobs")
cd build-fuzz
exec fuzz/trace_fuzz -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -max_len=65536 \
  "${par[@]}" -print_final_stats=1 -artifact_prefix=fuzz-artifacts/ fuzz-corpus fuzz-seeds

#!/usr/bin/env bash
# validate --dump at scale: synthetic dumps (bench/dump_gen: 32 heads / 8 KV heads, head_dim 128,
# bf16, U 8 × R 4 or U 32), healthy and with a one-token-per-document bug, checked in sampled
# mode; wall time, peak RSS against the largest rank's files, rows checked, and whether the bug
# was caught. Usage: bench/dump_scale.sh BUILD OUT_DIR [TOKENS...] (default 8192 32768 131072).
# A dump of 1M tokens needs ~45 GB of disk with --stages local (DUMP_STAGES=local).
set -euo pipefail
build=$1 out=$2
shift 2
sizes=("${@:-8192 32768 131072}")
[ $# -eq 0 ] && sizes=(8192 32768 131072)
work=${DUMP_SCALE_WORK:-/tmp/seqpar-dump-scale}
stages=${DUMP_STAGES:-all}
layouts=${DUMP_LAYOUTS:-"8x4 32x1"}
mkdir -p "$out" "$work"
csv=$out/dump_scale.csv
echo "tokens,layout,variant,stages,mode,wall_s,peak_rss_mb,dump_mb,largest_rank_mb,rss_over_rank,rows_checked,verdict,first_stage" >"$csv"
for S in "${sizes[@]}"; do
  for lay in $layouts; do
    U=${lay%x*} R=${lay#*x}
    for variant in none last-token; do
      d=$work/d_${S}_${lay}_${variant}
      rm -rf "$d"
      "$build/tools/dump_gen" --out "$d" --tokens "$S" --ulysses "$U" --ring "$R" --bug "$variant" \
        --stages "$stages" >/dev/null
      dump_mb=$(du -sm "$d" | cut -f1)
      largest=$(for r in "$d"/rank*/; do du -sm "$r" | cut -f1; done | sort -n | tail -1)
      sync
      /usr/bin/time -f "%e %M" -o "$work/time" "$build/tools/seqpar" validate --dump "$d" --sample \
        --json --quiet >"$work/report.json" || true
      read -r wall rss_kb < <(tail -1 "$work/time")
      python3 - "$work/report.json" "$S" "$lay" "$variant" "$stages" "$wall" "$rss_kb" "$dump_mb" "$largest" >>"$csv" <<'PY'
import json, sys
rep = json.load(open(sys.argv[1]))
S, lay, var, st, wall, rss_kb, dump_mb, largest = sys.argv[2:]
rss = int(rss_kb) / 1024
f = rep["first_difference"]
print(f"{S},{lay},{var},{st},{rep['mode']},{wall},{rss:.0f},{dump_mb},{largest},{rss/max(int(largest),1):.2f},"
      f"{(rep.get('sampling') or {}).get('rows_checked', '')},{'PASS' if rep['pass'] else 'FAIL'},{f['stage'] if f else ''}")
PY
      tail -1 "$csv"
      rm -rf "$d"
    done
  done
done
echo "wrote $csv"

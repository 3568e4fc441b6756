#!/usr/bin/env bash
# fuzz/run.sh SECONDS [JOBS]: builds the libFuzzer harness with clang in build-fuzz/ and fuzzes
# every reader of user files (trace reader + replay, batch and DeepSpeed sample readers, the
# Flight Recorder, profiler and NCCL log importers, the flight-record merge, the safetensors
# reader, a whole tensor dump directory) for SECONDS
# (default 60) with bounded memory, seeded with the committed traces, import samples and
# fixtures. Crashes land in build-fuzz/fuzz-artifacts/.
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
# Importers (byte 0: 2 Flight Recorder, 3 profiler, 4 NCCL log), the DeepSpeed samples reader (5)
# and the flight-record merge (6: two files cut at a 0xff byte), seeded from the committed real
# samples.
seed() {  # seed SELECTOR NAME FILE
  { printf "\\x$1"; head -c 60000 "$3"; } >"$seeds/$2"
}
for f in traces/import-samples/fr*/*.json; do seed 02 "fr-$(basename "$(dirname "$f")")-$(basename "$f")" "$f"; done
for f in traces/import-samples/kineto*/*.json traces/import-samples/profiler_legacy_*/*.json; do
  seed 03 "prof-$(basename "$(dirname "$f")")-$(basename "$f")" "$f"
done
# The real torch ~2.0 and newer-format traces (gzipped as published): a gzip seed and the head of
# its JSON (the one-pass scanner and the torch ~2.0 path).
for f in traces/import-samples/kineto_*/*.json.gz; do
  seed 03 "prof-gz-$(basename "$(dirname "$f")")-$(basename "$f")" "$f"
  { printf '\x03'; gzip -dc "$f" | head -c 60000 || true; } >"$seeds/prof-json-$(basename "$(dirname "$f")")-$(basename "$f" .gz)"
done
for f in traces/import-samples/nccl/*.log; do seed 04 "nccl-$(basename "$f")" "$f"; done
for f in tests/equivalence/data/deepspeed/*.json; do
  [ -f "$f" ] || continue
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); b=d.get("input", d.get("samples", d)); sys.stdout.buffer.write(b"\x05"+json.dumps(b).encode()[:20000])' "$f" \
    >"$seeds/ds-$(basename "$f")" 2>/dev/null || rm -f "$seeds/ds-$(basename "$f")"
done
real=(traces/*real_gloo*.jsonl)
if [ ${#real[@]} -ge 2 ]; then
  { printf '\x06'; head -c 30000 "${real[0]}"; printf '\xff'; head -c 30000 "${real[1]}"; } >"$seeds/merge-0"
fi
# The safetensors reader (7): small files written with Python's struct and json, as the dump hook
# writes them (F32 + I64 + metadata; BF16, F16, a scalar, an empty tensor, unpadded).
python3 - "$seeds" <<'EOF'
import json, struct, sys
def st(tensors, meta=None, pad=True):
    h, data = {}, b""
    if meta is not None:
        h["__metadata__"] = meta
    for name, dtype, shape, raw in tensors:
        h[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    j = json.dumps(h).encode()
    j += b" " * (-len(j) % 8 if pad else 0)
    return b"\x07" + struct.pack("<Q", len(j)) + j + data
seeds = {
    "st-f32-i64": st([("q.local", "F32", [2, 2], struct.pack("<4f", 1.5, -2.0, 0.0, 3.25)),
                      ("ids", "I64", [3], struct.pack("<3q", -1, 0, 2**40))], {"format": "pt"}),
    "st-half": st([("out.attn", "BF16", [2, 3],
                    struct.pack("<6H", 0x3f80, 0xc020, 0x7f80, 0xffc0, 1, 0)),
                   ("lse", "F16", [], struct.pack("<H", 0x3c00)),
                   ("empty", "F64", [0, 4], b""),
                   ("m", "U8", [2], b"\x01\xff"), ("b", "BOOL", [1], b"\x01")], pad=False),
}
for name, b in seeds.items():
    open(f"{sys.argv[1]}/{name}", "wb").write(b)
EOF
# A whole dump directory (8): a committed dump's rank-0 meta made a one-rank layout over its own
# tokens, 0xff, then the forward (or backward) file of its first call.
python3 - "$seeds" tests/equivalence/data/dumps <<'EOF'
import json, os, sys
seeds, root = sys.argv[1], sys.argv[2]
for name in sorted(os.listdir(root)):
    meta = os.path.join(root, name, "rank0.json")
    if not os.path.isfile(meta):
        continue
    m = json.load(open(meta))
    n = m["cu_seqlens"][-1] // max(1, m["ulysses"] * m["ring"])
    cu = [c for c in m["cu_seqlens"] if c < n] + [n]
    pos = [t - cu[d] for d in range(len(cu) - 1) for t in range(cu[d], cu[d + 1])]
    m.update(world_size=1, ulysses=1, ring=1, ulysses_rank=0, ring_rank=0, cu_seqlens=cu,
             position_ids=pos)
    for side in ("forward", "backward"):
        f = m["calls"][0].get(side)
        if not f:
            continue
        raw = open(os.path.join(root, name, f), "rb").read()
        if len(raw) > 60000:
            continue
        one = dict(m, calls=[{"index": 0, "name": "L0.attn", side: "rank0/t.safetensors"}])
        open(f"{seeds}/dump-{name}-{side}", "wb").write(b"\x08" + json.dumps(one).encode() + b"\xff" + raw)
EOF
par=()
# -jobs>1 forks workers that log to fuzz-N.log in the current directory: run them in build-fuzz.
[ "$jobs" -gt 1 ] && par=(-jobs="$jobs" -workers="$jobs")
cd build-fuzz
exec fuzz/trace_fuzz -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -max_len=65536 \
  "${par[@]}" -print_final_stats=1 -artifact_prefix=fuzz-artifacts/ fuzz-corpus fuzz-seeds

#!/usr/bin/env bash
# seqpar validate --dump: exit codes (0 pass, 1 a difference, 2 invalid input), the diagnosis on
# stdout, the HTML report, one clear message for every invalid dump, no partial output file.
# Usage: dump_cli-test.sh path/to/seqpar SOURCE_DIR
set -u
seqpar=$1
dumps=$2/tests/equivalence/data/dumps
. "$(dirname "$0")/../support/harness.sh"

healthy=$(ls "$dumps" | grep -m1 '^ulysses-healthy_u4-f32')
expect 0 "PASS: " -- validate --dump "$dumps/$healthy" -q
expect 0 '"pass":true' -- validate --dump "$dumps/$healthy" -q --json
expect 1 "repeated blockwise" -- validate --dump "$dumps/ulysses-blockwise_repeat-f32" -q
expect 1 "stage layout" -- validate --dump "$dumps/ring-zigzag_swapped-f32" -q
expect 1 '"first_difference":{' -- validate --dump "$dumps/ring-local_cu-f32" -q --json

# The HTML report: written on pass and on a difference, with the grid and the diagnosis.
expect 1 "FAIL" -- validate --dump "$dumps/ulysses-no_scale-f32" -q --html "$tmp/r.html"
if grep -q "scores not multiplied by the scale" "$tmp/r.html" && grep -q 'class="f first"' "$tmp/r.html"; then
  ok
else
  fail "the HTML report lacks the diagnosis or the outlined first difference"
fi

# Invalid input: exit 2, one message naming the file and the rule, no report file left.
expect 2 "not a directory" -- validate --dump "$tmp/nowhere" --html "$tmp/none.html"
[ ! -e "$tmp/none.html" ] && ok || fail "an HTML file was left after invalid input"
mkdir -p "$tmp/empty"
expect 2 "no rank*.json meta files" -- validate --dump "$tmp/empty"
cp -r "$dumps/$healthy" "$tmp/d1"
echo '{"schema": "seqpar-dump/1", "rank": 0' >"$tmp/d1/rank0.json"
expect 2 "rank0.json: not valid JSON" -- validate --dump "$tmp/d1"
cp -r "$dumps/$healthy" "$tmp/d2"
sed -i 's/"schema": *"seqpar-dump\/1"/"schema": "seqpar-dump\/9"/' "$tmp/d2/rank2.json"
expect 2 "is not seqpar-dump/1" -- validate --dump "$tmp/d2"
# Numbers that do not fit (found by the fuzzer: a float such as 1e70 read as an int was
# undefined behaviour): named with the range.
cp -r "$dumps/$healthy" "$tmp/d2b"
sed -i 's/"heads": *[0-9]*/"heads": 1e70/' "$tmp/d2b/rank1.json"
expect 2 '"heads" is 1e+70 where an integer in [-2147483648, 2147483647] was expected' -- validate --dump "$tmp/d2b"
# padding_from must be one of the documents' boundaries (where the kernel's cu_seqlens end).
cp -r "$dumps/$healthy" "$tmp/d2c"
for m in "$tmp"/d2c/rank*.json; do
  sed -i 's/"cu_seqlens":/"padding_from": 7, "cu_seqlens":/' "$m"
done
expect 2 "padding_from=7 must be one of cu_seqlens" -- validate --dump "$tmp/d2c"
cp -r "$dumps/$healthy" "$tmp/d3"
head -c 100 "$dumps/$healthy/rank1/call0000.fwd.safetensors" >"$tmp/d3/rank1/call0000.fwd.safetensors"
expect 2 "call0000.fwd.safetensors" -- validate --dump "$tmp/d3" --html "$tmp/d3.html"
[ ! -e "$tmp/d3.html" ] && ok || fail "an HTML file was left after a truncated tensor file"
cp -r "$dumps/$healthy" "$tmp/d4"
rm "$tmp/d4/rank3.json"
expect 2 "no meta for cp rank 3" -- validate --dump "$tmp/d4"
# A dump without the output: nothing computed could be compared, so no verdict.
cp -r "$dumps/ring-healthy_r2-f32" "$tmp/d5"
for k in 0 1; do
  /usr/bin/env python3 - "$tmp/d5/rank$k/call0000.fwd.safetensors" <<'PY' || fail "could not strip out.local"
import json, struct, sys
p = sys.argv[1]
b = open(p, "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
h.pop("out.local")
hb = json.dumps(h).encode()
hb += b" " * (-len(hb) % 8)
open(p, "wb").write(struct.pack("<Q", len(hb)) + hb + b[8 + n:])
PY
done
expect 2 "has no out.local on any rank" -- validate --dump "$tmp/d5"
expect 2 "--ulysses does not apply to --dump" -- validate --dump "$dumps/$healthy" --ulysses 2
expect 2 "--html applies to --dump only" -- validate --html "$tmp/x.html"
expect 2 "--strict applies to --dump only" -- validate --strict
expect 2 "--exhaustive applies to --dump only" -- validate --exhaustive
# --strict: a passing dump stays passing when no stage is far above the calibration; the JSON
# names the calibration it was read against.
expect 0 '"strict":true' -- validate --dump "$dumps/$healthy" -q --json --strict
finish

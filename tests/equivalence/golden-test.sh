#!/usr/bin/env bash
# Golden CLI outputs: the contracts of DESIGN.md (collate, plan, mesh, check --json, record,
# replay) must stay byte-identical across refactors. Every command's stdout and exit code is
# compared with tests/equivalence/data/golden/. Only wall-clock fields are masked.
#   golden-test.sh SEQPAR SOURCE_DIR            compare
#   golden-test.sh SEQPAR SOURCE_DIR --update   rewrite the golden files (review the diff!)
set -u
seqpar=$(realpath "$1")
src=$(realpath "$2")
update=${3:-}
golden="$src/tests/equivalence/data/golden"
. "$(dirname "$0")/../support/harness.sh"
mkdir -p "$golden"

# Wall-clock seconds and the CPU's instruction sets are the only fields allowed to differ.
mask_times() {
  sed -E -e 's/"(setup|sp|reference|compare|gpu)":[0-9.eE+-]+/"\1":T/g' \
    -e 's/[0-9]+\.[0-9]+ s(,| |\)|$)/T s\1/g' -e 's/in [0-9.]+ ?m?s\b/in T s/g' \
    -e 's/^cpu: .*/cpu: ISA/' -e 's/"isa":"[^"]*"/"isa":ISA/'
}

# check's error magnitudes (max abs / max rel / of bound of rows that pass, and the row closest to
# its bound) are rounding noise whose last bits depend on the CPU's vector ISA; pass/fail, numel,
# tolerance and notes stay compared.
# A FAIL row keeps its numbers.
mask_errors() {
  python3 -c '
import json, re, sys
row = re.compile(r"^(\S+ +[0-9]+) +\S+ +\S+ +(\S+) +\S+ +(PASS)")
margin = re.compile(r"closest to its bound: [^;]*")
for line in sys.stdin:
    try:
        j = json.loads(line)
    except ValueError:
        j = None
    if isinstance(j, dict) and isinstance(j.get("rows"), list):
        for r in j["rows"]:
            if r.get("pass") is True:
                r["max_abs"] = r["max_rel"] = "E"
                if "of_bound" in r:
                    r["of_bound"] = "E"
        if j.get("pass") is True and j.get("closest_to_bound") is not None:
            j["closest_to_bound"] = "E"
        line = json.dumps(j, sort_keys=True, separators=(",", ":")) + "\n"
    else:
        line = margin.sub("closest to its bound: E", row.sub(r"\1 E E \2 E \3", line))
    sys.stdout.write(line)
'
}

# run NAME -- seqpar args…   (stdout masked + exit code; run in $dir, so paths are relative)
dir=$tmp
run() {
  local name=$1
  shift 2
  local out="$tmp/$name.out"
  if [[ $name == check.* ]]; then
    # Errors first: mask_times leaves JSON that no parser reads ("isa":ISA).
    (cd "$dir" && "$seqpar" "$@") 2>/dev/null | mask_errors | mask_times >"$out"
  else
    (cd "$dir" && "$seqpar" "$@") 2>/dev/null | mask_times >"$out"
  fi
  echo "exit ${PIPESTATUS[0]}" >>"$out"
  compare "$name" "$out"
}

# compare NAME FILE
compare() {
  local name=$1 file=$2
  if [ "$update" = "--update" ]; then
    cp "$file" "$golden/$name.out"
    ok
  elif ! cmp -s "$file" "$golden/$name.out"; then
    fail "$name differs from $golden/$name.out:"
    diff "$golden/$name.out" "$file" | head -8 | sed 's/^/    /'
  else
    ok
  fi
}

scenarios=(default ulysses ring qwen3-8b llama3-8b qwen2.5-7b mha-8 alst qwen3.5 gpt-oss gemma3 gemma2 llama4 dit)
for s in "${scenarios[@]}"; do
  run "plan.$s" -- plan --scenario "$s"
  run "plan.$s.json" -- plan --scenario "$s" --json
  run "check.$s.json" -- check --scenario "$s" --json --quiet
  run "check.$s.f32.json" -- check --scenario "$s" --json --quiet --dtype f32
  "$seqpar" record --scenario "$s" --out "$tmp/rec.$s.jsonl" >/dev/null 2>&1
  compare "record.$s.jsonl" "$tmp/rec.$s.jsonl"
  run "replay.$s" -- replay "rec.$s.jsonl"
  run "replay.$s.json" -- replay "rec.$s.jsonl" --json
done
run "check.default.text" -- check --quiet
run "check.ring-variants.json" -- check --ulysses 2 --ring 2 --docs 16,8 --ring-backward ring \
  --ring-forward allgather --json --quiet
run "check.contiguous.json" -- check --ulysses 2 --ring 2 --docs 15,8,21 --no-zigzag --json --quiet
run "check.veomni.json" -- check --profile veomni --ulysses 4 --docs 7,9,1 --json --quiet

for f in "$src"/tests/equivalence/data/collate/*_grid_u2_*.json \
  "$src"/tests/equivalence/data/collate/*_sem_*.json; do
  name=$(basename "$f" .json)
  python3 - "$f" "$tmp/$name.batch.json" "$tmp/$name.args" <<'PY'
import json, sys
case = json.load(open(sys.argv[1]))
json.dump(case["batch"], open(sys.argv[2], "w"))
args = ["--profile", case["profile"], "--ulysses", str(case["ulysses"]), "--ring", str(case["ring"])]
if case["profile"] == "xorl":
    args += ["--pad-token-id", str(case["pad_token_id"])]
open(sys.argv[3], "w").write(" ".join(args))
PY
  read -r -a args <"$tmp/$name.args"
  run "collate.$name.json" -- collate "${args[@]}" --batch "$name.batch.json" --json
  run "collate.$name" -- collate "${args[@]}" --batch "$name.batch.json"
done

for name in ok_u2_v2 ok_u3_v1 ok_u4_v0; do
  f="$src/tests/equivalence/data/deepspeed/$name.json"
  python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); json.dump(c["input"], open(sys.argv[2], "w")); print(c["ulysses"])' \
    "$f" "$tmp/ds_$name.batch.json" >"$tmp/ds_$name.u"
  u=$(cat "$tmp/ds_$name.u")
  run "collate.deepspeed_$name.json" -- collate --profile deepspeed --ulysses "$u" --batch "ds_$name.batch.json" --json
  run "collate.deepspeed_$name" -- collate --profile deepspeed --ulysses "$u" --batch "ds_$name.batch.json"
done

run "mesh.xorl" -- mesh --dp-shard 2 --ring 2 --ulysses 4 --cp-fsdp-mode ulysses_only
run "mesh.xorl.json" -- mesh --dp-shard 2 --ring 2 --ulysses 4 --cp-fsdp-mode ulysses_only --json
run "mesh.veomni.json" -- mesh --profile veomni --dp-shard 2 --ulysses 2 --json

dir="$src/traces"
for t in "$src"/traces/*.jsonl; do
  name=$(basename "$t" .jsonl)
  run "replay.trace.$name" -- replay "$name.jsonl"
  run "replay.trace.$name.json" -- replay "$name.jsonl" --json
done

finish

#!/usr/bin/env bash
# Every attention option under every layout: `seqpar check` (float64, SP ≡ non-SP) must pass.
# Prints the matrix as the Markdown table of docs/attention.md (one cell: PASS and the ring
# steps the mask skipped, or FAIL).
#   attention_matrix-test.sh SEQPAR
set -u
seqpar=$1
docs="--docs 24,40,16 --heads 8 --kv-heads 2 --layers 2"
declare -A layouts=(
  [ulysses]="--ulysses 4 --ring 1 --ulysses-strategy sync"
  [async]="--ulysses 2 --ring 1 --ulysses-strategy async"
  [ring-contiguous]="--ulysses 1 --ring 4 --no-zigzag"
  [ring-zigzag]="--ulysses 1 --ring 4"
  [ring-allgather]="--ulysses 1 --ring 4 --ring-forward allgather"
  [ring-zigzag-ring-bwd]="--ulysses 1 --ring 4 --ring-backward ring"
  [hybrid]="--ulysses 2 --ring 2"
)
order=(ulysses async ring-contiguous ring-zigzag ring-allgather ring-zigzag-ring-bwd hybrid)
declare -A options=(
  ["causal window 6"]="--window 6"
  ["window 6 : full (WF)"]="--window 6 --attention-pattern WF"
  ["chunked 8"]="--chunk 8"
  ["chunked : full (CF)"]="--chunk 8 --attention-pattern CF"
  ["bidirectional"]="--mask bidirectional"
  ["bidirectional window 3 / 1"]="--mask bidirectional --window 3 --window-right 1"
  ["bidirectional chunked 8"]="--mask bidirectional --chunk 8"
  ["sinks"]="--sinks"
  ["softcap 1"]="--softcap 1"
  ["sinks + window + softcap"]="--sinks --window 6 --softcap 1"
)
option_order=("causal window 6" "window 6 : full (WF)" "chunked 8" "chunked : full (CF)" "bidirectional"
  "bidirectional window 3 / 1" "bidirectional chunked 8" "sinks" "softcap 1" "sinks + window + softcap")
fail=0
err=$(mktemp)
trap 'rm -f "$err"' EXIT
printf '| option |'
for l in "${order[@]}"; do printf ' %s |' "$l"; done
printf '\n|---|'
for l in "${order[@]}"; do printf '%s' '---|'; done
printf '\n'
for o in "${option_order[@]}"; do
  printf '| %s |' "$o"
  for l in "${order[@]}"; do
    # shellcheck disable=SC2086
    out=$("$seqpar" check $docs ${layouts[$l]} ${options[$o]} --json 2>"$err")
    cell=$(python3 - "$out" "$(tail -n 1 "$err")" <<'PY'
import json, sys
try:
    j = json.loads(sys.argv[1])
except ValueError:
    print("ERROR: " + sys.argv[2][:120]); sys.exit()
r = j.get("ring_steps")
skip = f", {r['skipped_mask']}/{r['computed'] + r['skipped_mask'] + r['skipped_layout']} steps skipped" if r and r["skipped_mask"] else ""
print(("PASS" if j["pass"] else "FAIL") + skip)
PY
)
    [[ $cell == PASS* ]] || fail=1
    printf ' %s |' "$cell"
  done
  printf '\n'
done
exit $fail

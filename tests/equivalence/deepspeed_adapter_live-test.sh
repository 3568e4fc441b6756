#!/usr/bin/env bash
# DeepSpeed ALST's UlyssesSPDataLoaderAdapter of the pinned deepspeed package, run now on gloo
# (tests/jobs/gen_deepspeed_adapter_fixtures.py --ulysses-sp package: 18 cases, U 1–4,
# healthy and the adapter's own errors): every output must equal the committed fixture of
# data/deepspeed/, which collate_fixtures holds `seqpar collate --profile deepspeed` to — so
# seqpar reproduces the adapter users pip-install, not only the one the fixtures came from.
#   deepspeed_adapter_live-test.sh SOURCE_DIR
set -u
src=$1
. "$src/tests/equivalence/torch_python.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" "$src/tests/jobs/gen_deepspeed_adapter_fixtures.py" --ulysses-sp package \
  --out "$tmp/fx" >"$tmp/log" 2>&1 || { tail -30 "$tmp/log"; exit 1; }
fails=0
n=0
for f in "$src"/tests/equivalence/data/deepspeed/*.json; do
  b=$(basename "$f")
  n=$((n + 1))
  if [ ! -f "$tmp/fx/$b" ]; then
    echo "FAIL $b: the pinned DeepSpeed produced no such case"
    fails=$((fails + 1))
  elif ! cmp -s "$f" "$tmp/fx/$b"; then
    echo "FAIL $b: the pinned DeepSpeed's adapter differs from the committed fixture"
    diff <(python3 -m json.tool "$f") <(python3 -m json.tool "$tmp/fx/$b") | head -20
    fails=$((fails + 1))
  else
    echo "ok   $b"
  fi
done
[ "$n" -ge 18 ] || { echo "FAIL: only $n fixtures"; exit 1; }
version=$("$py" -c 'import importlib.metadata as m; print(m.version("deepspeed"))')
echo "$((n - fails)) of $n fixtures equal to DeepSpeed $version's adapter"
[ "$fails" = 0 ]

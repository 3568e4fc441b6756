#!/usr/bin/env bash
# seqpar's GatedDeltaNet against VeOmni's own torch functions run now (the committed fixture
# data/torch/gdn-veomni.json is checked by gdn_veomni_fixture). Needs torch and VeOmni's Qwen3.5
# modelling file: $VEOMNI_QWEN3_5 (the file), $VEOMNI_DIR (a checkout), or an importable veomni
# package. Fails when either is missing (./setup.sh test installs both).
#   gdn_veomni_live-test.sh TORCH_CROSSCHECK SOURCE_DIR
set -u
tc=$1
src=$2
. "$(dirname "$0")/torch_python.sh"
rel=veomni/models/transformers/qwen3_5/generated/patched_modeling_qwen3_5_gpu.py
file=${VEOMNI_QWEN3_5:-}
[ -z "$file" ] && [ -n "${VEOMNI_DIR:-}" ] && file=$VEOMNI_DIR/$rel
if [ -z "$file" ]; then
  pkg=$("$py" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("veomni").submodule_search_locations[0]))' 2>/dev/null)
  [ -n "$pkg" ] && file=$pkg/$rel
fi
if [ -z "$file" ] || [ ! -f "$file" ]; then
  echo "FAIL: VeOmni's $rel not found (./setup.sh test installs the veomni package; or set VEOMNI_DIR to a checkout)"
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$tc" gdn-dump "$tmp/in.json" || exit 1
"$py" "$src/tests/jobs/gdn_veomni.py" --veomni "$file" "$tmp/in.json" "$tmp/out.json" || exit 1
"$tc" gdn-compare "$tmp/out.json"

#!/usr/bin/env bash
# seqpar's async Ulysses (core) against VeOmni's own AsyncUlyssesQKVProjection, run now on 2
# gloo processes (the committed fixture data/torch/async-ulysses-veomni.json is checked by
# async_veomni_fixture). Needs torch and a VeOmni checkout: $VEOMNI_DIR or an importable veomni
# package. Fails when either is missing (./setup.sh test installs both).
#   async_veomni_live-test.sh TORCH_CROSSCHECK SOURCE_DIR
set -u
tc=$1
src=$2
. "$(dirname "$0")/torch_python.sh"
root=${VEOMNI_DIR:-}
if [ -z "$root" ]; then
  root=$("$py" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("veomni").submodule_search_locations[0]))' 2>/dev/null)
fi
if [ -z "$root" ] || [ ! -f "$root/veomni/distributed/sequence_parallel/async_ulysses.py" ]; then
  echo "FAIL: VeOmni's veomni/distributed/sequence_parallel/async_ulysses.py not found (./setup.sh test installs the veomni package; or set VEOMNI_DIR to a checkout)"
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$tc" async-dump "$tmp/in.json" || exit 1
"$py" "$src/tools/crosscheck/async_ulysses_veomni.py" --veomni "$root" "$tmp/in.json" "$tmp/out.json" || exit 1
"$tc" async-compare "$tmp/out.json"

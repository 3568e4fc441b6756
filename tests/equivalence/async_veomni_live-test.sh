#!/usr/bin/env bash
# seqpar's async Ulysses (core) against VeOmni's own AsyncUlyssesQKVProjection, run now on 2
# gloo processes (the committed fixture data/torch/async-ulysses-veomni.json is checked by
# async_veomni_fixture). Needs torch and a VeOmni checkout: $VEOMNI_DIR or an importable veomni
# package. Exit 77 (meson SKIP) when either is missing.
#   async_veomni_live-test.sh TORCH_CROSSCHECK SOURCE_DIR
set -u
tc=$1
src=$2
. "$(dirname "$0")/torch_python.sh"
root=${VEOMNI_DIR:-}
if [ -z "$root" ]; then
  root=$("$py" -c 'import os, veomni; print(os.path.dirname(os.path.dirname(veomni.__file__)))' 2>/dev/null)
fi
if [ -z "$root" ] || [ ! -f "$root/veomni/distributed/sequence_parallel/async_ulysses.py" ]; then
  echo "SKIP: VeOmni's veomni/distributed/sequence_parallel/async_ulysses.py not found (set VEOMNI_DIR to a VeOmni checkout)"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$tc" async-dump "$tmp/in.json" || exit 1
"$py" "$src/tools/crosscheck/async_ulysses_veomni.py" --veomni "$root" "$tmp/in.json" "$tmp/out.json" || exit 1
"$tc" async-compare "$tmp/out.json"

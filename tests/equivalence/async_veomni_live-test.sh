#!/usr/bin/env bash
# seqpar's async Ulysses (core) against VeOmni's own AsyncUlyssesQKVProjection, run now on 2
# gloo processes (the committed fixture data/torch/async-ulysses-veomni.json is checked by
# async_veomni_fixture). Needs torch and VeOmni: the project venv's veomni package, or a checkout
# named by $VEOMNI_DIR. Fails when either is missing (./setup.sh test installs both).
#   async_veomni_live-test.sh TORCH_CROSSCHECK SOURCE_DIR
set -u
tc=$1
src=$2
. "$(dirname "$0")/torch_python.sh"
# $VEOMNI_DIR: a checkout, read definition by definition; else the project venv's veomni
# package, imported.
root=${VEOMNI_DIR:-package}
if [ "$root" = package ]; then
  "$py" -c 'import veomni.distributed.sequence_parallel.async_ulysses' >/dev/null 2>&1 || {
    echo "FAIL: the project venv cannot import veomni.distributed.sequence_parallel.async_ulysses (./setup.sh test installs veomni)"
    exit 1
  }
elif [ ! -f "$root/veomni/distributed/sequence_parallel/async_ulysses.py" ]; then
  echo "FAIL: VEOMNI_DIR=$root has no veomni/distributed/sequence_parallel/async_ulysses.py"
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$tc" async-dump "$tmp/in.json" || exit 1
"$py" "$src/tests/jobs/async_ulysses_veomni.py" --veomni "$root" "$tmp/in.json" "$tmp/out.json" || exit 1
"$tc" async-compare "$tmp/out.json"

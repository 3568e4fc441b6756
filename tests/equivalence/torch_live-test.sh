#!/usr/bin/env bash
# seqpar's reference against PyTorch computed now (the committed fixtures are checked by
# torch_fixtures): dump every scenario's input, run tests/jobs/torch_reference.py, compare.
# Exit 77 (meson SKIP) when torch cannot be imported.
#   torch_live-test.sh TORCH_CROSSCHECK SOURCE_DIR
set -u
tc=$1
src=$2
. "$(dirname "$0")/torch_python.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$tc" dump "$tmp/in" >/dev/null || exit 1
"$py" "$src/tests/jobs/torch_reference.py" "$tmp"/in/*.input.json --out-dir "$tmp/torch" \
  >/dev/null || exit 1
"$tc" compare "$tmp/torch"

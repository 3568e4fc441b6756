#!/usr/bin/env bash
# `pip install ./python` into a fresh venv (system site packages for Debian's torch; no network:
# --no-build-isolation with Debian's setuptools), then from outside the checkout: the package
# imports from the venv, its CLI re-runs one case, and pytest finds the plugin.
#   install-test.sh SEQPAR SOURCE_DIR
set -u
seqpar=$(realpath "$1")
src=$2
. "$src/tests/equivalence/torch_python.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
"$py" -m venv --system-site-packages "$tmp/venv" >"$tmp/venv.log" 2>&1 ||
  { cat "$tmp/venv.log"; fail "python3 -m venv (apt-get install python3-venv)"; }
vpy=$tmp/venv/bin/python
# From a copy: an in-tree build leaves build/ and *.egg-info/ beside the sources.
cp -r "$src/python" "$tmp/pkg"
"$vpy" -m pip install --no-build-isolation --no-index --quiet "$tmp/pkg" >"$tmp/pip.log" 2>&1 ||
  { cat "$tmp/pip.log"; fail "pip install ./python"; }
cd "$tmp"
where=$("$vpy" -c 'import seqpar.testing, seqpar.dump, seqpar.recorder, os; print(os.path.dirname(seqpar.__file__))') ||
  fail "import from the venv"
case $where in
  "$tmp"/venv/*) echo "ok   seqpar imports from the venv: $where" ;;
  *) fail "seqpar imported from $where, not from the venv" ;;
esac
out=$(SEQPAR=$seqpar "$vpy" -m seqpar.testing run "$src/python/examples/zigzag_ring_attention.py:attention" \
  --scenario '{"ulysses":2,"ring":2,"layout":"zigzag","heads":4,"kv_heads":1,"head_dim":5,"docs":[4,8],"dtype":"f32"}') ||
  fail "seqpar.testing run from the venv: $out"
echo "ok   $out"
"$tmp/venv/bin/seqpar-testing" --help >/dev/null || fail "the seqpar-testing script"
echo "ok   seqpar-testing script installed"
"$vpy" -m pytest --help 2>/dev/null | grep -q -- "--seqpar-examples" || fail "the pytest plugin is not registered"
echo "ok   pytest plugin registered (--seqpar, --seqpar-examples)"

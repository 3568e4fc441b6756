#!/usr/bin/env bash
# `pip install ./python` the way users install it: into a plain venv (no system site packages)
# that has torch, once from the source tree and once from a wheel built from it; then, from
# outside the checkout, the package imports from that venv, its CLI re-runs one case, and
# pytest finds the plugin. The venvs see the project venv's torch, Hypothesis and pytest
# through a .pth file (what an installed torch looks like to pip and Python, without copying
# 4 GB per venv); pip runs with --no-index, so nothing is downloaded.
#   install-test.sh SEQPAR SOURCE_DIR
set -u
seqpar=$(realpath "$1")
src=$2
. "$src/tests/equivalence/torch_python.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# From a copy: an in-tree build leaves build/ and *.egg-info/ beside the sources.
cp -r "$src/python" "$tmp/pkg"
"$py" -m pip wheel --no-build-isolation --no-deps --no-index --quiet -w "$tmp/dist" "$tmp/pkg" \
  >"$tmp/wheel.log" 2>&1 || { cat "$tmp/wheel.log"; fail "pip wheel ./python"; }
wheel=$(ls "$tmp"/dist/seqpar-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || fail "pip wheel wrote no seqpar-*.whl"
echo "ok   built $(basename "$wheel")"
for how in source wheel; do
  venv=$tmp/venv-$how
  "$py" -m venv "$venv" >"$tmp/venv.log" 2>&1 || { cat "$tmp/venv.log"; fail "python -m venv"; }
  vpy=$venv/bin/python
  vsite=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$vpy" -c 'import torch' 2>/dev/null && fail "the plain venv sees a torch before the .pth"
  echo "$site" >"$vsite/project-torch.pth"
  target=$tmp/pkg
  [ $how = wheel ] && target=$wheel
  # setuptools and wheel for the source build come from the project venv too (no network).
  "$vpy" -m pip install --no-index --no-build-isolation --quiet "$target" >"$tmp/pip.log" 2>&1 ||
    { cat "$tmp/pip.log"; fail "pip install ($how) into a venv that has torch"; }
  (
    cd "$tmp" || exit 1
    where=$("$vpy" -c 'import seqpar.testing, seqpar.dump, seqpar.recorder, os; print(os.path.dirname(seqpar.__file__))') ||
      fail "import from the venv ($how)"
    case $where in
      "$venv"/*) echo "ok   ($how) seqpar imports from the venv: $where" ;;
      *) fail "($how) seqpar imported from $where, not from the venv" ;;
    esac
    out=$(SEQPAR=$seqpar "$vpy" -m seqpar.testing run "$src/python/examples/zigzag_ring_attention.py:attention" \
      --scenario '{"ulysses":2,"ring":2,"layout":"zigzag","heads":4,"kv_heads":1,"head_dim":5,"docs":[4,8],"dtype":"f32"}') ||
      fail "($how) seqpar.testing run from the venv: $out"
    echo "ok   ($how) $out"
    "$venv/bin/seqpar-testing" --help >/dev/null || fail "($how) the seqpar-testing script"
    echo "ok   ($how) seqpar-testing script installed"
    "$vpy" -m pytest --help 2>/dev/null | grep -q -- "--seqpar-examples" ||
      fail "($how) the pytest plugin is not registered"
    echo "ok   ($how) pytest plugin registered (--seqpar, --seqpar-examples)"
  ) || exit 1
done

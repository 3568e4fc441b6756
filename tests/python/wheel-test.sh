#!/usr/bin/env bash
# The wheel, installed as a user installs it. From the checkout (its committed tree: meson dist),
# an sdist is made; the wheel is built from that sdist offline (no index, no build isolation: the
# project venv's pinned meson-python, meson and ninja); it is installed into a fresh venv outside
# the checkout; then, from a directory outside the checkout, with no PYTHONPATH, no $SEQPAR and no
# checkout path on PATH:
#   - the `seqpar` on PATH is the venv's, and needs only the C/C++ runtime (ldd);
#   - its --version is meson.build's, and so is seqpar.__version__;
#   - `seqpar check` on its default, and `seqpar validate --dump` on a committed dump, pass;
#   - the worked example passes `python -m seqpar.testing check`, and seqpar.testing judges with
#     the wheel's own binary even when $SEQPAR names another;
#   - a pytest file that uses the plugin (--seqpar-examples) passes, and a broken implementation
#     fails it.
# The fresh venv sees the project venv's torch, Hypothesis and pytest (the pinned versions)
# through a .pth file: what an installed torch looks like to pip and Python, without copying
# 4 GB per run. Nothing of seqpar's comes from there (checked: the venv has no seqpar of its own
# before the install, and seqpar imports from the venv after it).
#   wheel-test.sh SOURCE_DIR [WORK_DIR]   (WORK_DIR kept when given; else a temporary one)
set -u
src=$(realpath "$1")
. "$src/tests/equivalence/torch_python.sh"
if [ -n "${2:-}" ]; then
  tmp=$(realpath -m "$2")
  rm -rf "$tmp" && mkdir -p "$tmp"
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
fi
fail() {
  echo "FAIL: $*"
  exit 1
}
step() { echo "---- $(date +%T) $*"; }
want_version=$(sed -n "s/^ *version *: *'\([^']*\)'.*/\1/p" "$src/meson.build" | head -1)
[ -n "$want_version" ] || fail "no version in $src/meson.build"

step "sdist (meson-python's build_sdist: meson dist of the committed tree)"
(cd "$src" && "$py" -c 'import sys, mesonpy; print(mesonpy.build_sdist(sys.argv[1]))' "$tmp/sdist") \
  >"$tmp/sdist.log" 2>&1 || { tail -n 40 "$tmp/sdist.log"; fail "build_sdist"; }
sdist=$(ls "$tmp"/sdist/seqpar-*.tar.gz 2>/dev/null | head -1)
[ -n "$sdist" ] || fail "build_sdist wrote no seqpar-*.tar.gz"
[ "$(basename "$sdist")" = "seqpar-$want_version.tar.gz" ] ||
  fail "the sdist is $(basename "$sdist"), meson.build says version $want_version"
echo "ok   $(basename "$sdist") ($(du -h "$sdist" | cut -f1))"

step "wheel from the sdist, offline"
# pip unpacks the sdist and meson-python builds it under TMPDIR, at names drawn anew each run:
# with that directory as ccache's base (setup.sh exports the cache), the compilations of one
# run hash like the last run's and are served from the cache.
mkdir -p "$tmp/build-tmp"
TMPDIR="$tmp/build-tmp" CCACHE_BASEDIR="$tmp/build-tmp" \
"$py" -m pip wheel --no-index --no-build-isolation --no-deps --disable-pip-version-check -q \
  -w "$tmp/dist" "$sdist" >"$tmp/wheel.log" 2>&1 || { tail -n 60 "$tmp/wheel.log"; fail "pip wheel (sdist, offline)"; }
wheel=$(ls "$tmp"/dist/seqpar-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || fail "pip wheel wrote no seqpar-*.whl"
echo "ok   $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"
"$py" - "$wheel" <<'PY' || fail "the wheel's contents"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["seqpar/__init__.py", "seqpar/dump.py", "seqpar/recorder.py", "seqpar/testing/plugin.py",
        "seqpar/testing/runner.py"]
missing = [n for n in need if n not in names]
scripts = [n for n in names if ".data/scripts/" in n]
if missing or not any(n.endswith("/seqpar") for n in scripts):
    print("missing:", missing, "scripts:", scripts)
    sys.exit(1)
entry = next(n for n in names if n.endswith("entry_points.txt"))
text = zipfile.ZipFile(sys.argv[1]).read(entry).decode()
if "seqpar.testing.plugin" not in text:
    print("no pytest11 entry point:", text)
    sys.exit(1)
print("ok   the wheel holds the CLI (scripts/seqpar), the package and the pytest11 entry point")
PY

step "a fresh venv outside the checkout"
venv=$tmp/venv
/usr/bin/python3 -m venv "$venv" >"$tmp/venv.log" 2>&1 || "$py" -m venv "$venv" >"$tmp/venv.log" 2>&1 ||
  { cat "$tmp/venv.log"; fail "python -m venv"; }
vpy=$venv/bin/python
"$vpy" -c 'import seqpar' 2>/dev/null && fail "the fresh venv already imports a seqpar"
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
vsite=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site" >"$vsite/project-torch.pth"
"$vpy" -c 'import seqpar' 2>/dev/null && fail "the project venv's site-packages holds a seqpar"
"$vpy" -m pip install --no-index --disable-pip-version-check -q "$wheel" >"$tmp/pip.log" 2>&1 ||
  { cat "$tmp/pip.log"; fail "pip install the wheel into the venv"; }
echo "ok   installed into $venv"

work=$tmp/user
mkdir -p "$work"
cp "$src/python/examples/zigzag_ring_attention.py" "$src/python/examples/sp_training_step.py" "$work/"
cp "$src/tests/python/data/hf_configs/qwen3-8b.json" "$work/"
cp -r "$src/tests/equivalence/data/dumps/ring-healthy_r2-f32" "$work/dump"
cat >"$work/test_my_attention.py" <<'PY'
import pytest
import seqpar.testing as spt
from zigzag_ring_attention import attention


def test_my_attention():
    spt.check(attention, max_world=4, max_examples=50, supports={"layouts": ["zigzag"]})


def test_a_broken_attention_fails():
    def doubled_scores(q, k, v, ctx):
        return attention(q * 2.0, k, v, ctx)  # scores twice what they should be
    with pytest.raises(spt.SpAttentionFailure):
        spt.check(doubled_scores, max_world=2, max_examples=50,
                  supports={"layouts": ["zigzag"]})
PY
cd "$work" || fail "cd $work"
# The user's shell: the venv's bin first, the system's after; nothing of the checkout.
export PATH="$venv/bin:/usr/local/bin:/usr/bin:/bin"
unset PYTHONPATH SEQPAR
case ":$PATH:" in *"$src"*) fail "PATH holds the checkout" ;; esac

step "the CLI"
[ "$(command -v seqpar)" = "$venv/bin/seqpar" ] || fail "seqpar on PATH is $(command -v seqpar), not $venv/bin/seqpar"
ldd "$venv/bin/seqpar" >"$tmp/ldd.txt" 2>&1 || { cat "$tmp/ldd.txt"; fail "ldd seqpar"; }
extra=$(grep -vE '^\s*(linux-vdso\.so|/lib64/ld-linux-x86-64\.so|(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt)\.so)' "$tmp/ldd.txt")
[ -z "$extra" ] || { cat "$tmp/ldd.txt"; fail "the wheel's seqpar needs libraries beyond the C/C++ runtime: $extra"; }
echo "ok   ldd: $(awk '{print $1}' "$tmp/ldd.txt" | tr '\n' ' ')"
version=$(seqpar --version) || fail "seqpar --version"
echo "$version" | head -1 | grep -q "seqpar $want_version" || fail "seqpar --version says '$(echo "$version" | head -1)', meson.build $want_version"
echo "$version" | grep -q "generic" || fail "the wheel's default build is not -Dcpu=generic: $version"
[ "$("$vpy" -c 'import seqpar; print(seqpar.__version__)')" = "$want_version" ] ||
  fail "seqpar.__version__ is not $want_version"
echo "ok   $(echo "$version" | head -1); seqpar.__version__ $want_version"
seqpar check >"$tmp/check.txt" 2>&1 || { cat "$tmp/check.txt"; fail "seqpar check (default) from the wheel"; }
echo "ok   seqpar check: $(grep -m1 -E 'PASS|FAIL|consistent' "$tmp/check.txt")"
seqpar validate --dump dump >"$tmp/validate.txt" 2>&1 ||
  { cat "$tmp/validate.txt"; fail "seqpar validate --dump (committed ring-healthy_r2-f32)"; }
echo "ok   seqpar validate --dump: $(grep -m1 -E 'PASS|FAIL|consistent|verdict' "$tmp/validate.txt")"

step "seqpar.testing"
where=$("$vpy" -c 'import seqpar.testing, seqpar.dump, seqpar.recorder, os; print(os.path.dirname(seqpar.__file__))') ||
  fail "import seqpar from the venv"
case $where in
  "$venv"/*) echo "ok   seqpar imports from the venv: $where" ;;
  *) fail "seqpar imported from $where, not from the venv" ;;
esac
found=$(SEQPAR=/bin/false "$vpy" -c 'from seqpar.testing.scenario import find_seqpar; print(find_seqpar())') ||
  fail "find_seqpar"
[ "$found" = "$(realpath "$venv/bin/seqpar")" ] ||
  fail "seqpar.testing judges with $found, not its wheel's $venv/bin/seqpar (SEQPAR=/bin/false set)"
echo "ok   seqpar.testing judges with its own wheel's binary (before \$SEQPAR)"
# (the worked example implements the zigzag ring layout: docs/testing.md)
"$vpy" -m seqpar.testing check zigzag_ring_attention.py:attention --examples 30 --progress 0 \
  --supports '{"layouts": ["zigzag"]}' \
  >"$tmp/testing.txt" 2>&1 || { cat "$tmp/testing.txt"; fail "python -m seqpar.testing check (worked example)"; }
echo "ok   python -m seqpar.testing check: $(tail -1 "$tmp/testing.txt")"
# the whole-step property from the wheel: the worked example's step on its own model and on a
# drawn-down Qwen3 (transformers from the venv)
"$vpy" -m seqpar.testing check-step "sp_training_step.py:make_step()" --model sp_training_step.py:TinyLM \
  --examples 10 --progress 0 >"$tmp/step.txt" 2>&1 || { cat "$tmp/step.txt"; fail "python -m seqpar.testing check-step"; }
"$vpy" -m seqpar.testing check-step "sp_training_step.py:make_step(hf=True)" --hf-config qwen3-8b.json \
  --examples 5 --progress 0 >>"$tmp/step.txt" 2>&1 || { cat "$tmp/step.txt"; fail "check-step --hf-config"; }
echo "ok   python -m seqpar.testing check-step: $(grep -c '^PASS' "$tmp/step.txt") of 2 passed"
seqpar-testing --help >/dev/null || fail "the seqpar-testing script"
"$vpy" -m pytest -q -p no:cacheprovider --seqpar-examples 30 test_my_attention.py >"$tmp/pytest.txt" 2>&1 ||
  { cat "$tmp/pytest.txt"; fail "pytest with the plugin"; }
echo "ok   pytest (plugin, --seqpar-examples 30): $(tail -1 "$tmp/pytest.txt")"

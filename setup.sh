#!/usr/bin/env bash
# seqpar set-up: installs what is missing (Debian packages), configures and builds.
#   ./setup.sh           set up and build (idempotent; seconds when everything is present)
#   ./setup.sh run       … then run the main job: seqpar check on its built-in default
#   ./setup.sh test      … then run every test suite, the TSan build of the communicator tests, and the ASan+UBSan build of the
#                        unit, property and equivalence suites
set -euo pipefail
cd "$(dirname "$0")"

# What the CLI needs (all `./setup.sh run` installs: the main job in minutes on a bare machine);
# then what the rest of the build needs: the tests (GoogleTest, RapidCheck, cmake to find it),
# the MPI backend (MPICH), the format test and the fuzzers (clang).
packages=(meson ninja-build pkg-config g++ python3 libeigen3-dev libfmt-dev libboost-context-dev
          nlohmann-json3-dev libcli11-dev zlib1g-dev ccache)
[ "${1:-}" = run ] || packages+=(cmake python3-pip libgtest-dev librapidcheck-dev libmpich-dev mpich
                                 clang clang-format libclang-rt-14-dev)
# The PyTorch side's tests (tests/python, the live torch jobs) run in the project venv (.venv,
# below); Debian's python3-venv makes it, Chromium renders the HTML reports.
# iproute2 (ip netns, tc) and util-linux (unshare) make the test hosts of tests/mpi/hosts-test.py.
[ "${1:-}" = test ] && packages+=(python3-venv python3-pip chromium iproute2 util-linux)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

# The header-only cudnn-frontend (cuDNN's graph API in C++; gpu/fused_attention.cpp) for builds
# with CUDA: its pinned release's headers, unpacked from PyPI's wheel into .deps/ (git-ignored).
cudnn_frontend_version=1.32.0
fetch_cudnn_frontend() {
  local dest=.deps/cudnn-frontend
  [ -f "$dest/VERSION" ] && [ "$(cat "$dest/VERSION")" = "$cudnn_frontend_version" ] && return 0
  command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] || return 0
  echo "setup: fetching the cudnn-frontend $cudnn_frontend_version headers into $dest"
  local tmp
  tmp=$(mktemp -d)
  if python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
       --python-version 3.11 --platform manylinux_2_28_x86_64 -d "$tmp" \
       "nvidia-cudnn-frontend==$cudnn_frontend_version" >/dev/null 2>&1 &&
     rm -rf "$dest" && mkdir -p "$dest" &&
     python3 -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith("include/")]' \
       "$tmp"/nvidia_cudnn_frontend-*.whl "$dest"; then
    echo "$cudnn_frontend_version" >"$dest/VERSION"
  else
    echo "setup: could not fetch nvidia-cudnn-frontend $cudnn_frontend_version from PyPI; the GPU" \
      "backend builds without cuDNN attention (SIMT kernels only)" >&2
    rm -rf "$dest"
  fi
  rm -rf "$tmp"
}
# The project venv: torch, Hypothesis, pytest and the SP frameworks users pip-install (DeepSpeed,
# VeOmni, yunchang, xorl), every version pinned in requirements.txt. Debian's python3 makes it;
# it is rebuilt only when requirements.txt changes (its hash is kept in requirements.sha256).
# The first install downloads ~3.6 GB from PyPI (torch's CUDA 13 wheels: the CPU runs the tests).
# It lives outside the checkout, one per hash of requirements.txt under $SEQPAR_VENV_CACHE
# (default ~/.cache/seqpar-venv/), and .venv is a link to it, so that a second clean clone on the
# same machine (CI's checkouts) finds it made: unpacking its 5.6 GB from pip's cache took 2.8
# minutes of every clean clone's set-up, longer than the build it ran beside (2026-12-01). The
# two newest are kept. A .venv that is a directory of its own (a checkout's from before) is
# kept and updated in place.
pip_install_requirements() {  # venv dir: requirements.txt into it (the venv made already)
  local venv=$1 log resolved nodeps
  log=$(mktemp) resolved=$(mktemp) nodeps=$(mktemp)
  # The lines after requirements.txt's "# --no-deps" marker are installed without their declared
  # dependencies (a package whose declared pins conflict with another's, though the code the
  # tests run needs only what is pinned above the marker); the rest through pip's resolver.
  sed '/^# --no-deps/,$d' requirements.txt >"$resolved"
  sed -n '/^# --no-deps/,$p' requirements.txt | grep -v '^#' >"$nodeps" || true
  # DeepSpeed ships as an sdist whose setup.py imports torch: wheel and torch first, then the
  # rest without build isolation (DS_BUILD_OPS=0: no C++/CUDA ops are compiled).
  if ! { "$venv/bin/python" -m pip install -q --disable-pip-version-check wheel \
           "$(grep -E '^torch==' requirements.txt)" -c "$resolved" &&
         DS_BUILD_OPS=0 "$venv/bin/python" -m pip install -q --disable-pip-version-check \
           --no-build-isolation -r "$resolved" &&
         { [ ! -s "$nodeps" ] || "$venv/bin/python" -m pip install -q --disable-pip-version-check \
             --no-deps -r "$nodeps"; }; } >"$log" 2>&1; then
    tail -n 40 "$log"
    rm -f "$log" "$resolved" "$nodeps"
    echo "setup: pip install -r requirements.txt failed (above)" >&2
    return 1
  fi
  rm -f "$log" "$resolved" "$nodeps"
}
make_venv() {
  local want
  want=$(sha256sum requirements.txt | cut -d' ' -f1)
  if [ -d .venv ] && [ ! -L .venv ]; then  # a checkout's own venv, in place
    [ "$(cat .venv/requirements.sha256 2>/dev/null)" = "$want" ] && [ -x .venv/bin/python ] &&
      return 0
    echo "setup: installing the Python packages of requirements.txt into .venv" \
      "(first time: minutes)"
    [ -x .venv/bin/python ] || /usr/bin/python3 -m venv .venv
    pip_install_requirements .venv || return 1
    echo "$want" >.venv/requirements.sha256
    return 0
  fi
  local home="${SEQPAR_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/seqpar-venv}"
  local venv="$home/${want:0:16}"
  mkdir -p "$home"
  # One set-up at a time makes or checks a given venv (flock: util-linux, in the base image);
  # the hash is written last, so a venv without it is an install that did not finish.
  (
    flock 9
    if [ "$(cat "$venv/requirements.sha256" 2>/dev/null)" != "$want" ] ||
      [ ! -x "$venv/bin/python" ]; then
      echo "setup: installing the Python packages of requirements.txt into $venv" \
        "(first time: minutes)"
      rm -rf "$venv"
      /usr/bin/python3 -m venv "$venv"
      pip_install_requirements "$venv" || exit 1
      echo "$want" >"$venv/requirements.sha256"
    fi
    touch "$venv/requirements.sha256"  # the newest in use: the two newest are kept
    find "$home" -mindepth 2 -maxdepth 2 -name requirements.sha256 -printf '%T@ %h\n' |
      sort -rn | tail -n +3 | cut -d' ' -f2- | while read -r old; do
        # one that another set-up is installing or checking (its lock held) stays for now
        (flock -n 8 && rm -rf "$old" && rm -f "$old.lock") 8>"$old.lock" || true
      done
  ) 9>"$venv.lock" || return 1
  ln -sfn "$venv" .venv
}
# It installs (mostly downloading and unpacking) while the build compiles: started here, waited
# for before the tests.
venv_pid=""
if [ "${1:-}" = test ]; then
  make_venv &
  venv_pid=$!
fi

# The main job needs the CLI alone: `./setup.sh run` builds only tools/seqpar, and without the CUDA
# backend unless a GPU is present (or SEQPAR_GPU=1 asks for it); tests, benchmarks and the CUDA
# sources are built by `./setup.sh` and `./setup.sh test`.
gpu_wanted() {
  [ -n "${SEQPAR_GPU:-}" ] && return 0
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}
if [ "${1:-}" != run ] || gpu_wanted; then
  fetch_cudnn_frontend
fi

jobs=$(nproc 2>/dev/null || echo 2)

# A compiler cache for every build here (main, ASan, TSan, the wheel built from its sdist, the
# mutation runs): meson puts ccache before the compiler when it finds it on PATH (build-asan
# names it with clang). Its directory is outside the checkout, so that clean clones on the same
# machine share it; paths under the checkout are hashed relative to it (CCACHE_BASEDIR), so a
# clone at another path hits too. Capped at 5 GB (a cold main + ASan + TSan + wheel fill ~1.5).
export CCACHE_DIR="${CCACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/seqpar-ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
export CCACHE_NOHASHDIR=1
ccache_cxx=""
if command -v ccache >/dev/null 2>&1; then
  ccache_cxx="ccache "
  ccache -z >/dev/null 2>&1 || true
fi
ccache_said() {  # one line: what the cache served in this run
  [ -n "$ccache_cxx" ] || return 0
  ccache --print-stats 2>/dev/null | awk -F'\t' '
    $1 == "direct_cache_hit" || $1 == "preprocessed_cache_hit" { hit += $2 }
    $1 == "cache_miss" { miss = $2 }
    END { if (hit + miss > 0) printf "setup: ccache served %d of %d compilations (%.0f%%) from %s\n", hit, hit + miss, 100 * hit / (hit + miss), ENVIRON["CCACHE_DIR"] }'
}
ninja_quiet() {  # dir, targets…: ninja's output shown only when it fails (its last 60 lines)
  local dir=$1 log
  shift
  log=$(mktemp)
  ninja -C "$dir" -j "$jobs" "$@" >"$log" 2>&1 || { tail -n 60 "$log"; rm -f "$log"; return 1; }
  rm -f "$log"
}
configure() {  # dir, ninja target ('' = all), extra meson args…
  local dir=$1 target=$2
  shift 2
  local log
  if [ ! -f "$dir/build.ninja" ]; then
    echo "setup: configuring $dir"
    log=$(mktemp)
    meson setup "$dir" "$@" >"$log" 2>&1 || { cat "$log"; rm -f "$log"; return 1; }
    rm -f "$log"
  fi
  echo "setup: building $dir${target:+ ($target)}"
  # shellcheck disable=SC2086
  ninja_quiet "$dir" $target
}
if [ "${1:-}" = run ]; then
  gpu=disabled
  gpu_wanted && gpu=auto
  [ -f build/build.ninja ] || { mkdir -p build && touch build/.configured-for-run; }
  # The CLI alone, without MPI and without debug info (a tenth less to compile), as a unity build
  # of 16 files per compile: its ~90 files in 150 s instead of 300 on 2 cores (2026-12-01; 8 per
  # compile 178 s, 32 no faster than 16: too few compiles left for both cores). `./setup.sh` or
  # `./setup.sh test` configures this build again with MPI, CUDA and 8 files per compile (debug
  # info stays off there: `meson configure build -Ddebug=true` brings it back).
  configure build tools/seqpar -Dgpu=$gpu -Dmpi=disabled -Ddebug=false -Dunity=on -Dunity_size=16
else
  # The main build is a unity build of 8 sources per compile: the libraries' sources share
  # their headers' parsing and template instances (CLI11, fmt, nlohmann-json, Eigen), which a
  # build file by file compiles in every unit. Cold, with no compiler cache, on 2 cores
  # (2026-12-02, one after the other): 1,162 CPU-seconds against 1,546 file by file; the CLI's
  # verbs 78 against 203, src/trace 76 against 154. A change recompiles its group of 8 (~10-40
  # s, where one file took 3-20): `meson configure build -Dunity=off` for a build of your own
  # that you edit all day. The mutation catalogues' scratch builds (bench/mutate.py) are made
  # file by file.
  # A build configured by `./setup.sh run` (the CLI's packages only, no CUDA backend, 16 files
  # per compile) is configured again: the tests, MPI and CUDA are found now.
  if [ -f build/.configured-for-run ]; then
    echo "setup: configuring build again (tests, MPI and CUDA, after ./setup.sh run)"
    meson setup --reconfigure build -Dgpu=auto -Dmpi=auto -Dunity=on -Dunity_size=8 >/dev/null
    rm -f build/.configured-for-run
  fi
  configure build "" -Dunity=on -Dunity_size=8
fi


if [ -n "$venv_pid" ] && ! wait "$venv_pid"; then
  exit 1
fi

# The sanitizer builds of `./setup.sh test` (their tests run after the main suites, below).
build_sanitizers() {
  # Sanitizers: the CPU reference is the oracle, so it must be free of UB and leaks. The unit
  # suite, the SP ≡ non-SP properties (the oracle's own code and every step it checks) and the
  # equivalence suite's C++ programs are rebuilt at -O1 without debug info, MPI, CUDA or the
  # CLI: only their targets are built, and the properties run 30 cases each (400 in the
  # optimized build above), to keep CI within budget. (The layout and mesh properties exercise
  # core's index arithmetic, which the unit tests run under the sanitizers too.) This build is
  # also the x86-64 baseline (-Dcpu=generic: SSE2, no FMA) where the one above is the machine's
  # own ISA, so that every run tests both.
  # It is compiled with clang (half g++'s time at -O1 under the sanitizers), so that every run
  # also builds the project with a second compiler; a build-asan made with g++ is made again.
  # A unity build (8 sources per unit, as the wheel's): it is built once per run, never
  # rebuilt file by file, and compiles in 20 CPU-minutes against 27 file by file.
  # Its readers and parsers are compiled at -O0 (-Doptimize_readers=false; meson.build says which
  # and why, docs/development.md what it saves), and UBSan leaves Eigen's kernels uninstrumented.
  if [ -f build-asan/build.ninja ] &&
    ! grep -Eq '"command": "(ccache )?clang' build-asan/compile_commands.json 2>/dev/null; then
    rm -rf build-asan
  fi
  # The options a build-asan of an earlier checkout may lack: set again when one differs.
  local asan_opts=(-Dcpu=generic -Dunity=on -Dunity_size=8 -Doptimize_readers=false)
  if [ ! -f build-asan/build.ninja ]; then
    echo "setup: configuring build-asan (clang)"
    CC="${ccache_cxx}clang" CXX="${ccache_cxx}clang++" meson setup build-asan -Db_sanitize=address,undefined -Db_lundef=false \
      -Dgpu=disabled -Dmpi=disabled -Doptimization=1 -Ddebug=false -Drc_params=max_success=30 \
      "${asan_opts[@]}"
  elif meson introspect build-asan --buildoptions 2>/dev/null |
    python3 -c 'import json, sys
have = {o["name"]: str(o["value"]).lower() for o in json.load(sys.stdin)}
want = dict(a[2:].split("=", 1) for a in sys.argv[1:])
sys.exit(0 if any(have.get(k) != v for k, v in want.items()) else 1)' "${asan_opts[@]}"; then
    meson configure build-asan "${asan_opts[@]}" >/dev/null
  fi
  # The tests of suite 'sanitize' (tests/unit, tests/property/meson.build,
  # tests/equivalence/meson.build) and their programs.
  mapfile -t asan_targets < <(ninja -C build-asan -t targets all |
    sed -n 's#^\(tests/unit/[^/:]*-test\|tests/property/equivalence-prop\|tests/equivalence/[^/:]*-eq\): .*#\1#p')
  echo "setup: building build-asan (${#asan_targets[@]} test programs)"
  ninja_quiet build-asan "${asan_targets[@]}"
  # ThreadSanitizer: the rank-thread rendezvous and the in-process communicator, 3 repeats
  # (tests/tsan/soak.sh runs the long soak under load); the oracle's threads (its tiles and
  # (document, head) items written by several threads at once) in its thread-count tests.
  if [ ! -f build-tsan/build.ninja ]; then
    echo "setup: configuring build-tsan"
    meson setup build-tsan -Db_sanitize=thread -Db_lundef=false -Dgpu=disabled -Dmpi=disabled \
      -Doptimization=1 -Ddebug=false -Dunity=on -Dunity_size=8 >/dev/null
  fi
  echo "setup: building build-tsan (communicator and reference tests)"
  ninja_quiet build-tsan tests/unit/inproc_comm-test tests/unit/reference-test
}

case "${1:-}" in
  "") ccache_said; echo "setup: built build/tools/seqpar" ;;
  run)
    shift
    ccache_said
    exec ./build/tools/seqpar check "$@"
    ;;
  test)
    # The sanitizer builds (ASan+UBSan, TSan: build_sanitizers above) compile in the background,
    # in a session of their own at nice 19, while the main suites run. With the kernel's
    # autogroups (Linux's default: /proc/sys/kernel/sched_autogroup_enabled) a nice value weighs
    # only within its session, so this session shares the cores with the tests' as an equal
    # (measured: two spinning loops on each side, 1:1; its group set to nice 19 as well, 1:60).
    # That is kept: a cold build (~20 CPU-minutes) then ends within the suites, where the group
    # at nice 19 left it 7 minutes to finish after them (2026-12-01, a cold clean clone: 45.2
    # minutes); a warm one compiles in about a minute. Their tests run after the main suites at
    # normal priority, so that no time limit of theirs counts time spent waiting for a core; the
    # mutants below edit the sources, so they wait for these builds to end.
    sanitizer_log=$(mktemp)
    # Every test's temporary files (the dumps seqpar.testing keeps for a failing example, the
    # planted bugs' among them; torch's error files; the hosts' records) go to one directory of
    # this run, removed when the run is green and named when it is not: before, each run left
    # ~100 directories in /tmp (2026-12-01: 1,246 `seqpar-testing-*` after a day's runs).
    tests_tmp=$(mktemp -d "${TMPDIR:-/tmp}/seqpar-tests.XXXXXX")
    tests_green=0
    export -f build_sanitizers ninja_quiet
    export jobs ccache_cxx
    sanitizer_start=$SECONDS
    setsid -w nice -n 19 bash -c 'set -euo pipefail; build_sanitizers' >"$sanitizer_log" 2>&1 &
    sanitizer_pid=$!
    # A failing main suite ends this script (set -e): the builds' session ends with it.
    trap 'kill -- -"$sanitizer_pid" 2>/dev/null || kill "$sanitizer_pid" 2>/dev/null || true
          rm -f "$sanitizer_log"
          if [[ $tests_green == 1 ]]; then rm -rf "$tests_tmp"
          else echo "setup: the tests'"'"' temporary files are kept in $tests_tmp" >&2; fi' EXIT
    export TMPDIR=$tests_tmp
    meson test -C build --print-errorlogs --num-processes "$jobs"
    main_done=$SECONDS
    if ! wait "$sanitizer_pid"; then
      cat "$sanitizer_log"
      echo "setup: the sanitizer builds failed (above)" >&2
      exit 1
    fi
    cat "$sanitizer_log"
    echo "setup: the sanitizer builds ran beside the main suites at nice 19 and ended" \
      "$((SECONDS - main_done)) s after them ($((SECONDS - sanitizer_start)) s in all)"
    # Mutants made by rule (bench/mutants/places.json: mapping tables, bounds' constants,
    # comparisons, family lists): a random draw of them, each applied to this checkout in turn,
    # build/ rebuilt, its tests run until one fails; a mutant no test kills fails the run. The
    # seed is printed (rerun one draw with --seed); every file is restored and build/ rebuilt.
    # It runs beside the sanitizers' tests below: they run their own builds' binaries
    # (--no-rebuild) and read no file a mutant edits (the places are in src/core, src/dump,
    # src/trace, src/verify and python/seqpar; of suite 'sanitize' only reference_independence
    # reads sources, the oracle's in src/sim), and the draw's killing test often runs alone
    # (trace_cli, ~90 s of one core). Its output comes after theirs. (Before 2026-12-02 they ran
    # one after the other: ~100 s of the draw, then ~140 s of sanitizers.) A failing sanitizer
    # run ends this script; the EXIT trap then stops the draw, which puts its file back on
    # SIGTERM.
    mutate_log=$(mktemp)
    python3 bench/mutate.py --generated --sample 2 --budget 360 --in-place build >"$mutate_log" 2>&1 &
    mutate_pid=$!
    trap '[ -z "$mutate_pid" ] || { kill "$mutate_pid" && wait "$mutate_pid"; } 2>/dev/null || true
          rm -f "$mutate_log"
          kill -- -"$sanitizer_pid" 2>/dev/null || kill "$sanitizer_pid" 2>/dev/null || true
          rm -f "$sanitizer_log"
          if [[ $tests_green == 1 ]]; then rm -rf "$tests_tmp"
          else echo "setup: the tests'"'"' temporary files are kept in $tests_tmp" >&2; fi' EXIT
    # The ASan+UBSan build's tests (suite 'sanitize'), then TSan's. Their time limits in the
    # meson.build files are ≥ 3× the main build's quiet times; a sanitizer build at the x86-64
    # baseline runs the same test up to ~11× slower (2026-11-30, 2 cores, quiet: `attention`
    # 41.5 s under ASan against its 120 s limit, 3.7 s in build/; beside a 4-process load it
    # passed 120 s and was killed), so the sanitizers' runs get 3× every limit.
    ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
      meson test -C build-asan --no-rebuild --print-errorlogs --num-processes "$jobs" \
      --timeout-multiplier 3 --suite sanitize
    TSAN_OPTIONS="halt_on_error=1" meson test -C build-tsan --no-rebuild --print-errorlogs \
      --timeout-multiplier 3 --test-args=--gtest_repeat=3 inproc_comm inproc_comm_fibers1 \
      inproc_comm_fibers2
    cp build-tsan/meson-logs/testlog.json build-tsan/meson-logs/testlog-comm.json
    TSAN_OPTIONS="halt_on_error=1" meson test -C build-tsan --no-rebuild --print-errorlogs \
      --timeout-multiplier 3 --test-args='--gtest_filter=*step*thread_count*' reference
    mutate_rc=0
    wait "$mutate_pid" || mutate_rc=$?
    mutate_pid=""  # reaped: the EXIT trap must not signal a pid the system may give out again
    cat "$mutate_log"
    [ "$mutate_rc" = 0 ] || { echo "setup: the mutation draw failed (above)" >&2; exit 1; }
    ccache_said
    # One closing line over the four runs (meson prints its own summary per run above).
    python3 - build/meson-logs/testlog.json build-asan/meson-logs/testlog.json \
      build-tsan/meson-logs/testlog-comm.json build-tsan/meson-logs/testlog.json <<'PY'
import json, sys
counts = {"OK": 0, "FAIL": 0, "SKIP": 0}
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line).get("result", "")
        key = "OK" if r in ("OK", "EXPECTEDFAIL") else "SKIP" if r == "SKIP" else "FAIL"
        counts[key] += 1
print(f"{counts['OK']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
PY
    tests_green=1
    ;;
  *)
    echo "usage: ./setup.sh [run|test]" >&2
    exit 2
    ;;
esac

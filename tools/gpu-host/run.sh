#!/usr/bin/env bash
# One command on a bare GPU host with no network: unpacks the bundle tools/gpu-host/pack.sh made
# (Debian packages into a private prefix, the cudnn-frontend headers into .deps/), finds CUDA,
# cuDNN and NCCL (the toolkit, or the nvidia-* wheels beside the host's torch), builds seqpar with
# -Dgpu=enabled, and runs: the gpu test suite, compute-sanitizer (memcheck, initcheck, synccheck,
# racecheck) over the device tests, the GPU benchmarks (cuDNN and SIMT attention, the
# device-local all-to-all), seqpar's attention beside torch's SDPA on the same GPU, and the CPU
# backend's 1-16 thread scaling of the 32K-token check. Everything lands in one results folder:
# a log per step, the benchmarks' tables and JSON, and summary.txt (one line per step).
#   tools/gpu-host/run.sh [--bundle DIR] [--out DIR] [--steps LIST] [--prebuilt DIR]
#     --bundle    the folder pack.sh made (default: gpu-bundle)
#     --out       results folder (default: gpu-results-<date>; must not exist or be empty)
#     --steps     comma list of: build,test,check,validate,sanitize,bench,variants,sdpa,scale
#                 (default: all)
#     --prebuilt  a build folder made elsewhere (-Dcpu=generic) to use when the build fails
#     --threads   thread counts of the scaling step (default 1,2,4,8,16)
# Each step's time limit is 3-10× its time on an H100 (2026-11-28), so that a step that hangs
# costs minutes, not the session's device time.
# Exit status: 0 when every step passed, 1 when one failed, 2 on a usage error.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bundle=$root/gpu-bundle out="" steps=build,test,check,validate,sanitize,bench,variants,sdpa,scale prebuilt="" threads=1,2,4,8,16
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --prebuilt) prebuilt=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    -h | --help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
out=${out:-$root/gpu-results-$(date +%Y%m%d-%H%M%S)}
if [ -e "$out" ] && [ -n "$(ls -A "$out" 2>/dev/null)" ]; then
  echo "run.sh: '$out' exists and is not empty; name a new folder" >&2
  exit 2
fi
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
summary=$out/summary.txt
: >"$summary"
want() { [[ ",$steps," == *",$1,"* ]]; }
failed=0
# step NAME TIMEOUT_S COMMAND…: runs it with its output in NAME.log, one summary line.
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc
  echo "== $name: $*" | tee -a "$out/run.log"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  local verdict=ok
  [ $rc -eq 0 ] || { verdict="FAILED (exit $rc$([ $rc -eq 124 ] && echo ", timed out after ${limit} s"))"; failed=1; }
  printf '%-28s %-40s %5d s\n' "$name" "$verdict" $((SECONDS - t0)) | tee -a "$summary"
  return $rc
}

# ---- the host ----
{
  echo "date: $(date -u +%FT%TZ)"
  echo "tree: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$root" diff --quiet 2>/dev/null || echo '+changes')"
  echo "os: $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME"), $(ldd --version 2>&1 | head -1)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
  echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
  echo "nvcc: $(nvcc --version 2>&1 | tail -1)"
  echo "g++: $(g++ --version 2>&1 | head -1)"
  echo "python3: $(python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' 2>&1)"
} >"$out/host.txt"
cat "$out/host.txt"

# ---- dependencies: the bundle's Debian packages in a private prefix ----
prefix=${TMPDIR:-/tmp}/seqpar-deps
if [ -d "$bundle/debs" ]; then
  mkdir -p "$prefix"
  for f in "$bundle"/debs/*.deb; do dpkg -x "$f" "$prefix"; done
  # .pc files name /usr: point them at the prefix.
  for pc in "$prefix"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc "$prefix"/usr/share/pkgconfig/*.pc; do
    [ -f "$pc" ] && sed -i "s|=/usr|=$prefix/usr|g" "$pc"
  done
  lib=$prefix/usr/lib/x86_64-linux-gnu
  export PKG_CONFIG_PATH=$lib/pkgconfig:$prefix/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export CMAKE_PREFIX_PATH=$prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export CPATH=$prefix/usr/include${CPATH:+:$CPATH}
  export LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH}
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export BOOST_INCLUDEDIR=$prefix/usr/include BOOST_LIBRARYDIR=$lib
  if ! command -v pkg-config >/dev/null 2>&1; then
    mkdir -p "$prefix/bin"
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$lib" "$prefix/usr/bin/pkgconf" >"$prefix/bin/pkg-config"
    chmod +x "$prefix/bin/pkg-config"
    export PATH=$prefix/bin:$PATH
  fi
fi
if [ -f "$bundle/cudnn-frontend.tar.gz" ]; then
  mkdir -p "$root/.deps" && tar -C "$root/.deps" -xzf "$bundle/cudnn-frontend.tar.gz"
fi

# ---- CUDA libraries: the toolkit's, else the nvidia-* wheels beside torch ----
site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)
nvlib=$prefix/nvlib
mkdir -p "$nvlib"
if [ -n "$site" ] && [ -d "$site/nvidia" ]; then
  for d in "$site"/nvidia/*/lib "$site"/nvidia/cu13/lib; do
    [ -d "$d" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
  done
fi
find_first() { for p in "$@"; do [ -e "$p" ] && { echo "$p"; return; }; done; }
nccl_so=$(find_first /usr/local/cuda/lib64/libnccl.so /usr/lib/x86_64-linux-gnu/libnccl.so \
  "$site"/nvidia/nccl/lib/libnccl.so.2 "$site"/nvidia/cu13/lib/libnccl.so.2)
[ -n "$nccl_so" ] && ln -sf "$nccl_so" "$nvlib/libnccl.so"
nccl_h=$(find_first /usr/local/cuda/include/nccl.h /usr/include/nccl.h "$site"/nvidia/nccl/include/nccl.h \
  "$site"/nvidia/cu13/include/nccl.h)
[ -n "$nccl_h" ] && export CPATH=$CPATH:$(dirname "$nccl_h")
cudnn_h=$(find_first /usr/local/cuda/include/cudnn.h /usr/include/cudnn.h "$site"/nvidia/cudnn/include/cudnn.h \
  "$site"/nvidia/cu13/include/cudnn.h)
export LIBRARY_PATH=$nvlib:${LIBRARY_PATH:-}
export LD_LIBRARY_PATH=$nvlib:$LD_LIBRARY_PATH
echo "nccl: ${nccl_so:-not found}; nccl.h: ${nccl_h:-not found}; cudnn.h: ${cudnn_h:-not found}" | tee -a "$out/host.txt"

# ---- build ----
build=$root/build-gpu
jobs=$(nproc)
if want build; then
  step configure 300 meson setup "$build" --wipe -Dgpu=enabled -Dmpi=disabled -Dtests=enabled \
    -Dcpu=native -Dbuildtype=release ${cudnn_h:+-Dcudnn_include=$(dirname "$cudnn_h")} ||
    cp "$build/meson-logs/meson-log.txt" "$out/meson-log.txt" 2>/dev/null
  step build 900 ninja -C "$build" -j "$jobs" tools/seqpar tests/gpu/gpu-device-test tests/gpu/gpu-check-test \
    tests/gpu/gpu-kernels-test tests/gpu/core-headers-nvcc-test bench/gpu_attention_bench \
    bench/nccl_a2a_bench bench/reference_bench
fi
if [ ! -x "$build/tests/gpu/gpu-device-test" ] && [ -n "$prebuilt" ]; then
  echo "run.sh: using the prebuilt folder $prebuilt" | tee -a "$summary"
  build=$prebuilt
fi
bin() { echo "$build/$1"; }

# report_row check|validate FILE: one table line from a --json report (or why there is none).
report_row() {
  python3 - "$1" "$2" <<'PY'
import json, sys
kind, path = sys.argv[1], sys.argv[2]
name = path.rsplit('/', 1)[-1]
try:
    r = json.load(open(path))
except Exception as e:
    print(f"{name:24} no report ({e.__class__.__name__})")
    raise SystemExit
s = r["seconds"]
if kind == "check":
    worst = max((x.get("of_bound", 0) or 0) for x in r["rows"]) if r["rows"] else 0
    print(f"{name:24} {r['backend']:4} {r['dtype']:5} pass={r['pass']!s:5} "
          f"sp {s['sp']:8.2f} s  reference {s['reference']:8.2f} s  "
          f"worst row {worst:.3f} of bound  {r.get('device') or ''}")
else:
    print(f"{name:24} pass={r['pass']!s:5} gpu {s['gpu']:7.2f} s  reference "
          f"{s['reference']:7.2f} s  ×{s['reference'] / max(s['gpu'], 1e-9):6.2f}  "
          f"{r['attention_engine']}; set-up: {r.get('gpu_setup', {}).get('in_words', '?')}")
PY
}

# ---- tests ----
if want test; then
  step test-gpu-kernels 120 "$(bin tests/gpu/gpu-kernels-test)"
  step test-core-headers-nvcc 120 "$(bin tests/gpu/core-headers-nvcc-test)"
  step test-gpu-device 240 "$(bin tests/gpu/gpu-device-test)"
  step test-gpu-validate-cli 120 sh "$root/tests/gpu/validate-cli-test.sh" "$(bin tools/seqpar)"
  RC_PARAMS=max_success=30 step test-gpu-check 240 "$(bin tests/gpu/gpu-check-test)"
fi

# ---- seqpar check --backend gpu: the whole SP step on the GPU beside the CPU backend's, on the
# default scenario and on a 4K-token two-layer model (JSON: seconds.sp, seconds.reference) ----
if want check; then
  for dt in f32 bf16; do
    step "check-default-$dt" 120 "$(bin tools/seqpar)" check --backend gpu --dtype "$dt" --json --quiet
  done
  big=(--heads 16 --kv-heads 4 --head-dim 128 --hidden 1024 --intermediate 2816 --vocab 8192
       --layers 2 --docs 2048,1024,1024 -u 4 -r 2 --json --quiet)
  for dt in f32 bf16; do
    step "check-4k-gpu-$dt" 180 "$(bin tools/seqpar)" check --backend gpu --dtype "$dt" "${big[@]}"
  done
  step check-4k-cpu-f32 180 "$(bin tools/seqpar)" check --dtype f32 "${big[@]}"
  for f in "$out"/check-*.log; do report_row check "$f" | tee -a "$out/check-table.txt"; done
fi

# ---- seqpar validate on a mid-size attention layer: the GPU's time beside the CPU reference's,
# with each attention engine (JSON: seconds.gpu, seconds.reference) ----
if want validate; then
  for engine in cudnn simt; do
    step "validate-$engine" 120 "$(bin tools/seqpar)" validate --heads 16 --kv-heads 4 --head-dim 128 \
      --docs 2048,1024,1024 -u 4 -r 2 --dtype bf16 --attention-engine "$engine" --quiet --json
  done
  # The same layer at 32K tokens (the reference's S² work grows 64×, the GPU's fixed costs not).
  step validate-32k-cudnn 240 "$(bin tools/seqpar)" validate --heads 16 --kv-heads 4 --head-dim 128 \
    --docs 16384,8192,8192 -u 4 -r 2 --dtype bf16 --attention-engine cudnn --quiet --json
  for f in "$out"/validate-*.log; do report_row validate "$f" | tee -a "$out/validate-table.txt"; done
fi

# ---- benchmarks ----
if want bench; then
  step bench-attention-simt 120 "$(bin bench/gpu_attention_bench)" --engine simt -b 16M -e 16M \
    -n 2 -w 1 -J "$out/bench-attention-simt.json"
  for P in 4 8; do
    step "bench-a2a-$P" 120 "$(bin bench/nccl_a2a_bench)" -t "$P" -b 64K -e 256M -f 4 -n 20 -w 5 \
      -J "$out/bench-a2a-$P.json"
  done
fi
if want variants; then
  # Each pass of seqpar's cuDNN attention alone, per graph choice, beside SDPA's (S = 8192).
  step attention-variants 480 python3 "$root/bench/attention_variants.py" \
    --seqpar "$(bin bench/gpu_attention_bench)" --out "$out/attention-variants.json"
fi
if want sdpa; then
  # seqpar's cuDNN attention (both backward modes) beside torch's SDPA: the attention table.
  step sdpa 300 python3 "$root/bench/attention_vs_sdpa.py" --seqpar "$(bin bench/gpu_attention_bench)" \
    --out "$out/sdpa.json"
fi

# ---- compute-sanitizer over the device tests (the validate scenarios excluded: minutes each) ----
if want sanitize; then
  cs=$(command -v compute-sanitizer || find_first /usr/local/cuda/bin/compute-sanitizer)
  # memcheck covers cuDNN's kernels too; initcheck, synccheck and racecheck run over seqpar's
  # own kernels only: on cuDNN's Hopper attention kernels (TMA stores, mbarrier pipelines) they
  # report what they cannot model (seen: initcheck flags every TMA-written output as
  # uninitialised, racecheck flags the wgmma pipelines, synccheck overflows its barrier table).
  for tool in memcheck initcheck synccheck racecheck; do
    extra=()
    filter='device.*:device_local.*:-*cudnn*:*engines*'
    [ "$tool" = memcheck ] && extra=(--leak-check full) && filter='device.*:device_local.*'
    step "sanitize-$tool" 240 "$cs" --tool "$tool" "${extra[@]}" --error-exitcode 3 \
      "$(bin tests/gpu/gpu-device-test)" --gtest_filter="$filter"
  done
  # The whole step on the device (the SIMT kernels, the dense ops, the pool), one scenario with
  # its planted bugs, under memcheck with the leak check.
  step sanitize-memcheck-check 120 "$cs" --tool memcheck --leak-check full --error-exitcode 3 \
    "$(bin tests/gpu/gpu-check-test)" --gtest_filter='gpu_check.planted_bugs_are_named_at_their_stage'
fi

# ---- the CPU backend on every core ----
if want scale; then
  step scale-whole-check 600 "$(bin bench/reference_bench)" --whole-check -b 16M -e 16M \
    --thread-counts "$threads" -J "$out/scale-whole-check.json"
fi

echo "---- summary ($out)"
cat "$summary"
for f in "$out"/bench-*.log "$out"/sdpa.log "$out"/attention-variants.log "$out"/scale-whole-check.log; do
  [ -f "$f" ] && { echo "---- $(basename "$f")"; grep -v '^$' "$f" | tail -n 25; }
done
exit $failed

#!/usr/bin/env bash
# The precision catalogue's GPU side (issue 37), for a machine with a CUDA GPU and torch >= 2.3:
# torch SDPA with each backend forced (flash, memory-efficient, cuDNN, math, math with TF32) in
# bf16, f16 and f32 at the catalogue's shape and two larger ones, each job's dump judged by
# `seqpar validate --dump`; then the CPU catalogue again, which on torch 2.x adds the f16 rows
# (torch 1.13's CPU has no float16 exp). Writes into OUTDIR: gpu.txt (the device and versions),
# gpu.log / cpu.log (one "ROW {json}" line per job, kept when a phase runs out of time),
# gpu.json / cpu.json (the catalogues), f16_dumps.tgz (the CPU catalogue's f16 dumps) and
# sdpa_dumps.tgz (the catalogue-shape SDPA dumps, which
# tests/equivalence/data/precision/sdpa keeps so that CI judges real GPU kernels' output).
#   gpu_catalogue.sh SEQPAR OUTDIR [GPU_SECONDS] [CPU_SECONDS]
set -uo pipefail
seqpar=$(realpath "$1")
out=$2
gpu_s=${3:-330}
cpu_s=${4:-120}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name(0))'
  "$seqpar" --version
} >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
keep=$(mktemp -d)
work=$(mktemp -d)
timeout "$gpu_s" python3 "$here/precision_catalogue.py" --seqpar "$seqpar" --kind gpu -j 4 \
  --keep "$keep" --out "$work/gpu" >"$out/gpu.log" 2>&1
echo "gpu phase: exit $?"
grep -v '^ROW ' "$out/gpu.log" | grep -v Warning | tail -n 60
keep16=$(mktemp -d)
timeout "$cpu_s" python3 "$here/precision_catalogue.py" --seqpar "$seqpar" --kind cpu -j 8 \
  --keep "$keep16" --out "$work/cpu" >"$out/cpu.log" 2>&1
echo "cpu phase: exit $?"
grep -v '^ROW ' "$out/cpu.log" | tail -n 40
for k in gpu cpu; do
  [ -f "$work/$k/catalogue.json" ] && cp "$work/$k/catalogue.json" "$out/$k.json"
done
(cd "$keep" && ls -d ulysses-sdpa_*-* 2>/dev/null | grep -v '_d64-\|_d128-' |
  tar -czf "$out/sdpa_dumps.tgz" -T -)
(cd "$keep16" && ls -d *-f16 2>/dev/null | grep 'healthy\|lowp\|rescale' |
  tar -czf "$out/f16_dumps.tgz" -T -)
ls -la "$out"

#!/bin/sh
# `seqpar validate` end to end: without a usable GPU it must exit 2 saying why (this is what
# runs on GPU-less CI, reported as a pass of the contract); with one, the default scenario must
# pass in float32 and bfloat16 (exit 0).
seqpar="$1"
out=$("$seqpar" validate --quiet 2>&1); rc=$?
if [ $rc -eq 2 ]; then
  echo "$out" | grep -q "no CUDA device: cudaGetDeviceCount" || { echo "exit 2 without the reason: $out"; exit 1; }
  echo "no GPU: exit 2 with: $out"
  exit 77
fi
[ $rc -eq 0 ] || { echo "validate f32 failed ($rc): $out"; exit 1; }
"$seqpar" validate --quiet --dtype bf16 >/dev/null || { echo "validate bf16 failed"; exit 1; }
"$seqpar" validate --quiet --scenario ulysses --json | grep -q '"pass":true' || { echo "ulysses scenario failed"; exit 1; }
exit 0

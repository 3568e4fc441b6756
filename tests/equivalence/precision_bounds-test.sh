#!/usr/bin/env bash
# Both sides of validate --dump's bounds on real kernels' output (issue 37), without a GPU:
#  1. the committed dumps of torch SDPA on an H200 (flash, memory-efficient, cuDNN; bf16, f16,
#     f32; TF32 in a float32 job) and of torch 2.11's float16 jobs are judged again: every
#     verdict and first failing stage as recorded, every stage's fraction of its bound within 2×
#     (tests/equivalence/data/precision/dumps/expected.json);
#  2. planted errors (planted_error.py): per quantity and dtype, the committed healthy dump with
#     the largest error passes, and the same dump with that error multiplied by the stated factor
#     (tests/equivalence/data/precision/planted.json) fails at that quantity's stage.
#   precision_bounds-test.sh SEQPAR SOURCE_DIR
set -u
seqpar=$1
src=$2
data=$src/tests/equivalence/data/precision
. "$(dirname "$0")/torch_python.sh"
status=0
"$py" "$src/tests/jobs/precision_catalogue.py" --seqpar "$seqpar" --dumps "$data/dumps" \
  --check "$data/dumps/expected.json" || status=1
"$py" "$src/tests/equivalence/planted_error.py" --seqpar "$seqpar" --cases "$data/planted.json" \
  --calibration "$data/sdpa_h200.json" "$data/sdpa_h200_seeds.json" "$data/catalogue_torch211.json" \
  "$data/catalogue.json" ||
  status=1
exit $status

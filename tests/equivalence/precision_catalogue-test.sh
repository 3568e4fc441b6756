#!/usr/bin/env bash
# The precision catalogue (issue 37) rerun now: correct kernels that round or add differently
# and kernels with real precision bugs, as PyTorch SP jobs on gloo (tests/jobs/sp_jobs.py,
# PRECISION), each judged by seqpar validate --dump. Every verdict and first failing stage must
# match tests/equivalence/data/precision/catalogue_torch211.json (the catalogue under the pinned
# torch; catalogue.json is the same catalogue under Debian's torch 1.13, kept as data); a bug's
# error as a fraction of its bound must be within 2× of the recorded one (a bound loosened or
# tightened by more than 2×, or a kernel that changed, fails here), a correct kernel's within
# its bound (its rounding is its machine's: it differs by ISA).
#   precision_catalogue-test.sh SEQPAR SOURCE_DIR [I/N]   (I/N: every N-th entry from the I-th)
set -u
seqpar=$1
src=$2
shard=${3:-1/1}
. "$(dirname "$0")/torch_python.sh"
exec "$py" "$src/tests/jobs/precision_catalogue.py" --seqpar "$seqpar" --shard "$shard" \
  --check "$src/tests/equivalence/data/precision/catalogue_torch211.json"

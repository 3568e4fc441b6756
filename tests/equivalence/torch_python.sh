# Sourced by the tests that run PyTorch: sets $py to the project venv's Python (.venv, made by
# `./setup.sh test` from requirements.txt: the pinned torch, Hypothesis, pytest and the SP
# frameworks), or to $PYTHON when set (another torch, e.g. to check a second torch version).
# No torch is a failure, not a skip: every test that needs torch has it after ./setup.sh test.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=${PYTHON:-$_root/.venv/bin/python}
if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "FAIL: $py cannot import torch: run ./setup.sh test (it makes .venv from requirements.txt)," \
    "or set PYTHON to a Python that has torch"
  exit 1
fi
# One intra-op thread per torch process unless the caller says otherwise: the tests run two at
# a time on CI's two cores, each with a parent and 2–4 gloo rank processes, and OpenMP workers
# that spin after every parallel region take the cores the other processes wait for (measured:
# two Python shards side by side 4–8 % faster with one thread each).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

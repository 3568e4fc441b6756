#!/usr/bin/env bash
# pytest over tests/python (or the files given) with the Python that has torch, SEQPAR = the
# build's binary.
#   run_pytest.sh SEQPAR SOURCE_DIR [FILE…]
set -u
SEQPAR=$(realpath "$1")
export SEQPAR
src=$2
shift 2
. "$src/tests/equivalence/torch_python.sh"
"$py" -c 'import hypothesis, pytest' 2>/dev/null || {
  echo "SKIP: $py lacks hypothesis or pytest (apt-get install python3-hypothesis python3-pytest)"
  exit 77
}
cd "$src" && exec "$py" -m pytest -q -p no:cacheprovider "${@:-tests/python}"

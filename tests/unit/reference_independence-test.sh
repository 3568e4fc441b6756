#!/usr/bin/env bash
# The oracle shares no code with what it checks (src/sim/reference.hpp):
#  1. its sources (src/sim/reference*.{hpp,cpp}) include no project header but
#     core/scenario.hpp (a struct of sizes), core/error.hpp (the error types) and its own
#     headers — in particular none of core's SP
#     algorithms, the communicator, the compute backend, collation or the SP model;
#  2. those two headers include no project header themselves;
#  3. its static library needs no seqpar symbol from outside seqpar::ref (nothing of
#     libseqpar_core or libseqpar_sim is linked into it).
#   reference_independence-test.sh SOURCE_DIR LIBSEQPAR_REF
set -u
src=$1
lib=$2
failures=0

project_includes() { sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$@"; }

# The oracle's own headers are every src/sim/reference*.hpp there is.
allowed="core/scenario.hpp core/error.hpp"
for h in "$src"/src/sim/reference*.hpp; do
  allowed="$allowed sim/${h##*/}"
done
for f in "$src"/src/sim/reference*.hpp "$src"/src/sim/reference*.cpp; do
  for inc in $(project_includes "$f"); do
    case " $allowed " in
      *" $inc "*) ;;
      *) echo "FAIL: ${f#"$src"/} includes \"$inc\"; the oracle may include only: $allowed"
         failures=$((failures + 1)) ;;
    esac
  done
done

for f in "$src/src/core/scenario.hpp" "$src/src/core/error.hpp"; do
  incs=$(project_includes "$f")
  if [ -n "$incs" ]; then
    echo "FAIL: ${f#"$src"/} (included by the oracle) now includes: $incs"
    failures=$((failures + 1))
  fi
done

if ! command -v nm >/dev/null; then
  echo "FAIL: nm not found (binutils) to inspect $lib"
  exit 1
fi
foreign=$(nm -C --undefined-only "$lib" | grep -F 'seqpar::' | grep -vF 'seqpar::ref::' | sort -u)
if [ -n "$foreign" ]; then
  echo "FAIL: $(basename "$lib") needs seqpar symbols from outside the oracle:"
  echo "$foreign" | sed 's/^/    /'
  failures=$((failures + 1))
fi
defined=$(nm -C --defined-only "$lib" | grep -c 'seqpar::ref::train_step')
if [ "$defined" -eq 0 ]; then
  echo "FAIL: $(basename "$lib") does not define seqpar::ref::train_step (wrong library?)"
  failures=$((failures + 1))
fi

if [ "$failures" -gt 0 ]; then
  exit 1
fi
echo "oracle independent: includes only $allowed; $(basename "$lib") needs no other seqpar symbol"

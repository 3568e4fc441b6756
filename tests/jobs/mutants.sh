#!/usr/bin/env bash
# Does `seqpar check` catch ordinary bugs in code the SP step and the old single-rank reference
# shared? Applies one source mutation at a time to a scratch copy of the tree, rebuilds seqpar
# incrementally in one scratch build directory, runs `seqpar check --scenario NAME` (float64) on
# every built-in scenario and reports, per mutant, the scenarios whose check failed (caught) —
# then reverts it. Not a CI test: it rebuilds four times (minutes on two cores).
#   tests/jobs/mutants.sh [--rev REV] [SCRATCH_DIR]
#     --rev REV    mutate the tree of commit REV instead of the working tree (to compare with an
#                  older reference, e.g. the parent of the commit that wired the oracle in)
# Exit 0 when every mutant applied and built (caught or not), 2 on a setup error.
set -u
src=$(cd "$(dirname "$0")/../.." && pwd)
rev=""
if [ "${1:-}" = "--rev" ]; then
  rev=$2
  shift 2
fi
scratch=${1:-/tmp/seqpar-mutants}
scenarios=(default ulysses ring qwen3-8b llama3-8b qwen2.5-7b mha-8)

rm -rf "$scratch/tree"
mkdir -p "$scratch/tree"
if [ -n "$rev" ]; then
  git -C "$src" archive --format=tar "$rev" | tar -x -C "$scratch/tree" || exit 2
else
  (cd "$src" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) |
    tar -x -C "$scratch/tree" || exit 2
fi
tree=$scratch/tree
build=$scratch/build-${rev:-worktree}
if [ ! -d "$build" ]; then
  meson setup "$build" "$tree" -Dbuildtype=release -Dgpu=disabled -Dmpi=disabled -Dtests=disabled >/dev/null || exit 2
fi
build_seqpar() { ninja -C "$build" tools/seqpar >"$scratch/build.log" 2>&1; }

# mutant NAME FILE OLD NEW: replace the one occurrence of OLD in FILE by NEW.
names=()
files=()
olds=()
news=()
mutant() {
  names+=("$1")
  files+=("$2")
  olds+=("$3")
  news+=("$4")
}
mutant "ulysses_forward: attention's V built from K (stack_kv(k_rep, k_rep))" \
  src/core/ulysses.cpp \
  'tensor kv = c.stack_kv(k_rep, v_rep)' \
  'tensor kv = c.stack_kv(k_rep, k_rep)'
mutant "ulysses_backward: fused K/V gradient unstacked as (dV, dK)" \
  src/core/ulysses.cpp \
  'cfg.head_dim}), dk_rep, dv_rep);' \
  'cfg.head_dim}), dv_rep, dk_rep);'
mutant "sp_setup: local attention softmax scale 1/head_dim instead of 1/sqrt(head_dim)" \
  src/sim/sp_setup.cpp \
  'd.scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));' \
  'd.scale = 1.0 / static_cast<double>(s.head_dim);'
mutant "model: SwiGLU inputs swapped in the forward (silu(up)·gate)" \
  src/sim/model.cpp \
  'c.act = ops::swiglu_fwd(c.gate, c.up);' \
  'c.act = ops::swiglu_fwd(c.up, c.gate);'

run_checks() {  # prints the scenarios whose check fails; "ERROR(name)" for exit codes ≥ 2
  local caught=()
  for s in "${scenarios[@]}"; do
    "$build/tools/seqpar" check --scenario "$s" --quiet >/dev/null 2>&1
    case $? in
      0) ;;
      1) caught+=("$s") ;;
      *) caught+=("ERROR($s)") ;;
    esac
  done
  echo "${caught[*]}"
}

echo "tree: ${rev:-working tree of $src}; scratch build: $build"
build_seqpar || { echo "clean build failed: $scratch/build.log"; exit 2; }
clean=$(run_checks)
if [ -n "$clean" ]; then
  echo "the unmutated tree already fails on: $clean"
  exit 2
fi
echo "unmutated: all ${#scenarios[@]} scenarios pass"
caught_count=0
for i in "${!names[@]}"; do
  f=$tree/${files[$i]}
  cp "$f" "$scratch/original"
  if ! python3 - "$f" "${olds[$i]}" "${news[$i]}" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(1)
open(path, "w").write(text.replace(old, new))
PY
  then
    echo "[not applicable] ${names[$i]} (${files[$i]} changed)"
    continue
  fi
  if build_seqpar; then
    caught=$(run_checks)
    if [ -n "$caught" ]; then
      caught_count=$((caught_count + 1))
      echo "[CAUGHT] ${names[$i]}: check fails on $caught"
    else
      echo "[missed] ${names[$i]}: every scenario passes"
    fi
  else
    echo "[build error] ${names[$i]} (see $scratch/build.log)"
  fi
  cp "$scratch/original" "$f"
done
build_seqpar
echo "caught $caught_count of ${#names[@]} mutants"

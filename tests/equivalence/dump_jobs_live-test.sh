#!/usr/bin/env bash
# The real PyTorch SP jobs rerun now (tests/jobs/sp_jobs.py --all: gloo, 2–4 processes per
# job) and judged by seqpar validate --dump: healthy jobs pass, each broken one is diagnosed at the
# stage and ranks its entry in data/dumps/expected.json names. Exit 77 (meson SKIP) without torch.
# The entries of job "veomni" (tests/jobs/veomni_ulysses_job.py, VeOmni's own Ulysses
# all-to-alls) run on $VEOMNI_DIR (a checkout) or the pinned veomni package of the project venv.
#   dump_jobs_live-test.sh SEQPAR SOURCE_DIR
set -u
seqpar=$1
src=$2
. "$(dirname "$0")/torch_python.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# VeOmni: $VEOMNI_DIR (a checkout), else the veomni package of the project venv.
veomni=${VEOMNI_DIR:-$("$py" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("veomni").submodule_search_locations[0]))' 2>/dev/null)}
if [ -z "$veomni" ]; then
  echo "FAIL: no VeOmni: the project venv has no veomni package (./setup.sh test installs it)"
  exit 1
fi
export VEOMNI_DIR=$veomni
if [ -n "${VEOMNI_DIR:-}" ]; then
  "$py" "$src/tests/jobs/veomni_ulysses_job.py" --all --veomni "$VEOMNI_DIR" "$tmp/dumps" \
    >"$tmp/veomni.log" 2>&1 || {
    tail -20 "$tmp/veomni.log"
    exit 1
  }
fi
"$py" "$src/tests/jobs/sp_jobs.py" --all "$tmp/dumps" --no-twins >"$tmp/jobs.log" 2>&1 || {
  tail -20 "$tmp/jobs.log"
  exit 1
}
# The rings under the options and the whole-block ring (job "testing": seqpar.testing's hook).
SEQPAR=$seqpar "$py" "$src/tests/jobs/option_dumps.py" "$tmp/dumps" --no-twins \
  >"$tmp/options.log" 2>&1 || {
  tail -20 "$tmp/options.log"
  exit 1
}
for d in "$tmp"/dumps/*/; do
  name=$(basename "$d")
  "$seqpar" validate --dump "$d" -q --json >"$tmp/$name.json" 2>"$tmp/$name.err"
  echo $? >"$tmp/$name.rc"
done
"$py" - "$src/tests/equivalence/data/dumps/expected.json" "$tmp" <<'PY'
import json, os, sys
expected = json.load(open(sys.argv[1]))
tmp = sys.argv[2]
bad = 0
skipped = 0
for name, e in sorted(expected.items()):
    if e["job"] == "veomni" and not os.environ.get("VEOMNI_DIR"):
        print(f"skip {name} (needs VEOMNI_DIR)"); skipped += 1; continue
    path = os.path.join(tmp, name + ".json")
    if not os.path.exists(path):
        print(f"FAIL {name}: the job produced no dump"); bad += 1; continue
    rc = int(open(os.path.join(tmp, name + ".rc")).read())
    rep = json.load(open(path)) if rc in (0, 1) else None
    if rep is None:
        print(f"FAIL {name}: exit {rc}: {open(os.path.join(tmp, name + '.err')).read().strip()}"); bad += 1; continue
    first = rep["first_difference"]
    if e["healthy"]:
        ok = rc == 0 and rep["pass"] and first is None
    else:
        ok = rc == 1 and first is not None and first["stage"] == e["first_stage"] \
            and first["ranks"] == e["ranks"]
    print(("ok   " if ok else "FAIL ") + name + ("" if e["healthy"] else
          f": {first['stage'] if first else None} ranks {first['ranks'] if first else None}"))
    bad += not ok
print(f"{len(expected) - skipped - bad} of {len(expected) - skipped} jobs judged as expected"
      + (f" ({skipped} skipped)" if skipped else ""))
sys.exit(1 if bad else 0)
PY

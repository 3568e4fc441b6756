#!/usr/bin/env bash
# Every HTML page seqpar writes, loaded in headless Chromium (issue 34): plan --html for the
# layouts that differ (hybrid zigzag with KV repeats, contiguous ring, DeepSpeed, VeOmni,
# GatedDeltaNet), replay --html of a real broken job, validate --dump --html of a failing real
# dump, and a replay --perfetto file parsed by a page in the browser. Each must load offline
# without a console error, hold its elements and show a non-blank screenshot; sizes printed.
#   pages-test.sh SEQPAR SOURCE_DIR FAILING_CHECK_PAGE [SCREENSHOT_DIR]
# FAILING_CHECK_PAGE: the test program that writes a failing check's --html page.
# Screenshots go to SCREENSHOT_DIR (docs/screenshots when refreshing the docs), else a temp dir.
set -u
seqpar=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
check_page_prog=$3
shots=${4:-$tmp}
mkdir -p "$shots"
py=$(command -v python3)
check="$src/tests/browser/check_page.py"
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  echo "SKIP: no chromium (setup.sh test installs it)"
  exit 77
fi
fails=0
page() {  # page NAME FILE SNIPPET...
  local name=$1 file=$2
  shift 2
  if ! "$py" "$check" "$file" "$shots/$name.png" "$@"; then
    echo "FAIL $name"
    fails=$((fails + 1))
  fi
}
make_page() {  # make_page NAME WANT_RC SEQPAR-ARGS...: run seqpar, expect its exit code
  local name=$1 want=$2
  shift 2
  "$seqpar" "$@" >"$tmp/$name.out" 2>&1
  local rc=$?
  if [ "$rc" != "$want" ]; then
    echo "FAIL $name: seqpar $* exited $rc (want $want)"; tail -3 "$tmp/$name.out"
    fails=$((fails + 1))
  fi
}

make_page plan-hybrid 0 plan --ulysses 4 --ring 2 --heads 8 --kv-heads 2 --docs 40,24,16 --html "$tmp/plan-hybrid.html"
page plan-hybrid "$tmp/plan-hybrid.html" '<svg class="tokens"' 'class="cell repeat"' '<table class="ring">' '<svg class="work"' 'Bytes per collective'
make_page plan-contiguous 0 plan --ulysses 1 --ring 4 --no-zigzag --docs 32,32 --html "$tmp/plan-contiguous.html"
page plan-contiguous "$tmp/plan-contiguous.html" '<svg class="tokens"' '<table class="ring">' ', contiguous'
make_page plan-deepspeed 0 plan --profile deepspeed --html "$tmp/plan-deepspeed.html"
page plan-deepspeed "$tmp/plan-deepspeed.html" '<svg class="tokens"' 'profile deepspeed'
make_page plan-veomni 0 plan --profile veomni --ulysses 2 --ring 1 --heads 4 --kv-heads 2 --docs 13,7 --html "$tmp/plan-veomni.html"
page plan-veomni "$tmp/plan-veomni.html" '<svg class="heads"' 'profile veomni'
make_page plan-gdn 0 plan --scenario qwen3.5 --html "$tmp/plan-gdn.html"
page plan-gdn "$tmp/plan-gdn.html" 'GatedDeltaNet layers' '<svg class="tokens"'
make_page check-pass 0 check --html "$tmp/check-pass.html"
page check-pass "$tmp/check-pass.html" 'Compared tensors' 'PASS'
if "$check_page_prog" "$tmp/check-fail.html" >"$tmp/check-fail.out" 2>&1; then
  page check-fail "$tmp/check-fail.html" 'FAIL' 'class="heatmap"' 'Where it differs' 'logits — error over tokens × vocabulary'
else
  echo "FAIL check-fail: $check_page_prog did not write a failing check's page"; tail -3 "$tmp/check-fail.out"
  fails=$((fails + 1))
fi
make_page replay 1 replay "$src/traces/broken_real_gloo_ring4_wrong_peer.jsonl" --html "$tmp/replay.html"
page replay "$tmp/replay.html" 'RING_PEER' '<svg'
make_page validate 1 validate --dump "$src/tests/equivalence/data/dumps/ring-ring_src_off_by_one-f32" -q --html "$tmp/validate.html"
page validate "$tmp/validate.html" 'seqpar validate --dump' 'FAIL' 'class="heatmap"' 'Where it differs'
# The Perfetto file, parsed by a page in the browser: the trace-event JSON inline, checked by
# JavaScript, the verdict written into the DOM.
make_page perfetto 1 replay "$src/traces/broken_real_gloo_ring4_wrong_peer.jsonl" --perfetto "$tmp/ring.perfetto.json"
"$py" - "$tmp/ring.perfetto.json" "$tmp/perfetto.html" <<'PY'
import json, sys
trace = open(sys.argv[1]).read()
page = """<!doctype html><html><head><meta charset="utf-8"><title>perfetto file</title></head>
<body><h1>Chrome trace-event file</h1><pre id="out">not parsed</pre>
<script id="trace" type="application/json">%s</script>
<script>
const doc = JSON.parse(document.getElementById('trace').textContent);
const ev = doc.traceEvents;
const bad = ev.filter(e => !('ph' in e) || !('pid' in e) || !('tid' in e)
  || (['X', 'i', 's', 'f'].includes(e.ph) && typeof e.ts !== 'number')
  || (e.ph === 'X' && !(e.dur > 0)));
const count = ph => ev.filter(e => e.ph === ph).length;
document.getElementById('out').textContent = bad.length === 0
  ? `parsed: ${count('X')} slices, ${count('i')} findings, ${count('s')} flows, ${doc.otherData.verdict}`
  : `malformed events: ${bad.length}`;
// Draw the slices (a row per rank) and the findings (red marks), as a trace viewer would.
const slices = ev.filter(e => e.ph === 'X'), marks = ev.filter(e => e.ph === 'i');
const end = Math.max(...slices.map(e => e.ts + e.dur));
const svg = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
svg.setAttribute('width', 1000); svg.setAttribute('height', 400);
const add = (x, y, w, h, fill) => {
  const r = document.createElementNS('http://www.w3.org/2000/svg', 'rect');
  r.setAttribute('x', x); r.setAttribute('y', y); r.setAttribute('width', Math.max(w, 2));
  r.setAttribute('height', h); r.setAttribute('fill', fill); svg.appendChild(r);
};
for (const e of slices) add(900 * e.ts / end, 20 + 80 * e.pid + 20 * (e.tid - 1), 900 * e.dur / end, 16, '#4e79a7');
for (const e of marks) add(900 * e.ts / end, 10 + 80 * e.pid, 4, 60, '#e15759');
document.body.appendChild(svg);
</script></body></html>""" % trace.replace("</", "<\\/")
open(sys.argv[2], "w").write(page)
PY
page perfetto "$tmp/perfetto.html" 'parsed: 12 slices, 5 findings, 4 flows, 5 problem(s)'
if [ "$fails" -gt 0 ]; then
  echo "$fails browser check(s) failed"
  exit 1
fi
echo "all pages load in Chromium"

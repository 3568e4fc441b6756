#!/usr/bin/env python3
"""`seqpar replay --json` and the text report agree on every committed trace (traces/*.jsonl, and
every sample under traces/import-samples imported first): the same exit code, every exit 1 with
its reasons under "problems" (a rank that left no file included), the text's numbered findings
in the JSON in the same order with the same category and message, and an exit 0 with none; a
trace nothing can be judged on exits 2 both ways with the same one error message.

Usage: replay_json_agrees.py SEQPAR SOURCE_ROOT"""
import json
import os
import re
import subprocess
import sys
import tempfile

seqpar, src = sys.argv[1], sys.argv[2]
failures = []
checked = []
refused = []


def fail(what):
    print("FAIL " + what, flush=True)
    failures.append(what)


def agree(name, trace):
    text = subprocess.run([seqpar, "replay", trace], capture_output=True, text=True)
    js = subprocess.run([seqpar, "replay", "--json", trace], capture_output=True, text=True)
    if text.returncode == js.returncode == 2:
        # nothing a verdict could be given on (no second rank, calls that cannot be aligned):
        # the same error both ways, no report
        if not (text.stderr.startswith("seqpar: error:") and js.stderr == text.stderr
                and not js.stdout.strip()):
            fail("%s: exit 2 without one error message both ways" % name)
        refused.append(name)
        return
    if text.returncode != js.returncode or text.returncode not in (0, 1):
        fail("%s: exit %d as text, %d with --json (%s)" % (name, text.returncode, js.returncode,
                                                           (text.stderr + js.stderr)[:300]))
        return
    try:
        rep = json.loads(js.stdout)
    except json.JSONDecodeError as e:
        fail("%s: --json printed no JSON (%s)" % (name, e))
        return
    probs = rep.get("problems", [])
    rc = text.returncode
    if rc == 0 and (probs or not rep.get("consistent")):
        fail("%s: exit 0 but the JSON lists %d problem(s), consistent=%s" % (
            name, len(probs), rep.get("consistent")))
    if rc == 1 and not probs:
        fail("%s: exit 1 with nothing under \"problems\" (text: %s)" % (
            name, text.stdout.splitlines()[0][:200] if text.stdout else ""))
    if rep.get("problems_total", 0) < len(probs):
        fail("%s: problems_total %s below the %d listed" % (name, rep.get("problems_total"),
                                                           len(probs)))
    missing = rep.get("missing_ranks", [])
    head = [p for p in probs[:len(missing)]]
    if [p.get("category") for p in head] != ["MISSING_RANK"] * len(missing) or \
            [p.get("rank") for p in head] != missing:
        fail("%s: the ranks without a file %s do not lead \"problems\" as MISSING_RANK: %s" % (
            name, missing, [(p.get("category"), p.get("rank")) for p in head]))
    if missing and "INCOMPLETE" not in text.stdout:
        fail("%s: ranks %s left no file but the text does not say INCOMPLETE" % (name, missing))
    lines = re.findall(r"^\s*\d+\. \[([A-Z0-9_]+)\] (.*)$", text.stdout, re.M)
    rest = probs[len(missing):]
    if len(lines) != len(rest):
        fail("%s: the text lists %d finding(s), the JSON %d besides the missing ranks" % (
            name, len(lines), len(rest)))
    for (cat, msg), p in zip(lines, rest):
        if cat != p.get("category") or msg != p.get("message"):
            fail("%s: text [%s] %s / JSON [%s] %s" % (name, cat, msg[:120], p.get("category"),
                                                       str(p.get("message"))[:120]))
            break
    checked.append((name, rc, len(probs)))


traces = os.path.join(src, "traces")
for f in sorted(os.listdir(traces)):
    if f.endswith(".jsonl"):
        agree(f, os.path.join(traces, f))

samples = os.path.join(traces, "import-samples")
with tempfile.TemporaryDirectory() as tmp:
    def imported(name, fmt, path):
        out = os.path.join(tmp, name.replace("/", "_") + ".jsonl")
        p = subprocess.run([seqpar, "import", "--from", fmt, path, "--out", out],
                           capture_output=True, text=True)
        if p.returncode == 0:
            agree("import-samples/" + name, out)
        return p.returncode

    for d in sorted(os.listdir(samples)):
        path = os.path.join(samples, d)
        if not os.path.isdir(path):
            continue
        subs = [s for s in ("kineto", "fr") if os.path.isdir(os.path.join(path, s))]
        if subs:
            for s in subs:
                if imported("%s/%s" % (d, s), s, os.path.join(path, s)) != 0:
                    fail("import-samples/%s/%s: import failed" % (d, s))
        else:
            fmt = "fr" if d.startswith("fr") else "nccl-log" if d.startswith("nccl") else "kineto"
            # a sample the importer refuses on purpose (a broken dump) has no report to compare
            imported(d, fmt, path)

print("%d traces compared: %d consistent, %d with problems; %d refused alike (exit 2): %s" % (
    len(checked), sum(1 for c in checked if c[1] == 0), sum(1 for c in checked if c[1] == 1),
    len(refused), ", ".join(refused)))
if len(checked) < 30 or not any(c[1] == 0 for c in checked) or \
        not any(c[1] == 1 and c[2] > 0 for c in checked):
    fail("too few traces compared, or none consistent / none with problems: %s" % checked)
sys.exit(1 if failures else 0)

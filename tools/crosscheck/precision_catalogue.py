#!/usr/bin/env python3
r"""The precision catalogue (issue 37): real PyTorch SP jobs (tools/crosscheck/sp_jobs.py, gloo,
2–4 processes) that are correct but round or add differently, and jobs with the precision bugs
framework authors have made, each judged by `seqpar validate --dump`. Per job: the verdict, the
first failing stage, and per stage the error as a fraction of seqpar's bound (of_bound).

    precision_catalogue.py --seqpar build/tools/seqpar --out DIR      # run all, write DIR/
    precision_catalogue.py --seqpar … --check tests/equivalence/data/precision/expected.json

--out writes catalogue.json and catalogue.md (the table in docs/validate.md). --check compares
against a committed catalogue: every verdict and first stage must match, and every stage's
of_bound must be within --factor (default 2) of the recorded one, in both directions — so a
bound loosened or tightened by more than that factor, on the healthy side or on a bug, fails.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import sp_jobs  # noqa: E402

# Per computed quantity, the stages that carry it: a Ulysses job's attention runs on the gathered
# heads (out.attn, grad.*.gathered; its local stages are then exact all-to-alls), a ring job's on
# the local shards. Each column is the largest of_bound over its stages and ranks.
COLUMNS = {
    "out": ["out.local", "out.attn"],
    "lse": ["lse"],
    "dq": ["grad.q.local", "grad.q.gathered"],
    "dk": ["grad.k.local", "grad.k.gathered", "grad.k.repeated"],
    "dv": ["grad.v.local", "grad.v.gathered", "grad.v.repeated"],
}
STAGES = list(COLUMNS)


def entries():
    """(job, variant, dtype) of the catalogue: every precision variant in bf16, the correct ones
    in f32 too, and the low-precision ring merge (exp(lse) without the max)."""
    out = []
    for (job, variant), (over, bug, cause) in sp_jobs.PRECISION.items():
        out.append((job, variant, "bf16"))
        if bug is None:
            out.append((job, variant, "f32"))
    out.append(("ring", "lse_merge_no_max", sp_jobs.LOWP))
    return out


def judge(seqpar, d):
    r = subprocess.run([seqpar, "validate", "--dump", d, "-q", "--json"], capture_output=True,
                       text=True)
    if r.returncode not in (0, 1):
        return {"exit": r.returncode, "error": r.stderr.strip()[-400:]}
    j = json.loads(r.stdout)
    of = {}
    for row in j["rows"]:
        for col, stages in COLUMNS.items():
            if row["stage"] in stages:
                x = row["of_bound"]
                x = float("inf") if x == "inf" else float(x)
                of[col] = max(of.get(col, 0.0), x)
    first = j.get("first_difference") or {}
    return {"exit": r.returncode, "pass": j["pass"], "first_stage": first.get("stage"),
            "of_bound": {s: of[s] for s in STAGES if s in of}}


def run_all(seqpar, work, only=None):
    rows = []
    for job, variant, dtype in entries():
        if only and variant not in only:
            continue
        cfg = sp_jobs.make_cfg(job, variant, dtype)
        d = os.path.join(work, "%s-%s-%s" % (job, variant, dtype))
        if not sp_jobs.run_job(cfg, d, quiet=True):
            rows.append({"job": job, "variant": variant, "dtype": dtype, "healthy": cfg["bug"] is None,
                         "exit": -1, "error": "the job failed"})
            continue
        row = {"job": job, "variant": variant, "dtype": dtype, "healthy": cfg["bug"] is None,
               "what": sp_jobs.VARIANTS[(job, variant)][2],
               "shape": "U %d × R %d, S %d, heads %d/%d, head_dim %d, docs %s" % (
                   cfg["U"], cfg["R"], cfg["S"], cfg["H"], cfg["Hkv"], cfg["D"], cfg["docs"])}
        row.update(judge(seqpar, d))
        rows.append(row)
        print("%-8s %-26s %-4s %s %s" % (job, variant, dtype,
                                         "PASS" if row.get("pass") else "FAIL",
                                         " ".join("%s=%.3g" % kv for kv in row.get("of_bound", {}).items())),
              flush=True)
    return rows


def fmt(x):
    if x is None:
        return ""
    if x == float("inf"):
        return "inf"
    return "%.3g" % x


def markdown(rows):
    head = "| job | dtype | kind | verdict | first stage | " + " | ".join(STAGES) + " |\n"
    head += "|" + "---|" * (5 + len(STAGES)) + "\n"
    body = ""
    for r in rows:
        kind = "correct" if r["healthy"] else "bug"
        verdict = "error" if "pass" not in r else ("PASS" if r["pass"] else "FAIL")
        of = r.get("of_bound", {})
        body += "| %s %s | %s | %s: %s | %s | %s | %s |\n" % (
            r["job"], r["variant"], r["dtype"], kind, r.get("what", ""), verdict,
            r.get("first_stage") or "", " | ".join(fmt(of.get(s)) for s in STAGES))
    return head + body


def check(rows, expected, factor):
    want = {(e["job"], e["variant"], e["dtype"]): e for e in expected}
    problems = []
    for r in rows:
        key = (r["job"], r["variant"], r["dtype"])
        e = want.get(key)
        if e is None:
            problems.append("%s: not in the committed catalogue" % (key,))
            continue
        if r.get("pass") != e.get("pass") or r.get("first_stage") != e.get("first_stage"):
            problems.append("%s: verdict %s at %s, catalogue says %s at %s" % (
                key, r.get("pass"), r.get("first_stage"), e.get("pass"), e.get("first_stage")))
        for s, x in e.get("of_bound", {}).items():
            y = r.get("of_bound", {}).get(s)
            if y is None:
                problems.append("%s: stage %s not compared" % (key, s))
            elif x == 0 or y == 0 or x == float("inf") or y == float("inf"):
                if (x == 0) != (y == 0) or (x == float("inf")) != (y == float("inf")):
                    problems.append("%s %s: of_bound %s, catalogue %s" % (key, s, y, x))
            elif not (x / factor <= y <= x * factor):
                problems.append("%s %s: of_bound %.3g, catalogue %.3g (more than %g× apart: "
                                "a bound or a kernel changed)" % (key, s, y, x, factor))
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqpar", required=True)
    ap.add_argument("--out")
    ap.add_argument("--check", metavar="EXPECTED_JSON")
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        rows = run_all(os.path.abspath(a.seqpar), work, a.only)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "catalogue.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(a.out, "catalogue.md"), "w") as f:
            f.write(markdown(rows))
    if a.check:
        problems = check(rows, json.load(open(a.check)), a.factor)
        for p in problems:
            print("FAIL:", p)
        print("%d entries, %d problems" % (len(rows), len(problems)))
        return 1 if problems else 0
    return 0 if all("pass" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

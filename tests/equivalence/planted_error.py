#!/usr/bin/env python3
r"""Both sides of validate --dump's bounds (issue 37), from the test side: a healthy dump must
pass without precision notes, the same dump with one computed quantity's error multiplied by a
stated factor must fail at that quantity's stage, and with its error made 3× the largest any
correct kernel showed (seqpar's calibration) it must fail or carry a precision note on that
quantity, and fail under --strict.

The planted error is the kernel's own: every element x of the quantity's stages (a Ulysses job's
gathered and local copies alike, so the data movement between them stays exact) becomes
ref + k·(x − ref), ref the float64 non-SP reference (tests/jobs/sp_jobs.py), rounded back
to the dump's dtype. So "k = 3" is exactly "an error 3× what this correct kernel showed".

    planted_error.py --seqpar build/tools/seqpar --cases tests/equivalence/data/precision/planted.json
    planted_error.py --seqpar … --dump DIR --quantity dv --factor 3     # one case, printed

Cases: [{"dump": DIR (relative to the cases file), "quantity": out|lse|dq|dk|dv,
"factor": k, "why": "..."}, …]. Per case the healthy dump must pass with the quantity's
of_bound h, and the planted one must fail, first at one of the quantity's stages, with an
of_bound within 30 % of k·h (the transformation did what it says).
Supported layouts: ring (U = 1) and Ulysses with U ≤ KV heads and R = 1.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import torch

_SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_SRC, "tests", "jobs"))
sys.path.insert(0, os.path.join(_SRC, "tools"))
import precision_catalogue as pc  # noqa: E402
import seqpar_dump  # noqa: E402
import sp_jobs  # noqa: E402

# Per quantity: the stages that hold it and the reference tensor each is cut from.
STAGES = {
    "out": {"out.local": "out.local", "out.attn": "out.local"},
    "lse": {"lse": "lse"},
    "dq": {"grad.q.local": "grad.q.local", "grad.q.gathered": "grad.q.local"},
    "dk": {"grad.k.local": "grad.k.local", "grad.k.gathered": "grad.k.local"},
    "dv": {"grad.v.local": "grad.v.local", "grad.v.gathered": "grad.v.local"},
}


def _cfg_of(d):
    with open(os.path.join(d, "rank0.json")) as f:
        meta = json.load(f)
    cfg = sp_jobs.parse_job_string(meta.get("job", ""))
    if cfg is None:
        raise SystemExit("%s: not a dump of tests/jobs/sp_jobs.py (job %r)" % (d, meta.get("job")))
    if cfg["U"] > 1 and (cfg["R"] > 1 or cfg["U"] > cfg["Hkv"]):
        raise SystemExit("%s: planted errors need a ring job or a Ulysses job with U <= KV heads"
                         % d)
    return cfg


def _want(cfg, ref, meta, stage, source):
    """The reference values of one stage of one rank, in the dump's layout."""
    U, R = cfg["U"], cfg["R"]
    rr, u = meta["ring_rank"], meta["ulysses_rank"]
    full = ref[source]
    if stage == "lse":  # [heads of this rank, tokens of its ring rank]
        hq = cfg["H"] // U
        gidx = torch.tensor(sp_jobs.ring_tokens(cfg["cu"], R, rr), dtype=torch.long)
        return full[u * hq:(u + 1) * hq][:, gidx]
    if stage.endswith(".local"):
        idx = torch.tensor(sp_jobs.shard_tokens(cfg, rr, u), dtype=torch.long)
        return full[idx]
    # gathered (Ulysses, R = 1): every token, this rank's slice of the heads
    h = full.shape[1] // U
    return full[:, u * h:(u + 1) * h]


def plant(src, dst, quantity, k):
    """Copies dump src to dst with quantity's error multiplied by k."""
    cfg = _cfg_of(src)
    ref = sp_jobs.reference(cfg)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    touched = 0
    for name in sorted(os.listdir(dst)):
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        with open(os.path.join(dst, name)) as f:
            meta = json.load(f)
        for call in meta["calls"]:
            for side in ("forward", "backward"):
                if side not in call:
                    continue
                path = os.path.join(dst, call[side])
                tensors, md = seqpar_dump.read_safetensors(path, with_metadata=True)
                changed = False
                for stage, source in STAGES[quantity].items():
                    if stage not in tensors:
                        continue
                    x = tensors[stage]
                    want = _want(cfg, ref, meta, stage, source)
                    if tuple(want.shape) != tuple(x.shape):
                        raise SystemExit("%s %s: shape %s, reference %s" % (
                            path, stage, tuple(x.shape), tuple(want.shape)))
                    tensors[stage] = (want + k * (x.double() - want)).to(x.dtype)
                    changed = True
                    touched += 1
                if changed:
                    seqpar_dump.write_safetensors(path, tensors, md or None, durable=False)
    if not touched:
        raise SystemExit("%s: no stage of %s was dumped" % (src, quantity))


def judge(seqpar, d, quantity, strict=False):
    """(pass, first failing stage, the quantity's largest of_bound, precision-noted quantities,
    the report's calibration)."""
    code, j = pc.validate_json(seqpar, d, *(["--strict"] if strict else []))
    if code not in (0, 1):
        raise SystemExit("seqpar validate --dump %s: exit %d: %s" % (d, code, j))
    first = (j.get("first_difference") or {}).get("stage")
    noted = {n["quantity"] for n in j.get("precision_notes", [])}
    return j["pass"], first, pc.fractions(j).get(quantity, 0.0), noted, j.get("calibration")


def run_case(seqpar, dump, quantity, k, work):
    ok0, first0, h, noted0, cal = judge(seqpar, dump, quantity)
    planted = os.path.join(work, "planted")
    plant(dump, planted, quantity, k)
    ok1, first1, p, _, _ = judge(seqpar, planted, quantity)
    problems = []
    # Three times the largest error any correct kernel showed (the calibration's): it fails, or
    # passes with a precision note on this quantity — and fails under --strict.
    largest = cal["quantities"][quantity]["largest_correct"] if cal else 0
    if h > 0 and largest > 0:
        k3 = 3 * largest / h
        plant(dump, planted, quantity, k3)
        ok3, _, p3, noted3, _ = judge(seqpar, planted, quantity)
        strict3 = judge(seqpar, planted, quantity, strict=True)[0]
        if ok3 and quantity not in noted3:
            problems.append("an error 3× the largest correct one (×%.3g here, %.3g of the bound) "
                            "passes without a precision note" % (k3, p3))
        if strict3:
            problems.append("an error 3× the largest correct one passes --strict")
    shutil.rmtree(planted, ignore_errors=True)
    if noted0:
        problems.append("the healthy dump has precision notes on %s" % sorted(noted0))
    if not ok0:
        problems.append("the healthy dump fails (first at %s)" % first0)
    if ok1:
        problems.append("the error ×%g passes at %.3g of the bound: the bound is more than %g× "
                        "the healthy error (%.3g)" % (k, p, k, h))
    elif first1 not in STAGES[quantity]:
        problems.append("the error ×%g fails first at %s, not at a stage of %s" % (k, first1,
                                                                                  quantity))
    if h > 0 and not (0.7 * k * h <= p <= 1.3 * k * h):
        problems.append("planted of_bound %.3g is not ≈ %g × %.3g" % (p, k, h))
    return h, p, problems


def check_calibration(seqpar, dumps, data_files):
    """The calibration seqpar reports (src/dump/calibration.cpp) must be the largest
    fraction of its bound over the correct runs of the catalogues, per dtype and quantity
    (within 1 %: the constants have three digits)."""
    rows = []
    for path in data_files:
        with open(path) as f:
            rows += json.load(f)
    best = pc.largest_correct(rows)
    problems = []
    for dt in sorted({d for d, _ in best}):
        d = next((x for x in dumps if x.rstrip("/").endswith("-" + dt)), None)
        if d is None:
            problems.append("calibration %s: no committed dump of that dtype to read it" % dt)
            continue
        cal = judge(seqpar, d, "out")[4] or {}
        for q in STAGES:
            want = best.get((dt, q), (None,))[0]
            got = cal.get("quantities", {}).get(q, {}).get("largest_correct")
            if want is None or got is None or abs(got - want) > 0.01 * want:
                problems.append("calibration %s %s: seqpar says %s, the catalogues %s" % (
                    dt, q, got, want))
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqpar", required=True)
    ap.add_argument("--cases")
    ap.add_argument("--dump")
    ap.add_argument("--quantity", choices=sorted(STAGES))
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--calibration", nargs="+", metavar="CATALOGUE_JSON",
                    help="also check seqpar's calibration (read from the cases' dumps, one per "
                         "dtype) against the largest correct errors of these catalogues")
    a = ap.parse_args()
    seqpar = os.path.abspath(a.seqpar)
    if a.cases:
        base = os.path.dirname(os.path.abspath(a.cases))
        with open(a.cases) as f:
            cases = json.load(f)
    elif a.dump and a.quantity:
        base, cases = "", [{"dump": os.path.abspath(a.dump), "quantity": a.quantity,
                            "factor": a.factor}]
    else:
        ap.error("--cases, or --dump with --quantity")
    failures = 0
    with tempfile.TemporaryDirectory() as work:
        for c in cases:
            d = os.path.join(base, c["dump"])
            h, p, problems = run_case(seqpar, d, c["quantity"], c["factor"], work)
            print("%-4s %-44s healthy %.3g of the bound, ×%g → %.3g: %s" % (
                c["quantity"], os.path.basename(d.rstrip("/")), h, c["factor"], p,
                "; ".join(problems) if problems else "ok"), flush=True)
            failures += bool(problems)
    if a.calibration:
        problems = check_calibration(seqpar, [os.path.join(base, c["dump"]) for c in cases],
                                     a.calibration)
        for p in problems:
            print("FAIL:", p)
        print("calibration: %s" % ("%d problems" % len(problems) if problems else
                                   "seqpar's equals the catalogues' largest correct errors"))
        failures += bool(problems)
    print("%d cases, %d failed" % (len(cases), failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

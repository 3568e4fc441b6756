"""How many examples each planted mistake needs before the property finds it: the evidence for
the example budgets of the property tests (docs/development.md, "Test budgets").

For every planted mistake of the attention property (tests/python/broken_attention.py, with the
supports the tests draw it under) and of the whole-step property (the worked example's step bugs,
tests/python/test_step.py), the property runs without shrinking at several seeds — CI's own
(seed 0) and others — and the number of the first failing example is recorded (stats'
`first_failure`). A healthy run whose budget is well above the largest of them would find a
regression of the same kind; a bug test's budget needs only to exceed it.

    SEQPAR=build/tools/seqpar .venv/bin/python bench/budgets.py [--seeds 0 1 2 3 4]
        [--only attention|step] [--out bench/results/DATE/budgets.json]
"""
import argparse
import importlib.util
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests", "python")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, TESTS)


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(TESTS, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def no_shrink():
    from hypothesis import Phase
    return {"phases": [Phase.explicit, Phase.generate]}


def attention_cases():
    """(name, impl reference, supports, the test's budget) of every planted attention mistake."""
    tt = load("test_testing")
    broken = os.path.join(TESTS, "broken_attention.py")
    cases = []
    for v in sorted(tt.EXPECTED):
        cases.append((v, "%s:make(%r)" % (broken, v), tt.ZIGZAG, 300))
    for v, (supports, _) in sorted(tt.OPTION_CASES.items()):
        cases.append((v, "%s:make(%r)" % (broken, v), supports, 150))
    for (v, layout) in sorted(tt.DOCMASK_CASES):
        cases.append(("%s/%s" % (v, layout), "%s:make(%r)" % (broken, v),
                      {"layouts": (layout,)}, 150))
    return cases


def step_cases():
    ts = load("test_step")
    return [(bug, ts.step_ref(bug), ts.MODEL, 60) for bug in sorted(ts.MISTAKES)]


def first_failure(run, seed):
    stats = {}
    t0 = time.perf_counter()
    try:
        run(seed, stats)
    except Exception as e:  # the property's failure (or a crash: both end the run)
        if stats.get("first_failure") is None:
            return None, time.perf_counter() - t0, type(e).__name__
    return stats.get("first_failure"), time.perf_counter() - t0, None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2, 3, 4])
    ap.add_argument("--only", choices=("attention", "step"), default=None)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    import seqpar.testing as spt

    rows = []
    if a.only in (None, "attention"):
        for name, ref, supports, budget in attention_cases():
            def run(seed, stats, ref=ref, supports=supports, budget=budget):
                spt.check(ref, max_world=4, supports=supports, max_examples=budget, seed=seed,
                          stats=stats, settings=no_shrink())
            rows.append(("attention", name, budget, run))
    if a.only in (None, "step"):
        for name, step, model, budget in step_cases():
            def run(seed, stats, step=step, model=model, budget=budget):
                spt.check_step(step, model, seed=seed, max_examples=budget, stats=stats,
                               settings=no_shrink())
            rows.append(("step", name, budget, run))
    out = []
    print("%-9s %-46s %6s  %s" % ("property", "mistake", "budget", "first failing example per "
                                  "seed " + " ".join(map(str, a.seeds))))
    for prop, name, budget, run in rows:
        found, secs = [], 0.0
        for seed in a.seeds:
            n, s, err = first_failure(run, seed)
            found.append(n)
            secs += s
        worst = None if None in found else max(found)
        out.append({"property": prop, "mistake": name, "budget": budget, "seeds": a.seeds,
                    "first_failure": found, "worst": worst, "seconds": round(secs, 1)})
        print("%-9s %-46s %6d  %s%s" % (prop, name, budget,
                                        " ".join("-" if n is None else str(n) for n in found),
                                        "   NOT FOUND at some seed" if worst is None else ""),
              flush=True)
    for prop in sorted({r["property"] for r in out}):
        ws = [r["worst"] for r in out if r["property"] == prop]
        print("%s: the largest first failing example over every mistake and seed: %s" % (
            prop, "a mistake not found" if None in ws else max(ws)))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

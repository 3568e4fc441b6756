"""How many examples each planted mistake needs before the property finds it: the evidence for
the example budgets of the property tests (docs/development.md, "Test budgets").

For every planted mistake of the attention property (tests/python/broken_attention.py, with the
supports the tests draw it under) and of the whole-step property (the worked example's step bugs,
tests/python/test_step.py), the property runs without shrinking at several seeds — CI's own
(seed 0) and others — and the number of the first failing example is recorded (stats'
`first_failure`). A healthy run whose budget is well above the largest of them would find a
regression of the same kind; a bug test's budget needs only to exceed it.

For the frameworks' paths (tests/python/test_frameworks.py), whose healthy runs draw from
narrower spaces (Ulysses only; one causal sequence; forward only), the same planted attention
mistakes run in each of those spaces (HEALTHY_SPACES) up to --cap examples — a mistake that the
space cannot show (a ring's mistake where only Ulysses is drawn) is "not seen" at seed 0 and not
run at the other seeds — and each framework finding (FINDINGS: the frameworks' own code, the
property failing on it) at every seed.

    SEQPAR=build/tools/seqpar .venv/bin/python bench/budgets.py [--seeds 0 1 2 3 4]
        [--only attention|step|frameworks] [--space NAME] [--cap 200]
        [--out bench/results/DATE/budgets.json]

--space (with --only frameworks): the spaces, and the findings, whose names contain NAME's
first word (e.g. yunchang).
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


# The planted attention mistakes run in the frameworks' spaces: every one that needs no option
# (the frameworks' healthy runs draw none).
FRAMEWORK_MISTAKES = ("no_kv_repeat", "blockwise_repeat", "a2a_wrong_dims", "local_cu",
                      "zigzag_swapped", "no_scale", "lse_merge_no_max", "ring_src_off_by_one",
                      "kv_grad_not_summed", "no_causal", "positions_in_rank_order",
                      "positions_rebuilt_locally", "docmask_off_diagonal")


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
    ap.add_argument("--only", choices=("attention", "step", "frameworks"), default=None)
    ap.add_argument("--cap", type=int, default=200,
                    help="examples a planted mistake gets in a framework's space")
    ap.add_argument("--out", default="")
    ap.add_argument("--space", default="",
                    help="frameworks: only the spaces (and findings) whose name contains its first word")
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
    # A frameworks' row that is not seen at its first seed is not run at the others.
    once = set()
    if a.only == "frameworks":
        def wanted(name):  # --space: its first word, in a space's or a finding's name
            return not a.space or a.space.split()[0].lower() in name.lower()
        tf = load("test_frameworks")
        broken = os.path.join(TESTS, "broken_attention.py")
        example = os.path.join(ROOT, "python", "examples", "zigzag_ring_attention.py")
        for space, supports in tf.HEALTHY_SPACES.items():
            if not wanted(space):
                continue
            # The mistakes are planted in the worked example: a space where the example itself
            # fails (a contiguous layout: it implements zigzag) measures nothing about them.
            stats = {}
            try:
                spt.check(example + ":attention", max_world=4, supports=supports,
                          max_examples=a.cap, seed=0, stats=stats, settings=no_shrink())
            except Exception as e:
                print("in %s: the worked example itself fails at example %s (%s): its planted "
                      "mistakes are not measured there" % (space, stats.get("first_failure"),
                                                           type(e).__name__), flush=True)
                continue
            for v in FRAMEWORK_MISTAKES:
                def run(seed, stats, ref="%s:make(%r)" % (broken, v), supports=supports):
                    spt.check(ref, max_world=4, supports=supports, max_examples=a.cap,
                              seed=seed, stats=stats, settings=no_shrink())
                rows.append(("in " + space, v, tf.N, run))
                once.add(len(rows) - 1)
        for finding, (path, supports, world) in tf.FINDINGS.items():
            if not wanted(finding):
                continue
            def run(seed, stats, ref=tf.REF + ":" + path, supports=supports, world=world):
                spt.check(ref, max_world=world, supports=supports, max_examples=a.cap, seed=seed,
                          stats=stats, settings=no_shrink())
            rows.append(("finding", finding, tf.N, run))
    out = []
    print("%-9s %-46s %6s  %s" % ("property", "mistake", "budget", "first failing example per "
                                  "seed " + " ".join(map(str, a.seeds))))
    for k, (prop, name, budget, run) in enumerate(rows):
        found, secs = [], 0.0
        for seed in a.seeds:
            n, s, err = first_failure(run, seed)
            found.append(n)
            secs += s
            if n is None and k in once:
                break
        worst = None if None in found else max(found)
        unseen = k in once and found == [None]
        out.append({"property": prop, "mistake": name, "budget": budget, "seeds": a.seeds,
                    "first_failure": found, "worst": worst, "not_seen": unseen,
                    "seconds": round(secs, 1)})
        print("%-9s %-46s %6d  %s%s" % (prop, name, budget,
                                        " ".join("-" if n is None else str(n) for n in found),
                                        "" if worst is not None else
                                        "   not seen in %d examples" % a.cap if unseen else
                                        "   NOT FOUND at some seed"),
              flush=True)
    for prop in sorted({r["property"] for r in out}):
        rs = [r for r in out if r["property"] == prop]
        unseen = [r["mistake"] for r in rs if r["not_seen"]]
        ws = [r["worst"] for r in rs if not r["not_seen"]]
        print("%s: the largest first failing example over every mistake and seed: %s%s" % (
            prop, "a mistake not found" if None in ws else max(ws, default="-"),
            "; not seen in %d examples at seed %d (the space cannot show them): %s" % (
                a.cap, a.seeds[0], ", ".join(unseen)) if unseen else ""))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Mutation testing of the whole checker (issue 50): is every promise pinned by a test that fails
when the code behind it gets weaker?

The catalogue (bench/mutants/*.json) lists mutants, each a one-place weakening of one promise of
the checker — a bound or tolerance (check, validate, validate --dump in both modes, replay's
comparisons), a sampled-mode guarantee, an importer's mapping, a family member of the cause
search, a contract check of seqpar.testing, the MPI watchdog's chain:

    {"id": "...", "promise": "what the code promises", "file": "src/...", "find": "exact text
     (once in the file)", "replace": "...", "tests": ["meson test names that should kill it"]}

A mutant of code compiled at some vector ISAs only (an `#if defined(__AVX512F__)` branch) says
so with "isa": "AVX512F" (compiled where the compiler's -march=native defines __AVX512F__) or
"!AVX512F" (where it does not); elsewhere its text is still checked, but it is listed as "at
another ISA" and not run: the native build does not compile it, so no test could kill it there.

The tool copies the working tree to a scratch directory, builds it once, checks that every test
named passes on the unmutated tree, then applies the mutants one at a time: rebuild (a mutant
that does not build is "stillborn", not counted), run its tests, record which failed (killed) or
that none did (survived), restore. It prints the table (Markdown) and the kill rate; --out writes
every result as JSON.

    python3 bench/mutate.py [--only ID ...] [--scratch /tmp/seqpar-mutate] [--out results.json]

Not a CI test: each mutant costs an incremental rebuild and its tests (about 1-3 minutes on 2
cores; docs/development.md has the last run's time).
"""
import argparse
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mutagen  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_catalogue(paths):
    mutants = []
    for p in paths:
        with open(p) as f:
            for m in json.load(f):
                m["catalogue"] = os.path.relpath(p, ROOT)
                mutants.append(m)
    ids = [m["id"] for m in mutants]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        sys.exit(f"mutate: duplicate mutant ids: {sorted(dup)}")
    return mutants


def check_text(tree, m):
    """A mutant names one place: its text occurs exactly once in its file."""
    path = os.path.join(tree, m["file"])
    if not os.path.isfile(path):
        sys.exit(f"mutate: mutant {m['id']}: its file {m['file']} does not exist")
    with open(path) as f:
        text = f.read()
    n = text.count(m["find"])
    macro, _ = isa_macro(m)
    if macro and macro not in text:
        sys.exit(f"mutate: mutant {m['id']}: its isa {m['isa']!r} names {macro}, which "
                 f"{m['file']} never tests: give the macro of the #if around its place "
                 f"(\"AVX512F\" or \"!AVX512F\")")
    if n != 1:
        sys.exit(f"mutate: mutant {m['id']}: its text occurs {n} times in {m['file']} "
                 f"(want once): {m['find']!r}")


def isa_macro(m):
    """The macro a mutant's "isa" names and whether it is negated ("!AVX512F"); ("", False)
    for a mutant of code compiled at every ISA."""
    cond = m.get("isa", "")
    return ("__%s__" % cond.lstrip("!") if cond else ""), cond.startswith("!")


def native_macros():
    """The macros the C++ compiler predefines at -march=native (what the native build targets)."""
    cxx = os.environ.get("CXX", "c++").split()
    out = subprocess.run([*cxx, "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
                         capture_output=True, text=True, check=True).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}


def compiled_here(m, macros):
    """Whether the native build compiles the mutant's place (its "isa" condition, if any)."""
    macro, negated = isa_macro(m)
    return not macro or (macro in macros) != negated


def check_tests(build, mutants):
    """Every meson test a mutant names exists in BUILD: a name meson does not know would make
    `meson test` write no log, which is no kill; a pytest entry's file exists."""
    with open(os.path.join(build, "meson-info", "intro-tests.json")) as f:
        test_names = {t["name"] for t in json.load(f)}
    for m in mutants:
        unknown = [t for t in m["tests"] if not t.startswith("pytest:") and t not in test_names]
        unknown += [t for t in m["tests"] if t.startswith("pytest:") and not os.path.isfile(
            os.path.join(ROOT, t[len("pytest:"):].split("::", 1)[0]))]
        if unknown:
            sys.exit(f"mutate: mutant {m['id']} names tests that do not exist: {unknown} "
                     f"(meson test -C {build} --list shows the names)")


def copy_tree(scratch):
    tree = os.path.join(scratch, "tree")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    for rel in files:
        if not rel:
            continue
        rel = rel.decode()
        src, dst = os.path.join(ROOT, rel), os.path.join(tree, rel)
        if not os.path.isfile(src):
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.exists(dst) or open(src, "rb").read() != open(dst, "rb").read():
            shutil.copy2(src, dst)
    for kept in (".venv", ".deps"):  # the project venv and fetched headers, shared
        if os.path.exists(os.path.join(ROOT, kept)) and not os.path.exists(os.path.join(tree, kept)):
            os.symlink(os.path.join(ROOT, kept), os.path.join(tree, kept))
    return tree


def run_pytest(build, tree, spec, timeout):
    """"pytest:FILE::EXPR": the project venv's pytest on FILE, tests matching EXPR (-k)."""
    path, expr = spec[len("pytest:"):].split("::", 1)
    env = dict(os.environ, SEQPAR=os.path.join(build, "tools", "seqpar"))
    try:
        r = subprocess.run([os.path.join(tree, ".venv", "bin", "python"), "-m", "pytest", "-q",
                            "-p", "no:cacheprovider", path, "-k", expr], cwd=tree, env=env,
                           capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0


def run_tests(build, tests, timeout, tree=None, first_only=False):
    """Runs the named meson tests (and "pytest:FILE::EXPR" entries) in order; returns (names
    that failed, seconds). first_only: stop at the first that fails (a mutant's killer)."""
    t0 = time.monotonic()
    failed = []
    batch = [[t] for t in tests] if first_only else [tests]
    for group in batch:
        for t in group:
            if t.startswith("pytest:") and not run_pytest(build, tree, t, timeout):
                failed.append(t)
        meson_tests = [t for t in group if not t.startswith("pytest:")]
        if meson_tests:
            failed += run_meson_tests(build, meson_tests, timeout)
        if failed and first_only:
            break
    return failed, time.monotonic() - t0


def run_meson_tests(build, tests, timeout):
    # Its own log (--logbase): the suite's testlog.json in BUILD stays the suite's.
    log = os.path.join(build, "meson-logs", "mutate-testlog.json")
    if os.path.exists(log):
        os.unlink(log)
    try:
        subprocess.run(["meson", "test", "-C", build, "--no-rebuild", "-q",
                        "--logbase", "mutate-testlog", *tests],
                       capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return ["(timed out)"]
    failed = []
    if os.path.exists(log):
        with open(log) as f:
            for line in f:
                r = json.loads(line)
                if r.get("result") not in ("OK", "SKIP", "EXPECTEDFAIL"):
                    failed.append(r["name"].split(" / ")[-1])
    else:
        failed.append("(no test log)")
    return failed


def targets_for(build, tests):
    """The ninja outputs the named tests run (meson's introspection), so that a mutant
    rebuilds only what its tests need; the CLI for the Python package's tests."""
    info = os.path.join(build, "meson-info")
    with open(os.path.join(info, "intro-targets.json")) as f:
        files = {t["id"]: t["filename"] for t in json.load(f)}
    with open(os.path.join(info, "intro-tests.json")) as f:
        meson_tests = json.load(f)
    outs = {os.path.relpath(fn, build) for t in meson_tests if t["name"] in tests
            for d in t.get("depends", []) for fn in files.get(d, [])}
    # A test's own program, also where another runs it (mpiexec -n 4 PROGRAM: no depends).
    built = {fn for fns in files.values() for fn in fns}
    outs |= {os.path.relpath(a, build) for t in meson_tests if t["name"] in tests
             for a in t["cmd"] if os.path.normpath(a) in built}
    if any(t.startswith("pytest:") for t in tests):
        outs.add(os.path.join("tools", "seqpar"))
    return sorted(outs)


def apply_and_test(tree, build, m, timeout, first_only):
    """One mutant on the tree: mutate, rebuild, run its tests, restore the file's text.
    Returns (verdict, killers)."""
    path = os.path.join(tree, m["file"])
    with open(path) as f:
        original = f.read()
    restored = False

    def restore(*_):
        nonlocal restored
        if not restored:
            with open(path, "w") as f:
                f.write(original)
            restored = True

    old_term = signal.signal(signal.SIGTERM, lambda *a: (restore(), sys.exit(143)))
    backup = os.path.join(build, "mutate-restore.json")  # for a run killed outright (SIGKILL)
    with open(backup, "w") as f:
        json.dump({"path": path, "text": original}, f)
    try:
        with open(path, "w") as f:
            f.write(original.replace(m["find"], m["replace"], 1))
        b = subprocess.run(["ninja", "-C", build, *targets_for(build, m["tests"])],
                           capture_output=True, text=True)
        if b.returncode != 0:
            return "stillborn", []
        killers, _ = run_tests(build, m["tests"], timeout, tree, first_only)
        return ("killed" if killers else "survived"), killers
    finally:
        restore()
        os.unlink(backup)
        signal.signal(signal.SIGTERM, old_term)


def restore_leftover(build):
    """A run killed while a mutant was applied left its file's text beside the build: put it back."""
    backup = os.path.join(build, "mutate-restore.json")
    if os.path.exists(backup):
        with open(backup) as f:
            b = json.load(f)
        with open(b["path"], "w") as f:
            f.write(b["text"])
        os.unlink(backup)
        print(f"mutate: restored {b['path']} (a killed run had left a mutant in it)", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--catalogue", nargs="*",
                    default=sorted(p for p in glob.glob(os.path.join(ROOT, "bench", "mutants", "*.json"))
                                   if not p.endswith("places.json")))
    ap.add_argument("--generated", action="store_true",
                    help="the mutants made by rule from bench/mutants/places.json (bench/mutagen.py) "
                         "instead of the hand-written catalogue")
    ap.add_argument("--list", action="store_true", help="list the mutants and stop")
    ap.add_argument("--validate", metavar="BUILD", default="",
                    help="check that every mutant's text occurs once in this checkout and every "
                         "test it names exists in BUILD (a configured build directory), then stop "
                         "(the `mutant_catalogues` test: a catalogue gone stale fails CI, not the "
                         "next full run)")
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--sample", type=int, default=0, help="run N mutants drawn at random")
    ap.add_argument("--seed", type=int, default=None, help="the draw's seed (printed)")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds: start no further mutant once this much time has gone")
    ap.add_argument("--in-place", metavar="BUILD", default="",
                    help="mutate this checkout and rebuild BUILD (an existing build directory of "
                         "it) instead of a scratch copy; every file is restored, BUILD rebuilt at "
                         "the end; exit 1 if a mutant survives (the CI sample)")
    ap.add_argument("--scratch", default="/tmp/seqpar-mutate")
    ap.add_argument("--out", default="")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutant's tests")
    a = ap.parse_args()
    if a.generated:
        mutants, stale = mutagen.generate(ROOT, os.path.join(ROOT, "bench", "mutants", "places.json"))
        if stale:
            sys.exit(f"mutate: places.json calls mutants equivalent that are no longer generated: "
                     f"{stale}")
    else:
        mutants = load_catalogue(a.catalogue)
    if a.only:
        mutants = [m for m in mutants
                   if m["id"] in a.only or any(m["id"].startswith(o + ".") for o in a.only)]
    equivalent = [m for m in mutants if m.get("equivalent")]
    known = [m for m in mutants if m.get("known_survivor") and not m.get("equivalent")]
    # Known survivors are run when asked for by id or area (--only), not otherwise.
    mutants = [m for m in mutants if not m.get("equivalent")
               and (not m.get("known_survivor") or a.only)]
    every = mutants + equivalent + [k for k in known if k not in mutants]
    macros = native_macros() if any(m.get("isa") for m in every) else set()
    other_isa = [m for m in mutants if not compiled_here(m, macros)]
    mutants = [m for m in mutants if compiled_here(m, macros)]
    if a.validate:
        for m in every:
            check_text(ROOT, m)
        check_tests(a.validate, mutants + known + other_isa)
        print(f"mutate: {len(every)} mutants, each text found "
              f"once and each named test known")
        return
    if a.list:
        for m in every:
            tag = ("equivalent: " + m["equivalent"] if m.get("equivalent") else
                   "known survivor: " + m["known_survivor"] if m.get("known_survivor") else
                   "at another ISA: compiled where " + m["isa"]
                   if not compiled_here(m, macros) else "")
            print(f"{m['id']:60} {m['file']}:{m.get('line', '')} {tag}")
        print(f"{len(mutants)} mutants to run, {len(equivalent)} equivalent, "
              f"{len(known)} known survivors, {len(other_isa)} at another ISA")
        return
    if a.sample:
        seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 31)
        print(f"mutate: drawing {a.sample} of {len(mutants)} mutants with seed {seed} "
              f"(again: --seed {seed})", flush=True)
        mutants = random.Random(seed).sample(mutants, min(a.sample, len(mutants)))
    if a.in_place:
        tree, build = ROOT, os.path.abspath(a.in_place)
        restore_leftover(build)
    else:
        os.makedirs(a.scratch, exist_ok=True)
        tree = copy_tree(a.scratch)
        build = os.path.join(a.scratch, "build")
        restore_leftover(build)
    # Every mutant must name one place: checked before anything is built.
    for m in mutants:
        check_text(tree, m)
    if not a.in_place and not os.path.exists(os.path.join(build, "build.ninja")):
        subprocess.run(["meson", "setup", build, tree, "-Dgpu=disabled", "-Ddebug=false"],
                       check=True, capture_output=True)
    t_start = time.monotonic()
    print(f"mutate: building the unmutated tree in {build}", flush=True)
    subprocess.run(["ninja", "-C", build], check=True, capture_output=True)
    check_tests(build, mutants)
    if not a.in_place:  # the CI sample trusts the suite that just passed
        tests = sorted({t for m in mutants for t in m["tests"]})
        failed, secs = run_tests(build, tests, a.timeout * 2, tree)
        if failed:
            sys.exit(f"mutate: on the unmutated tree these tests fail already: {failed}")
        print(f"mutate: {len(tests)} tests pass on the unmutated tree ({secs:.0f} s)", flush=True)
    results = []
    try:
        for k, m in enumerate(mutants):
            if a.budget and results and time.monotonic() - t_start > a.budget:
                print(f"mutate: the budget of {a.budget:.0f} s is spent; {len(mutants) - k} "
                      "drawn mutants not run", flush=True)
                break
            t0 = time.monotonic()
            verdict, killers = apply_and_test(tree, build, m, a.timeout, first_only=True)
            r = {"id": m["id"], "promise": m["promise"], "file": m["file"], "verdict": verdict,
                 "killed_by": killers, "tests": m["tests"],
                 "seconds": round(time.monotonic() - t0)}
            results.append(r)
            print(f"[{k + 1}/{len(mutants)}] {verdict:9} {m['id']}  {', '.join(killers)}"
                  f"  ({r['seconds']} s)", flush=True)
            if verdict == "survived":
                print(f"    {m['file']}: {m['find'].strip()!r} -> {m['replace'].strip()!r}",
                      flush=True)
            if a.out:  # as it goes: a long run stopped halfway keeps what it found
                with open(a.out, "w") as f:
                    json.dump({"partial": True, "results": results}, f, indent=1)
    finally:  # back to the unmutated tree (in place: what the drawn mutants' tests use)
        again = targets_for(build, sorted({t for m in mutants for t in m["tests"]})) if a.in_place else []
        subprocess.run(["ninja", "-C", build, *again], capture_output=True)
    counted = [r for r in results if r["verdict"] != "stillborn"]
    killed = sum(1 for r in counted if r["verdict"] == "killed")
    total = time.monotonic() - t_start
    print(f"\n{killed} of {len(counted)} mutants killed ({100 * killed / max(len(counted), 1):.1f}%), "
          f"{len(results) - len(counted)} stillborn, {len(equivalent)} equivalent and "
          f"{len(known)} known survivors and {len(other_isa)} at another ISA (not run); "
          f"{total / 60:.1f} min on {os.cpu_count()} cores\n")
    if not a.sample:
        print("| mutant | promise | verdict | killed by |")
        print("|---|---|---|---|")
        for r in results:
            print(f"| `{r['id']}` | {r['promise']} | {r['verdict']} | {', '.join(r['killed_by'])} |")
        for m in equivalent:
            print(f"| `{m['id']}` | {m['promise']} | equivalent | {m['equivalent']} |")
        for m in known:
            if all(r["id"] != m["id"] for r in results):
                print(f"| `{m['id']}` | {m['promise']} | known survivor (not run) | "
                      f"{m['known_survivor']} |")
        for m in other_isa:
            print(f"| `{m['id']}` | {m['promise']} | at another ISA (not run) | compiled where "
                  f"{m['isa']} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"killed": killed, "counted": len(counted), "minutes": round(total / 60, 1),
                       "equivalent": [{"id": m["id"], "why": m["equivalent"]} for m in equivalent],
                       "known_survivors": [{"id": m["id"], "why": m["known_survivor"]}
                                           for m in known],
                       "other_isa": [{"id": m["id"], "isa": m["isa"]} for m in other_isa],
                       "results": results}, f, indent=1)
    sys.exit(1 if a.in_place and killed < len(counted) else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Mutation testing of the whole checker (issue 50): is every promise pinned by a test that fails
when the code behind it gets weaker?

The catalogue (bench/mutants/*.json) lists mutants, each a one-place weakening of one promise of
the checker — a bound or tolerance (check, validate, validate --dump in both modes, replay's
comparisons), a sampled-mode guarantee, an importer's mapping, a family member of the cause
search, a contract check of seqpar.testing, the MPI watchdog's chain:

    {"id": "...", "promise": "what the code promises", "file": "src/...", "find": "exact text
     (once in the file)", "replace": "...", "tests": ["meson test names that should kill it"]}

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
import shutil
import subprocess
import sys
import time

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


def run_tests(build, tests, timeout, tree=None):
    """Runs the named meson tests (and "pytest:FILE::EXPR" entries); returns (names that
    failed, seconds)."""
    t0 = time.monotonic()
    failed = [t for t in tests if t.startswith("pytest:") and not run_pytest(build, tree, t, timeout)]
    tests = [t for t in tests if not t.startswith("pytest:")]
    if not tests:
        return failed, time.monotonic() - t0
    log = os.path.join(build, "meson-logs", "testlog.json")
    if os.path.exists(log):
        os.unlink(log)
    try:
        subprocess.run(["meson", "test", "-C", build, "--no-rebuild", "-q", *tests],
                       capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return failed + ["(timed out)"], time.monotonic() - t0
    if os.path.exists(log):
        with open(log) as f:
            for line in f:
                r = json.loads(line)
                if r.get("result") not in ("OK", "SKIP", "EXPECTEDFAIL"):
                    failed.append(r["name"])
    else:
        failed.append("(no test log)")
    return failed, time.monotonic() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--catalogue", nargs="*",
                    default=sorted(glob.glob(os.path.join(ROOT, "bench", "mutants", "*.json"))))
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--scratch", default="/tmp/seqpar-mutate")
    ap.add_argument("--out", default="")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutant's tests")
    a = ap.parse_args()
    mutants = load_catalogue(a.catalogue)
    if a.only:
        mutants = [m for m in mutants if m["id"] in a.only or m["id"].split(".")[0] in a.only]
    os.makedirs(a.scratch, exist_ok=True)
    tree = copy_tree(a.scratch)
    build = os.path.join(a.scratch, "build")
    # Every mutant must name one place: checked before anything is built.
    for m in mutants:
        text = open(os.path.join(tree, m["file"])).read()
        n = text.count(m["find"])
        if n != 1:
            sys.exit(f"mutate: mutant {m['id']}: its text occurs {n} times in {m['file']} "
                     f"(want once): {m['find']!r}")
    if not os.path.exists(os.path.join(build, "build.ninja")):
        subprocess.run(["meson", "setup", build, tree, "-Dgpu=disabled"], check=True,
                       capture_output=True)
    t_start = time.monotonic()
    print(f"mutate: building the unmutated tree in {build}", flush=True)
    subprocess.run(["ninja", "-C", build], check=True, capture_output=True)
    tests = sorted({t for m in mutants for t in m["tests"]})
    failed, secs = run_tests(build, tests, a.timeout * 2, tree)
    if failed:
        sys.exit(f"mutate: on the unmutated tree these tests fail already: {failed}")
    print(f"mutate: {len(tests)} tests pass on the unmutated tree ({secs:.0f} s)", flush=True)
    results = []
    for k, m in enumerate(mutants):
        path = os.path.join(tree, m["file"])
        original = open(path).read()
        t0 = time.monotonic()
        try:
            with open(path, "w") as f:
                f.write(original.replace(m["find"], m["replace"], 1))
            b = subprocess.run(["ninja", "-C", build], capture_output=True, text=True)
            if b.returncode != 0:
                verdict, killers = "stillborn", []
            else:
                killers, _ = run_tests(build, m["tests"], a.timeout, tree)
                verdict = "killed" if killers else "survived"
        finally:
            with open(path, "w") as f:
                f.write(original)
        r = {"id": m["id"], "promise": m["promise"], "file": m["file"], "verdict": verdict,
             "killed_by": killers, "tests": m["tests"], "seconds": round(time.monotonic() - t0)}
        results.append(r)
        print(f"[{k + 1}/{len(mutants)}] {verdict:9} {m['id']}  {', '.join(killers)}", flush=True)
        if a.out:  # as it goes: a long run stopped halfway keeps what it found
            with open(a.out, "w") as f:
                json.dump({"partial": True, "results": results}, f, indent=1)
    subprocess.run(["ninja", "-C", build], capture_output=True)  # back to the unmutated tree
    counted = [r for r in results if r["verdict"] != "stillborn"]
    killed = sum(1 for r in counted if r["verdict"] == "killed")
    total = time.monotonic() - t_start
    print(f"\n{killed} of {len(counted)} mutants killed ({100 * killed / max(len(counted), 1):.1f}%), "
          f"{len(results) - len(counted)} stillborn; {total / 60:.0f} min on {os.cpu_count()} cores\n")
    print("| mutant | promise | verdict | killed by |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| `{r['id']}` | {r['promise']} | {r['verdict']} | {', '.join(r['killed_by'])} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"killed": killed, "counted": len(counted), "minutes": round(total / 60, 1),
                       "results": results}, f, indent=1)
    sys.exit(0)


if __name__ == "__main__":
    main()

"""Both mutation catalogues still name their places (bench/mutate.py --validate): every
hand-written mutant's text occurs once in its file and every test it names exists in the build;
the mutants made by rule still find theirs. And the check itself fails where it must: a mutant
whose text is gone, one whose text occurs more than once, one naming a test or a pytest file
that does not exist, one whose isa names a macro its file never tests (a typo would leave it
unrun at every ISA).

    mutant_catalogues-test.py SOURCE_ROOT BUILD_ROOT"""
import json
import os
import subprocess
import sys
import tempfile

src, build = sys.argv[1], sys.argv[2]
mutate = os.path.join(src, "bench", "mutate.py")
failures = []


def validate(*args):
    p = subprocess.run([sys.executable, mutate, "--validate", build, *args], capture_output=True,
                       text=True, cwd=src)
    return p.returncode, (p.stdout + p.stderr).strip()


def want(name, rc_ok, text, args):
    rc, out = validate(*args)
    if (rc == 0) != rc_ok or text not in out:
        failures.append("%s: exit %d, want %s and %r in: %s" % (name, rc, "0" if rc_ok else "≠ 0",
                                                                 text, out[-400:]))
    else:
        print("ok   %s: %s" % (name, out.splitlines()[-1][:150]))


want("the hand-written catalogues", True, "each text found once", [])
want("the catalogue made by rule", True, "each text found once", ["--generated"])

with open(os.path.join(src, "bench", "mutants", "rest.json")) as f:
    good = json.load(f)[0]
with tempfile.TemporaryDirectory() as tmp:
    def catalogue(name, **change):
        path = os.path.join(tmp, name + ".json")
        with open(path, "w") as f:
            json.dump([dict(good, id="stale." + name, **change)], f)
        return ["--catalogue", path]
    want("a text no longer in its file", False, "occurs 0 times",
         catalogue("gone", find=good["find"] + " /* not in the file */"))
    want("a text more than once in its file", False, "(want once)",
         catalogue("many", find="#include", file=good["file"]))
    want("a test the build does not have", False, "names tests that do not exist",
         catalogue("unknown_test", tests=["no_such_test"]))
    want("a pytest file that does not exist", False, "names tests that do not exist",
         catalogue("unknown_file", tests=["pytest:tests/python/no_such_file.py::x"]))
    want("an isa its file never tests", False, "never tests",
         catalogue("unknown_isa", isa="!AVX512"))

for f in failures:
    print("FAIL " + f)
sys.exit(1 if failures else 0)

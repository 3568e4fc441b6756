"""Runs one example end to end: lay it out (seqpar plan), run it on the rank pool, judge the dump
(seqpar validate --dump --json), and say what happened in words a user can act on."""
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from .impl_ref import reference_of, resolve
from .pool import RankPool
from .scenario import LayoutRefused, find_seqpar, layout, wheel_binary


class Outcome(object):
    """The verdict on one example. kind: pass | mismatch | raised | hang | bad_output |
    mutated_input | no_grad | invalid_dump | refused."""

    def __init__(self, kind, summary, details="", dump_dir=None, verdict=None):
        self.kind = kind
        self.summary = summary
        self.details = details
        self.dump_dir = dump_dir
        self.verdict = verdict

    @property
    def ok(self):
        return self.kind == "pass"


def _ranks(rs):
    rs = sorted(rs)
    return ("rank %d" % rs[0]) if len(rs) == 1 else "ranks %s" % ", ".join(str(r) for r in rs)


def _num(x):
    """A number of the report (JSON writes inf and nan as strings)."""
    return "%.3g" % x if isinstance(x, (int, float)) else str(x)


def _indent(text, pre="    "):
    return "\n".join(pre + line for line in text.splitlines())


def pythonpath_env():
    """["PYTHONPATH=…"] when this seqpar package is not installed (a checkout's python/), so that
    a printed re-run command imports the same package; [] otherwise."""
    import seqpar
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(seqpar.__file__)))
    if "site-packages" in pkg_parent or "dist-packages" in pkg_parent:
        return []
    return ["PYTHONPATH=%s" % shlex.quote(pkg_parent)]


def tick(runner, unit):
    """A progress line on stderr every `runner.progress` seconds (None: silent)."""
    if runner.progress is None:
        return
    now = time.monotonic()
    if now - runner._last_progress >= runner.progress:
        runner._last_progress = now
        el = now - runner.t_start
        sys.stderr.write("seqpar.testing %s: %d %s in %.0f s (%.1f/s), %d failing\n" % (
            runner.name, runner.count, unit, el, runner.count / max(el, 1e-9),
            runner.failures))
        sys.stderr.flush()


RANK_FAILURES = ("raised", "bad_output", "mutated_input", "no_grad", "died", "harness_error")


def judge_ranks(results, stacks, deadline, phase=lambda x: x["phase"]):
    """(kind, summary, details) of ranks that raised, returned something wrong, died or did
    not return (a hang: who was busy, who waited); None when every rank replied "ok"."""
    world = len(results)
    bad = {r: x for r, x in enumerate(results) if x is not None and x["status"] != "ok"}
    missing = [r for r, x in enumerate(results) if x is None]
    waits = "".join("\n  rank %d did not return: %s" % (r, stacks.get(r, ("", "?"))[1])
                    for r in missing)
    for kind in RANK_FAILURES:
        rs = sorted(r for r, x in bad.items() if x["status"] == kind)
        if not rs:
            continue
        x = bad[rs[0]]
        if kind == "raised":
            summary = "%s raised %s in %s" % (_ranks(rs), x["exception"], phase(x))
            details = "rank %d's traceback:\n%s" % (rs[0], _indent(x["error"]))
        elif kind == "harness_error":
            summary = "seqpar.testing itself failed on %s (please report)" % _ranks(rs)
            details = x["error"]
        else:
            summary = "%s: %s" % (_ranks(rs), x["message"])
            details = ""
        if missing:
            details += ("\n" if details else "") + \
                "the other ranks then did not return (waiting for it):" + waits
        return kind, summary, details.strip()
    if missing:
        busy = [r for r in missing if stacks.get(r, ("unknown",))[0] == "busy"]
        culprits = busy or missing
        summary = "%s did not return within %.0f s (hang)%s" % (
            _ranks(culprits), deadline,
            "" if len(culprits) == world else "; the others waited for %s" % (
                "it" if len(culprits) == 1 else "them"))
        return "hang", summary, ("where each rank was:" + waits).strip()
    return None


class Runner(object):
    """Runs examples of one implementation; one pool per world size, kept across examples."""

    def __init__(self, impl, seqpar=None, deadline=30.0, start_method="fork", impl_ref=None,
                 keep_root=None, name=None):
        self.seqpar = find_seqpar(seqpar)
        self.impl = impl
        self.impl_ref = impl_ref if impl_ref is not None else (
            impl if isinstance(impl, str) else reference_of(impl))
        self._name = impl if isinstance(impl, str) else getattr(impl, "__name__", "attention")
        self.resolved = impl  # the callable itself
        if isinstance(impl, str):
            resolved = resolve(impl)  # a reference that names nothing fails here, not in a rank
            self.resolved = resolved
            if start_method == "fork":
                impl = resolved
        if start_method != "fork" and not isinstance(impl, str):
            if self.impl_ref is None:
                raise ValueError("start_method=%r sends the implementation to fresh processes "
                                 "by reference: give impl_ref='file.py:NAME' or pass a "
                                 "module-level function" % start_method)
            impl = self.impl_ref
        self.pool_impl = impl
        self.deadline = float(deadline)
        self.start_method = start_method
        self.name = name or self._name
        self.pools = {}
        self.root = keep_root or tempfile.mkdtemp(prefix="seqpar-testing-")
        os.makedirs(self.root, exist_ok=True)
        self.kept = None       # the dump directory of the latest failing example
        self.keep_passing = False  # keep a consistent example's dump too (run_one with keep)
        self.count = 0
        self.failures = 0
        self.first_failure = None  # the example count at the first failure (1-based)
        self.seconds = {"layout": 0.0, "ranks": 0.0, "validate": 0.0}
        self.t_start = time.monotonic()
        self._last_progress = time.monotonic()
        self.progress = None

    # -- one example
    def elapsed(self):
        return time.monotonic() - self.t_start

    def run(self, scn, supports=None):
        t0 = time.perf_counter()
        try:
            lay = layout(scn, self.seqpar)
        except LayoutRefused as e:
            return Outcome("refused", "seqpar refuses this layout: %s" % e)
        if supports is not None:
            why = supports.admits(scn, lay.padded_length)
            if why is not None:
                return Outcome("refused", "not supported: %s" % why)
        self.count += 1
        t1 = time.perf_counter()
        self.seconds["layout"] += t1 - t0
        d = os.path.join(self.root, "example-%06d" % self.count)
        os.makedirs(d)
        pool = self.pools.get(scn.world)
        if pool is None:
            pool = self.pools[scn.world] = RankPool(scn.world, self.pool_impl, self.start_method)
        task = {"scenario": scn.to_json(), "dir": d, "job": "seqpar.testing %s: %s" % (
            self.name, scn.describe()),
            "backward": supports is None or supports.backward,
            "layout": {"padded_length": lay.padded_length,
                       "original_length": lay.original_length,
                       "cu_seqlens": list(lay.cu_seqlens),
                       "rank_tokens": [list(t) for t in lay.rank_tokens]}}
        results, stacks = pool.run(task, self.deadline)
        t2 = time.perf_counter()
        self.seconds["ranks"] += t2 - t1
        out = self._judge_ranks(results, stacks)
        if out is None:
            out = self._validate(d)
            self.seconds["validate"] += time.perf_counter() - t2
        out.dump_dir = d
        if out.ok:
            if self.keep_passing:
                self.kept = d
            else:
                shutil.rmtree(d, ignore_errors=True)
        else:
            self.failures += 1
            if self.first_failure is None:
                self.first_failure = self.count
            if self.kept and self.kept != d:
                shutil.rmtree(self.kept, ignore_errors=True)
            self.kept = d
        self._tick()
        return out

    def _tick(self):
        tick(self, "examples")

    def _judge_ranks(self, results, stacks):
        found = judge_ranks(results, stacks, self.deadline)
        return None if found is None else Outcome(*found)

    def _validate(self, d):
        p = subprocess.run([self.seqpar, "validate", "--dump", d, "--json", "-q"],
                           capture_output=True, text=True)
        if p.returncode == 2:
            return Outcome("invalid_dump", "seqpar validate refused the dump: %s" %
                           p.stderr.strip().replace("seqpar: error: ", ""))
        try:
            rep = json.loads(p.stdout)
        except ValueError:
            return Outcome("invalid_dump", "seqpar validate exited %d without a report: %s" %
                           (p.returncode, p.stderr.strip()))
        if p.returncode == 0 and rep.get("pass"):
            return Outcome("pass", "consistent", verdict=rep)
        first = rep.get("first_difference") or {}
        stage = first.get("stage", "?")
        summary = "%s differs on %s%s" % (stage, _ranks(first.get("ranks", [])),
                                          " (%s)" % first["where"] if first.get("where") else "")
        details = first.get("diagnosis", "")
        worst = [r for r in rep.get("rows", []) if not r.get("pass")]
        if worst:
            lines = ["failing rows (stage, rank: max abs / tolerance):"]
            for r in worst[:8]:
                lines.append("  %-18s rank %d: %s / %s%s" % (
                    r["stage"], r["rank"], _num(r.get("max_abs")), _num(r.get("tolerance")),
                    ("  " + r["note"]) if r.get("note") else ""))
            if len(worst) > 8:
                lines.append("  … %d more" % (len(worst) - 8))
            details = (details + "\n" if details else "") + "\n".join(lines)
        return Outcome("mismatch", summary, details, verdict=rep)

    # -- the report of a failing example
    def rerun_command(self, scn):
        if self.impl_ref is None:
            return None
        env = pythonpath_env()
        # The re-run finds the same binary by itself when it is this package's own or the first
        # on PATH; otherwise it is named (--seqpar comes before the wheel's binary and $SEQPAR).
        found = wheel_binary() or shutil.which("seqpar")
        binary = [] if found and os.path.realpath(found) == os.path.realpath(self.seqpar) else [
            "--seqpar", shlex.quote(self.seqpar)]
        return " ".join(env + [shlex.quote(sys.executable), "-m", "seqpar.testing", "run",
                               shlex.quote(self.impl_ref)] + binary +
                        ["--scenario", shlex.quote(scn.to_json())])

    def report(self, scn, out):
        lines = ["%s: %s" % (self.name, out.summary),
                 "  scenario: %s" % scn.describe()]
        if out.details:
            lines.append(_indent(out.details, "  "))
        if out.dump_dir and os.path.isdir(out.dump_dir) and os.listdir(out.dump_dir):
            lines.append("  dump:     %s (kept; `%s validate --dump %s --html report.html`)" % (
                out.dump_dir, self.seqpar, out.dump_dir))
        cmd = self.rerun_command(scn)
        lines.append("  re-run:   %s" % (cmd or "(give impl_ref='file.py:NAME' to get a command "
                                               "that re-runs this case)"))
        return "\n".join(lines)

    def close(self):
        for p in self.pools.values():
            p.close()
        self.pools = {}
        if self.kept is None:
            shutil.rmtree(self.root, ignore_errors=True)
        else:  # keep only the failing example's dump
            for name in os.listdir(self.root):
                p = os.path.join(self.root, name)
                if p != self.kept:
                    shutil.rmtree(p, ignore_errors=True)

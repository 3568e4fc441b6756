"""Slow links, end to end: `seqpar check --backend mpi` over 4 test hosts × 2 ranks (the
hosts-test scenario) with one host's link limited to each RATE in turn (tc tbf, the hosts in
turn), as root (tests/support/testhosts.py). A link that keeps moving data must not fail the
check: each run's exit, PASS, errors, the longest wait the slow-network notes report, and the
longest stall of the slow link itself (its veth's byte counters sampled every 20 ms: the longest
time neither direction moved a byte while the job ran — TCP's retransmission backoff).

  python3 bench/slow_links.py BUILD RATE... [--deadline S] [--json OUT] [--keep DIR]
  e.g. 1mbit 2mbit; --keep: each run's stdout and stderr in DIR
"""
import argparse, json, os, sys, subprocess, threading, time, re
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "tests", "support"))
from testhosts import TestHosts  # noqa: E402
import netfaults  # noqa: E402
ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("build")
ap.add_argument("rates", nargs="+")
ap.add_argument("--deadline", default="2")
ap.add_argument("--json", default="")
ap.add_argument("--keep", default="")
a = ap.parse_args()
seqpar = os.path.join(os.path.abspath(a.build), "tools", "seqpar")
rates = a.rates
rows = []


def link_stalls(link, stop, out):
    """The longest time (s) link's rx and tx byte counts both stood still, sampled every 20 ms."""
    def count():
        total = 0
        for d in ("rx", "tx"):
            with open(f"/sys/class/net/{link}/statistics/{d}_bytes") as f:
                total += int(f.read())
        return total
    last, since, longest = count(), time.monotonic(), 0.0
    while not stop.wait(0.02):
        now, c = time.monotonic(), count()
        if c != last:
            longest = max(longest, now - since)
            last, since = c, now
    out.append(round(longest, 2))


if a.keep:
    os.makedirs(a.keep, exist_ok=True)
with TestHosts(4) as hosts:
    for i, rate in enumerate(rates):
        victim = i % 4
        hosts.slow(victim, rate)
        t0 = time.monotonic()
        stop, stalls = threading.Event(), []
        sampler = threading.Thread(target=link_stalls, args=(hosts.links[victim], stop, stalls))
        sampler.start()
        try:
            r = subprocess.run(hosts.mpiexec(8, [seqpar, "check", "--backend", "mpi", "--timeout", a.deadline,
                                                 *netfaults.scenario(8)]),
                               capture_output=True, text=True, timeout=1500)
            rc, out, err = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = "timeout", e.stdout or "", e.stderr or ""
            out = out.decode() if isinstance(out, bytes) else out
            err = err.decode() if isinstance(err, bytes) else err
        stop.set()
        sampler.join()
        hosts.slow(victim, None)
        if a.keep:
            for name, text in (("out", out), ("err", err)):
                with open(os.path.join(a.keep, f"run{i}-{rate}.{name}"), "w") as f:
                    f.write(text)
        notes = [l for l in err.splitlines() if "the network was slow" in l]
        errors = [l for l in err.splitlines() if "seqpar: error" in l]
        longest = max((float(m.group(1)) for l in notes for m in [re.search(r"\(([0-9.]+) s, ([0-9.]+)×", l)] if m), default=0)
        ratio = max((float(m.group(2)) for l in notes for m in [re.search(r"\(([0-9.]+) s, ([0-9.]+)×", l)] if m), default=0)
        row = dict(rate=rate, deadline_s=float(a.deadline), host=hosts.names[victim], exit=rc, seconds=round(time.monotonic() - t0, 1),
                   passed="PASS:" in out, errors=len(errors), first_error=(errors or [""])[0][:300],
                   slow_notes=len(notes), longest_wait_s=longest, longest_link_stall_s=stalls[0], longest_x_deadline=ratio,
                   note=(notes or [""])[0][:400])
        print(json.dumps(row), flush=True)
        rows.append(row)
if a.json:
    with open(a.json, "w") as f:
        json.dump(rows, f, indent=1)

"""Network faults at chosen moments of a distributed `seqpar check` over test hosts
(testhosts.py): one run, measured — used by tests/mpi/hosts-test.py (a few runs on every CI run)
and bench/hosts_soak.py (the soak and its table).

A run launches tests' failing_rank_check (the real `check --backend mpi`, over a communicator
that creates a mark file at the chosen call) with one rank per host in turn; when the victim
host's first rank reaches the moment, the harness breaks the network there, then lets it go on:

  cut       the host's link goes down (ip link set … down)
  kill      every process of the host is SIGKILLed (its ranks and its launcher proxy): the host
            died
  kill-ranks  the host's rank processes are SIGKILLed, its launcher proxy lives (the OOM
            killer); run with Hydra's -disable-auto-cleanup, so that the survivors go on
  stop      the host's rank processes are SIGSTOPped (a hung node): the others must name them,
            and the whole job — the stopped processes too — must end by itself
  slow      the link delays every packet (tc netem delay), from the start: not a fault
  lossy     the link drops packets (tc netem loss), from the start: not a fault

Moments: before / inside / after an all-to-all (the first Ulysses all-to-all, L0.attn.q.fwd),
inside a ring step (L0.attn.ring.fwd.step0), in the reference (the victim has sent its results
to rank 0, which computes the non-SP reference while the others wait for its verdict), after
the verdict (every rank has it; the job's last barrier is ahead). "Inside" is made certain by slowing the victim's
link to 8 kbit/s at the mark (tc tbf) and cutting it 100 ms after the victim went into the call,
while its messages crawl.

What is measured: whether the first error message names the victim host and its ranks (and says
the network for a cut), the time from the fault until the last surviving rank process ended,
whether every surviving rank left its flight record, and whether `seqpar replay` of the records
names the same ranks.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

from testhosts import TestHosts

MOMENTS = {
    "before-a2a": ("L0.attn.q.fwd", "before"),
    "inside-a2a": ("L0.attn.q.fwd", "inside"),
    "after-a2a": ("L0.attn.q.fwd", "after"),
    "inside-ring": ("L0.attn.ring.fwd.step0", "inside"),
    # The victim has sent rank 0 its results: rank 0 computes the non-SP reference while the
    # others wait for its verdict.
    "in-reference": ("check.gather", "after"),
    # Every rank knows the verdict (rank 0 prints it next); the job's last barrier is still ahead.
    "after-verdict": ("check.verdict", "after"),
}
FAULTS = ("cut", "kill", "kill-ranks", "stop")
# Not faults: the check must pass. slow: tc tbf (every kernel with traffic control); lossy: tc
# netem, where the kernel has sch_netem.
NOT_FAULTS = {"slow": ("slow", "20mbit"), "lossy": ("netem", "loss 2%")}
# Hybrid Ulysses 2 × ring (ranks / 2), GQA, several documents: every group crosses hosts.
def scenario(np: int) -> list[str]:
    ring = np // 2
    unit = 2 * ring * 8
    return ["--ulysses", "2", "--ring", str(ring), "--heads", "4", "--kv-heads", "2",
            "--docs", f"{4 * unit},{2 * unit},{unit}", "--layers", "2"]


def _first_error(text: str, also: tuple[str, ...] = ()) -> str:
    """The first line of a job's stderr that reports its failure (ours, or the launcher's)."""
    marks = ("seqpar: error:", "BAD TERMINATION", *also)
    return next((l for l in text.splitlines() if any(m in l for m in marks)), "")


def _wait_for(pred, limit: float, step: float = 0.01) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def run_one(hosts: TestHosts, np: int, failing: str, seqpar: str, fault: str, moment: str,
            victim: int, workdir: str, deadline_s: float = 2.0,
            auto_cleanup: bool = True, launch: bool = False) -> dict:
    """One run; returns its measurements (see the module's text)."""
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    records = os.path.join(workdir, "records")
    mark = os.path.join(workdir, "mark")
    victims = hosts.ranks_on(victim, np)
    host = hosts.names[victim]
    row = {"fault": fault, "moment": moment, "host": host, "ranks": victims}
    argv = [failing, "--timeout", str(deadline_s), "--flight-record", records, *scenario(np)]
    if fault in NOT_FAULTS:
        how, spec = NOT_FAULTS[fault]
        if how == "netem":
            why = hosts.netem_available()
            if why:
                row.update(skipped=why)
                return row
            hosts.netem(victim, spec)
        else:
            hosts.slow(victim, spec)
        row["moment"] = "whole run"
        argv[1:1] = ["--mark-at", f"{victims[0]}:never", "--mark-file", mark]
    else:
        tag, when = MOMENTS[moment]
        argv[1:1] = ["--mark-at", f"{victims[0]}:{tag}", "--mark-file", mark,
                     "--mark-when", "before" if when == "inside" else when]
    out = open(os.path.join(workdir, "out.txt"), "w")
    err_path = os.path.join(workdir, "err.txt")
    err = open(err_path, "w")
    t0 = time.monotonic()
    if fault == "kill-ranks":
        auto_cleanup = False
    command = hosts.mpiexec(np, argv, auto_cleanup)
    if launch:  # seqpar's documented way: the ranks out of the launcher's group kill
        command = [seqpar, "launch", "--", *command]
        row["launch"] = True
    job = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                           cwd=workdir)
    try:
        if fault in NOT_FAULTS:
            rc = job.wait(timeout=300)
            err.flush()
            text = open(err_path, errors="replace").read()
            first = _first_error(text, ("assert",))
            slow_note = next((l for l in text.splitlines() if "the network was slow" in l), "")
            out.flush()
            report = open(os.path.join(workdir, "out.txt"), errors="replace").read()
            name = os.path.basename(failing)
            row.update(exit=rc, seconds=round(time.monotonic() - t0, 2),
                       named_right=rc == 0, records_left=not os.path.exists(records),
                       replay_right=True, first=first[:400], slow_note=slow_note[:400],
                       passed="PASS" in report,
                       left_running=sum(len(hosts.procs(h, name)) for h in range(hosts.n)))
            return row
        if not _wait_for(lambda: os.path.exists(mark) or job.poll() is not None, 60):
            raise RuntimeError("the victim never reached its moment")
        if job.poll() is not None:
            raise RuntimeError(f"the job ended before the moment (exit {job.returncode})")
        if MOMENTS[moment][1] == "inside":
            hosts.slow(victim, "8kbit")
            os.unlink(mark)
            time.sleep(0.1)
        t_fault = time.monotonic()
        if fault == "cut":
            hosts.cut(victim)
        elif fault == "kill":
            hosts.kill(victim)
        elif fault == "stop":
            for p in hosts.procs(victim, os.path.basename(failing)):
                try:
                    os.kill(p, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
        else:
            for p in hosts.procs(victim, os.path.basename(failing)):
                try:
                    os.kill(p, 9)
                except ProcessLookupError:
                    pass
        if fault != "cut":
            # The slow link only held the call in flight; the host itself still answers.
            hosts.slow(victim, None)
        if os.path.exists(mark):
            os.unlink(mark)
        survivors = [h for h in range(hosts.n) if not (fault not in ("cut", "stop") and h == victim)]
        name = os.path.basename(failing)
        # A stopped host's processes must end too, and with them mpiexec: the job is over only
        # when nothing of it is left.
        gone = (lambda: job.poll() is not None and not any(hosts.procs(h, name) for h in survivors)) \
            if fault == "stop" else (lambda: not any(hosts.procs(h, name) for h in survivors))
        _wait_for(gone, 60, 0.05)
        t_end = time.monotonic() - t_fault
        left = sum(len(hosts.procs(h, name)) for h in survivors)
        if fault == "stop":
            row["mpiexec_ended"] = job.poll() is not None
            for p in hosts.procs(victim, name):  # what the job left behind, cleaned up
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    finally:
        hosts.mend(victim)
        hosts.slow(victim, None)
        try:
            job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
        out.close()
        err.close()
    text = open(err_path, errors="replace").read()
    first = _first_error(text)
    ranks_text = ", ".join(map(str, victims))
    # A cut is named in the first error message. A killed host's processes make MPICH's
    # mpiexec end the job at once (its own message is an assert): the survivors' words no longer
    # reach the console, so the records' reason is the first message the user can read.
    named_cut = lambda text: "the network" in text and host in text and f"ranks {ranks_text}" in text
    named_kill = lambda text: "the process" in text and host in text and \
        any(f"{r} on host" in text or f"{r}, " in text for r in victims)
    surviving_ranks = [r for r in range(np) if not (fault != "cut" and r in victims)]
    have = sorted(int(m.group(1)) for f in (os.listdir(records) if os.path.isdir(records) else [])
                  if (m := re.fullmatch(r"rank-(\d+)\.jsonl", f)))
    replay_ranks: list[int] = []
    run_ended = ""
    if have:
        rp = subprocess.run([seqpar, "replay", "--json", records], capture_output=True, text=True)
        try:
            rep = json.loads(rp.stdout)
            cat = "NETWORK_UNREACHABLE" if fault == "cut" else "MISSING_RANK"
            # A rank named only as blocked behind another finding, or as cut short by another
            # rank's abort, is a consequence, not a cause.
            replay_ranks = sorted({p["rank"] for p in rep.get("problems", [])
                                   if p.get("category") == cat
                                   and "is itself blocked in" not in p.get("cause", "")
                                   and "a consequence of rank" not in p.get("cause", "")}
                                  | set(rep.get("missing_ranks", [])))
            run_ended = rep.get("run_ended", "")
        except (json.JSONDecodeError, TypeError):
            replay_ranks = []
    named_stop = lambda text: "stopped or hung" in text and \
        any(f"rank {r} " in text or f"rank {r}," in text or f"ranks {r}" in text for r in victims)
    if fault == "cut":
        named = named_cut(first)
    elif fault == "stop":
        named = named_stop(first)
    elif launch:  # the console's first error line (seqpar launch prints the records' reason)
        named = named_kill(first)
    else:
        first = first or run_ended.split("\n")[0]
        named = named_kill(run_ended)
    row.update(exit=job.returncode, seconds=round(t_end, 2), left_running=left,
               named_right=named, first=first[:400],
               records_left=all(r in have for r in surviving_ranks), records=have,
               replay_ranks=replay_ranks, replay_right=replay_ranks == victims)
    return row

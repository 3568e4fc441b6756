#!/usr/bin/env python3
"""The stop soak (issue 33): how often does the first watchdog message of a real
`seqpar check --backend mpi` job name the rank that was stopped, and how long until the verdict?

Each run starts the job, waits until the SP step has begun, sleeps a random moment, SIGSTOPs a
random rank from outside (as a debugger, a frozen node or a cgroup freeze would), and waits for
the job to end by itself. A run *names the victim* when the first watchdog message in the job's
output says "the wait ends at rank V (silent" for the stopped rank V. Recorded per run: the
layout, victim, delay, exit code, time from the stop to the end of the job, the first watchdog
message, which ranks left flight records, and whether the job ended by itself (a run that has
not ended 60 s after the stop is killed and counts as a hang).

Run by hand (not in CI; 200 runs take about 30 minutes on 2 cores):
    tests/soak/stop_soak.py --seqpar build/tools/seqpar --runs 200 --out bench/results/soak
Layouts alternate between U 2 × R 2 on 4 ranks and U 4 × R 2 on 8 ranks (oversubscribed on a
small machine). Writes soak.jsonl (one line per run, appended as it goes) and summary.json,
and prints the summary table.
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

LAYOUTS = {
    "u2r2": (4, ["--ulysses", "2", "--ring", "2"]),
    "u4r2": (8, ["--ulysses", "4", "--ring", "2"]),
}
BLAME = re.compile(r"the wait ends at rank (\d+) \(silent")


def one_run(args, layout, victim, delay, work):
    n, flags = LAYOUTS[layout]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    out_path = os.path.join(work, "out.txt")
    flight = os.path.join(work, "flight")
    cmd = [args.mpiexec, "-n", str(n), "sh", "-c",
           'echo $$ > "pid.$PMI_RANK"; exec "$0" "$@"', args.seqpar, "check", "--backend", "mpi",
           "--timeout", str(args.timeout), "--flight-record", flight, "--layers", "2",
           "--docs", args.docs] + flags
    with open(out_path, "w") as out:
        job = subprocess.Popen(cmd, cwd=work, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
        pid_file = os.path.join(work, f"pid.{victim}")
        started = time.monotonic()
        while time.monotonic() - started < 60:
            if job.poll() is not None:
                break
            with open(out_path) as f:
                if "SP step" in f.read() and os.path.exists(pid_file):
                    break
            time.sleep(0.05)
        rec = {"layout": layout, "ranks": n, "victim": victim, "delay_s": round(delay, 3)}
        if job.poll() is not None or not os.path.exists(pid_file):
            job.wait()
            rec.update(outcome="not stopped (the job ended or never started its SP step)",
                       exit=job.returncode)
            return rec
        time.sleep(delay)
        pid = int(open(pid_file).read())
        stopped_at = time.monotonic()
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            job.wait()
            rec.update(outcome="not stopped (the victim had exited)", exit=job.returncode)
            return rec
        hang = False
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            hang = True
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        ended = time.monotonic()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = open(out_path, errors="replace").read()
    first = next((line for line in text.splitlines() if "watchdog: " in line), "")
    m = BLAME.search(first)
    records = sorted(int(f[5:-6]) for f in os.listdir(flight)
                     if f.startswith("rank-") and f.endswith(".jsonl")) if os.path.isdir(flight) else []
    rec.update(
        outcome="hang" if hang else "ended",
        exit=job.returncode,
        verdict_s=round(ended - stopped_at, 3),
        blamed=int(m.group(1)) if m else None,
        names_victim=bool(m) and int(m.group(1)) == victim,
        first_message=first[:600],
        records=records,
        passed_before_stop="PASS" in text.split("watchdog")[0] and job.returncode == 0,
    )
    return rec


def summarise(runs):
    out = {}
    for layout in sorted({r["layout"] for r in runs}) + ["all"]:
        rs = [r for r in runs if layout in ("all", r["layout"]) and r.get("outcome") in ("ended", "hang")]
        if not rs:
            continue
        times = [r["verdict_s"] for r in rs if r["outcome"] == "ended"]
        out[layout] = {
            "runs_stopped": len(rs),
            "named_the_stopped_rank": sum(r["names_victim"] for r in rs),
            "ended_by_itself": sum(r["outcome"] == "ended" for r in rs),
            "exit_2": sum(r["exit"] == 2 for r in rs),
            "verdict_s_median": round(statistics.median(times), 2) if times else None,
            "verdict_s_max": round(max(times), 2) if times else None,
            "records_from_every_other_rank": sum(
                r["records"] == [k for k in range(r["ranks"]) if k != r["victim"]] for r in rs),
            "not_stopped": sum(1 for r in runs if layout in ("all", r["layout"])
                               and r.get("outcome", "").startswith("not stopped")),
        }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqpar", default="build/tools/seqpar")
    ap.add_argument("--mpiexec", default="mpiexec")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=4.0, help="the watchdog's --timeout")
    ap.add_argument("--docs", default="8192,4096,4096")
    ap.add_argument("--max-delay", type=float, default=2.0,
                    help="the stop lands uniformly in [0, this] s after the SP step begins")
    ap.add_argument("--layouts", default="u2r2,u4r2")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench/results/soak")
    args = ap.parse_args()
    args.seqpar = os.path.abspath(args.seqpar)
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)
    layouts = args.layouts.split(",")
    log = open(os.path.join(args.out, "soak.jsonl"), "w")
    runs = []
    work = tempfile.mkdtemp(prefix="seqpar-soak-")
    try:
        for i in range(args.runs):
            layout = layouts[i % len(layouts)]
            victim = rng.randrange(LAYOUTS[layout][0])
            delay = rng.uniform(0, args.max_delay)
            rec = one_run(args, layout, victim, delay, work)
            rec["run"] = i
            runs.append(rec)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(f"[{i + 1}/{args.runs}] {layout} victim {victim} after {delay:.2f} s: "
                  f"{rec.get('outcome')} exit {rec.get('exit')} in {rec.get('verdict_s')} s, "
                  f"blamed {rec.get('blamed')}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {"args": {k: v for k, v in vars(args).items() if k != "out"},
               "summary": summarise(runs)}
    json.dump(summary, open(os.path.join(args.out, "summary.json"), "w"), indent=1)
    print(json.dumps(summary["summary"], indent=1))
    misses = [r for r in runs if r.get("outcome") in ("ended", "hang") and not r["names_victim"]]
    for r in misses[:10]:
        print(f"run {r['run']}: victim {r['victim']}, first message: {r['first_message'][:300]}")
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())

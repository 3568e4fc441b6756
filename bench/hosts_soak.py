#!/usr/bin/env python3
"""The across-hosts soak (issue 47): random network faults at random moments on random hosts of
a distributed `seqpar check` over 4 test hosts × 2 ranks (tests/support/testhosts.py), quiet and
with a CPU hog on every core beside it; prints the table (fault × moment: named right, time to
verdict, records left, replay right) as Markdown and writes every run as JSON.

    sudo python3 bench/hosts_soak.py build [--runs 100] [--loaded-share 0.3] [--json out.json]
                                         [--launch] [--faults kill stop …] [--moments …]

--launch runs every job through `seqpar launch` (docs/clusters.md: the ranks out of Hydra's
group kill, so that a dead host leaves records); --faults draws only those faults.

Faults and moments: tests/support/netfaults.py. Needs root (network namespaces).
"""
import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support"))
from testhosts import TestHosts  # noqa: E402
import netfaults  # noqa: E402


def hog(stop):
    x = 0
    while not stop.is_set():
        x = (x * 1103515245 + 12345) % 2147483648


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--loaded-share", type=float, default=0.3,
                    help="share of the runs made with a CPU hog on every core")
    ap.add_argument("--deadline", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=47)
    ap.add_argument("--json", default="", help="every run's row, written as the soak goes")
    ap.add_argument("--launch", action="store_true", help="every job through seqpar launch")
    ap.add_argument("--faults", nargs="*", default=None,
                    help="only these faults (of cut, kill, kill-ranks, stop, slow, lossy)")
    ap.add_argument("--moments", nargs="*", default=None,
                    help="only these moments (of netfaults.MOMENTS: before-a2a, … after-verdict)")
    ap.add_argument("--table", nargs="*", default=None,
                    help="print the table of earlier soaks' --json files instead of running one")
    a = ap.parse_args()
    if a.table is not None:
        rows = [r for p in a.table for r in json.load(open(p))]
        print_table(rows, a.deadline)
        return
    why = TestHosts.available()
    if why:
        sys.exit(f"hosts_soak: {why}")
    seqpar = os.path.abspath(os.path.join(a.build, "tools", "seqpar"))
    failing = os.path.abspath(os.path.join(a.build, "tests", "mpi", "failing_rank_check"))
    rng = random.Random(a.seed)
    kinds = [(f, m) for f in netfaults.FAULTS for m in netfaults.MOMENTS] + \
        [(f, "whole run") for f in netfaults.NOT_FAULTS]
    if a.faults:
        kinds = [k for k in kinds if k[0] in a.faults]
    if a.moments:
        kinds = [k for k in kinds if k[1] in a.moments]
    if not kinds:
        print(f"hosts_soak: no fault of {a.faults} at a moment of {a.moments}: choose among the "
              f"faults {list(netfaults.FAULTS) + list(netfaults.NOT_FAULTS)} and the moments "
              f"{list(netfaults.MOMENTS)}", file=sys.stderr)
        sys.exit(2)
    rows = []
    work = tempfile.mkdtemp(prefix="seqpar-soak-")
    t0 = time.monotonic()
    with TestHosts(4) as hosts:
        for k in range(a.runs):
            fault, moment = rng.choice(kinds)
            victim = rng.randrange(4)
            loaded = rng.random() < a.loaded_share
            stop = multiprocessing.Event()
            hogs = [multiprocessing.Process(target=hog, args=(stop,), daemon=True)
                    for _ in range(os.cpu_count() or 1)] if loaded else []
            for p in hogs:
                p.start()
            try:
                row = netfaults.run_one(hosts, 8, failing, seqpar, fault, moment, victim,
                                        os.path.join(work, "run"), a.deadline, launch=a.launch)
            except RuntimeError as e:
                row = {"fault": fault, "moment": moment, "host": hosts.names[victim],
                       "error": str(e)}
            finally:
                stop.set()
                for p in hogs:
                    p.join()
            row["loaded"] = loaded
            rows.append(row)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
            print(f"[{time.monotonic() - t0:6.0f}s] {k + 1}/{a.runs} {'loaded' if loaded else 'quiet '} "
                  f"{fault:5} {row['moment']:11} {row['host']}: "
                  + ("skipped: " + row["skipped"][:60] if "skipped" in row else
                     "ERROR " + row["error"] if "error" in row else
                     f"exit {row['exit']} {row['seconds']} s named={row['named_right']} "
                     f"records={row['records_left']} replay={row['replay_right']}"),
                  flush=True)
    print(f"\n{a.runs} runs in {time.monotonic() - t0:.0f} s, deadline {a.deadline} s "
          f"(verdict limit: deadline + 5 s)\n")
    print_table(rows, a.deadline)


def print_table(rows, deadline):
    print("| load | fault | moment | runs | named right | time to verdict (median / max) | "
          "within deadline + 5 s | every process ended | records left | replay names them |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    groups = {}
    for r in rows:
        groups.setdefault((r["loaded"], r["fault"] + (" (launch)" if r.get("launch") else ""),
                           r["moment"]), []).append(r)
    for (loaded, fault, moment), rs in sorted(groups.items()):
        done = [r for r in rs if "exit" in r]
        skipped = [r for r in rs if "skipped" in r]
        if skipped and not done:
            print(f"| {'loaded' if loaded else 'quiet'} | {fault} | {moment} | {len(rs)} | "
                  f"skipped: {skipped[0]['skipped'][:70]} | | | | | |")
            continue
        secs = [r["seconds"] for r in done]
        within = sum(1 for r in done if r["seconds"] <= deadline + 5)
        cnt = lambda key: sum(1 for r in done if r.get(key))
        print(f"| {'loaded' if loaded else 'quiet'} | {fault} | {moment} | {len(rs)} | "
              f"{cnt('named_right')}/{len(done)} | "
              f"{statistics.median(secs) if secs else 0:.1f} / {max(secs) if secs else 0:.1f} s | "
              f"{within}/{len(done)} | "
              f"{sum(1 for r in done if r.get('left_running') == 0 and r.get('mpiexec_ended', True))}/{len(done)} | "
              f"{cnt('records_left')}/{len(done)} | "
              f"{cnt('replay_right')}/{len(done)} |")


if __name__ == "__main__":
    main()

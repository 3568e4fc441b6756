"""Shared driver of the recorded real-job scripts: `python3 SCRIPT MODE OUT.jsonl SCENARIO_JSON`
spawns P gloo processes (port $SEQPAR_JOB_PORT, else a free one) running work(rank, P, mode, out,
config, port), tolerates the failure of
the modes that are meant to break the job, and merges the per-rank streams into OUT.jsonl."""
import datetime
import json
import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
import torch.distributed as dist
import torch.multiprocessing as mp

import seqpar_recorder as spr


def free_port():
    """A port no one listens on now (the kernel's pick), for a job's rendezvous: fixed or
    pid-derived ports collide when jobs of several tests run side by side."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank, P, port, fails_after_s=None):
    """Joins the job's gloo group once every rank has arrived: ranks that start seconds apart
    on a loaded machine meet first at a barrier on the store (5 minutes to arrive), so the
    group's own timeout only has to cover the step. A job meant to break passes
    fails_after_s, the timeout its collectives and receives then end by."""
    store = dist.TCPStore("127.0.0.1", port, P, rank == 0,
                          timeout=datetime.timedelta(seconds=300))
    if store.add("seqpar/arrived", 1) == P:
        store.set("seqpar/all_here", "1")
    store.wait(["seqpar/all_here"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=fails_after_s or 300))


def spawn_all(work, args, P):
    """Runs work(rank, *args) in P forked ranks and lets every rank run to its own end before
    the job is judged; then raises, like torch's join, with the first failure's traceback.
    torch's join stops the other ranks as soon as one fails: a rank that fails at once (a size
    check of its own arguments) would take down a slower peer before that peer wrote the record
    of the call the replay compares with. Fork: the ranks start at once without importing torch
    again, so several jobs can run side by side without a slow start eating into the
    rendezvous timeout."""
    ctx = mp.start_processes(work, args=args, nprocs=P, start_method="fork", join=False)
    for p in ctx.processes:
        p.join()
    while not ctx.join():  # returns at once now; raises for the first rank that failed
        pass


def main(work, P, healthy_modes):
    mode, out, config = sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read())
    port = int(os.environ.get("SEQPAR_JOB_PORT", 0)) or free_port()
    try:
        spawn_all(work, (P, mode, out, config, port), P)
    except Exception as e:  # the broken modes end inside gloo (error or timeout): expected
        if mode in healthy_modes:
            raise
        print(f"job ended: {type(e).__name__}", file=sys.stderr)
    spr.merge(out, [f"{out}.rank{r}" for r in range(P)])

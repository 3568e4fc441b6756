"""Shared driver of the recorded real-job scripts: `python3 SCRIPT MODE OUT.jsonl SCENARIO_JSON`
spawns P gloo processes (port $SEQPAR_JOB_PORT, else derived from the pid) running work(rank, P, mode, out, config, port), tolerates the failure of
the modes that are meant to break the job, and merges the per-rank streams into OUT.jsonl."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
import torch.multiprocessing as mp

import seqpar_recorder as spr


def main(work, P, healthy_modes, base_port):
    mode, out, config = sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read())
    port = int(os.environ.get("SEQPAR_JOB_PORT", base_port + os.getpid() % 100))
    try:
        # fork: the ranks start at once without importing torch again, so several jobs can run
        # side by side without a slow start eating into the rendezvous timeout.
        mp.start_processes(work, args=(P, mode, out, config, port), nprocs=P, start_method="fork")
    except Exception as e:  # the broken modes end inside gloo (error or timeout): expected
        if mode in healthy_modes:
            raise
        print(f"job ended: {type(e).__name__}", file=sys.stderr)
    spr.merge(out, [f"{out}.rank{r}" for r in range(P)])

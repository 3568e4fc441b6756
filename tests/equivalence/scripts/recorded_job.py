"""Shared driver of the recorded real-job scripts: `python3 SCRIPT MODE OUT.jsonl SCENARIO_JSON`
spawns P gloo processes running work(rank, P, mode, out, config, port), tolerates the failure of
the modes that are meant to break the job, and merges the per-rank streams into OUT.jsonl."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
import torch.multiprocessing as mp

import seqpar_recorder as spr


def main(work, P, healthy_modes, base_port):
    mode, out, config = sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read())
    port = base_port + os.getpid() % 100
    try:
        mp.spawn(work, args=(P, mode, out, config, port), nprocs=P)
    except Exception as e:  # the broken modes end inside gloo (error or timeout): expected
        if mode in healthy_modes:
            raise
        print(f"job ended: {type(e).__name__}", file=sys.stderr)
    spr.merge(out, [f"{out}.rank{r}" for r in range(P)])

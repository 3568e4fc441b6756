#!/usr/bin/python3
"""Real PyTorch jobs recorded with the legacy (non-Kineto) profiler export, for `seqpar import
--from kineto`: torch.profiler(record_shapes=True) on a CPU build without Kineto writes a bare JSON
array whose collectives are backend events ("gloo:all_to_all", "gloo:all_reduce") with empty args.

    /usr/bin/python3 tests/jobs/gen_legacy_profiler_traces.py P OUT_DIR [hang|op_mismatch]

P gloo processes on localhost each run an all_to_all_single of a [2P, 4, 8] tensor and an
all_reduce of 16 values, and export OUT_DIR/rank<r>.json. With `hang`, the last rank skips the
all_reduce: the others wait until gloo's 4 s timeout, catch the error and still export (a rank
that gloo aborts instead loses its file — run again until every rank wrote one). With
`op_mismatch`, the last rank all-gathers its 16 values where the others all-reduce them.
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile


def work(rank, P, out, mode):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29533"
    dist.init_process_group("gloo", rank=rank, world_size=P, timeout=datetime.timedelta(seconds=4))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        x = torch.randn(P * 2, 4, 8)
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)
        g = torch.randn(16)
        try:
            if mode == "op_mismatch" and rank == P - 1:
                dist.all_gather([torch.empty_like(g) for _ in range(P)], g)
            elif not (mode == "hang" and rank == P - 1):
                dist.all_reduce(g)
        except RuntimeError as e:
            print(f"rank {rank}: {str(e)[:80]}", file=sys.stderr)
    prof.export_chrome_trace(f"{out}/rank{rank}.json")


if __name__ == "__main__":
    P, out, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "healthy"
    os.makedirs(out, exist_ok=True)
    mp.spawn(work, args=(P, out, mode), nprocs=P)

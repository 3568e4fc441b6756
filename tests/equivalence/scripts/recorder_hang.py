"""A real 4-process gloo job recorded with tools/seqpar_recorder.py in which rank 3 skips the
all_reduce the others make: they wait until gloo's 2 s timeout, which raises or aborts the
process (SIGABRT). Writes the per-rank streams OUT.rank<r> whatever happens; the test merges and
replays them and expects rank 3 named. Usage: recorder_hang.py OUT.jsonl"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
import torch
import torch.distributed as dist

import recorded_job
import seqpar_recorder as spr


def work(rank, P, out, port):
    recorded_job.init_gloo(rank, P, port, fails_after_s=2)
    rec = spr.Recorder(out)
    x = torch.randn(P * 2, 2, 4)
    y = torch.empty_like(x)
    with rec.tag("L0.attn.q.fwd"):
        dist.all_to_all_single(y, x)
    g = torch.randn(8)
    if rank != P - 1:
        with rec.tag("grad.sync"):
            dist.all_reduce(g)  # never returns normally on ranks 0..P-2
    rec.close()


if __name__ == "__main__":
    try:
        recorded_job.spawn_all(work, (4, sys.argv[1], recorded_job.free_port()), 4)
    except Exception as e:  # the victims' timeouts: expected
        print(f"job ended: {type(e).__name__}", file=sys.stderr)

"""A real 2-process gloo job through tools/seqpar_recorder.py's recording(): the list form of
all_gather, an async all_reduce completed by wait(), isend/irecv and batch_isend_irecv (whose
P2POp checks its op against torch's own isend/irecv). Writes the merged trace to OUT.jsonl.
Usage: recorder_p2p_lists.py OUT.jsonl"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
import torch
import torch.distributed as dist

import recorded_job
import seqpar_recorder as spr


def work(rank, P, out, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=P)
    with spr.recording(out):
        t = torch.ones(3) * rank
        dist.all_gather([torch.empty(3) for _ in range(P)], t)
        dist.all_reduce(t, async_op=True).wait()
        peer = 1 - rank
        if rank == 0:
            dist.isend(torch.ones(2), peer).wait()
        else:
            dist.irecv(torch.empty(2), peer).wait()
        ops = [dist.P2POp(dist.isend, torch.ones(4), peer),
               dist.P2POp(dist.irecv, torch.empty(4), peer)]
        for work_handle in dist.batch_isend_irecv(ops):
            work_handle.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1]
    recorded_job.spawn_all(work, (2, out, recorded_job.free_port()), 2)
    spr.merge(out, [f"{out}.rank{r}" for r in range(2)])

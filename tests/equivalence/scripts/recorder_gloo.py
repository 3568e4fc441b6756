"""A tiny single-process gloo run (world_size 1) through tools/seqpar_recorder.py: Ulysses-like
all-to-alls with and without splits, an all_reduce, a broadcast and a
barrier, plus the collator layout; writes the trace to argv[1] (p2p needs two ranks)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
import torch
import torch.distributed as dist

import recorded_job
import seqpar_recorder as spr

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(recorded_job.free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
rec = spr.Recorder(sys.argv[1])
rec.name_group(dist.group.WORLD, "ulysses0")
x = torch.arange(8 * 4 * 2, dtype=torch.float32).reshape(8, 4, 2)
out = torch.empty_like(x)
with rec.tag("L0.attn.q.fwd"):
    dist.all_to_all_single(out, x, [8], [8])
with rec.tag("L0.attn.out.fwd"):
    dist.all_to_all_single(out, x)
# (gloo in torch 1.13 has no _allgather_base / reduce_scatter_tensor: not called here.)
with rec.tag("init.params"):
    dist.broadcast(x, 0)
dist.barrier()
n = torch.tensor([5], dtype=torch.int64)
with rec.tag("loss.valid_tokens"):
    dist.all_reduce(n)
rec.record_layout(0, {"input_ids": torch.arange(8), "cu_seqlens": torch.tensor([0, 5, 8]),
                      "max_seqlen": 5, "position_ids": torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])})
path = rec.close()
dist.destroy_process_group()
print(path)

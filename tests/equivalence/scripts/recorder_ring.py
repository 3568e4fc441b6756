"""A real 4-process gloo ring-attention forward (ring 4, zigzag, two packed documents) recorded
by tools/seqpar_recorder.py with the scenario in meta: each rank builds its own zigzag layout
the way xorl's collator does (per document 2R chunks, rank r keeps chunks r and 2R-1-r), records
it, passes its K/V block around the ring with isend/irecv for R-1 steps, then all-reduces a
gradient.

    recorder_ring.py MODE OUT.jsonl SCENARIO_JSON
MODE: healthy | wrong_peer (rank 2 sends its block two hops ahead, to rank 0, at step 0; the job
      times out) | cu_from_zigzag_ids (cu_seqlens computed from the zigzagged position ids)
      | grad_op_mismatch (rank 1 all-gathers its gradient where the others all-reduce it)
Writes OUT.jsonl (merged) for `seqpar replay`.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
import torch
import torch.distributed as dist

import recorded_job
import seqpar_recorder as spr

DOCS, H, HKV, D = [16, 8], 2, 2, 8
HEALTHY = ("healthy", "cu_from_zigzag_ids")  # the modes whose job ends normally


def zigzag_local(values, R, r):
    """Rank r's tokens: per document, chunks r and 2R-1-r of 2R equal chunks."""
    out, start = [], 0
    for d in DOCS:
        c = d // (2 * R)
        doc = values[start:start + d]
        out += doc[r * c:(r + 1) * c] + doc[(2 * R - 1 - r) * c:(2 * R - r) * c]
        start += d
    return out


def cu_from(pos):
    starts = [i for i, p in enumerate(pos) if p == 0]
    return starts + [len(pos)]


def work(rank, R, mode, out, config, port):
    # 10 s: the broken modes that hang end by this timeout.
    recorded_job.init_gloo(rank, R, port, None if mode in HEALTHY else 10)
    rec = spr.Recorder(out, config=config)
    rec.name_group(dist.group.WORLD, "ring0")
    pos = [p for d in DOCS for p in range(d)]
    ids = list(range(100, 100 + len(pos)))
    zig_pos = [p for r in range(R) for p in zigzag_local(pos, R, r)]
    cu = cu_from(zig_pos) if mode == "cu_from_zigzag_ids" else cu_from(pos)
    local = zigzag_local(ids, R, rank)
    rec.record_layout(rank, {"input_ids": local, "position_ids": zig_pos, "cu_seqlens": cu,
                             "max_seqlen": max(b - a for a, b in zip(cu, cu[1:]))})
    torch.manual_seed(rank)
    n = len(local)
    q = torch.randn(n, H, D)
    kv = torch.randn(n, HKV, 2, D)
    acc = torch.zeros(n, H, D)
    for step in range(R - 1):
        dst = (rank + 1) % R
        if mode == "wrong_peer" and rank == 2 and step == 0:
            dst = (rank + 2) % R  # off by one hop
        buf = torch.empty_like(kv)
        with rec.tag(f"L0.attn.ring.fwd.step{step}"):
            send = dist.isend(kv, dst)
            recv = dist.irecv(buf, (rank - 1) % R)
            send.wait()
            recv.wait()
        # (the block's attention contribution; the values do not matter to the trace)
        acc += torch.einsum("nhd,mkd->nhd", q, buf[:, :, 0, :]) / n
        kv = buf
    g = acc.sum(0).reshape(-1)
    with rec.tag("grad.sync"):
        if mode == "grad_op_mismatch" and rank == 1:
            dist.all_gather([torch.empty_like(g) for _ in range(R)], g)
        else:
            dist.all_reduce(g)
    rec.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    recorded_job.main(work, 4, HEALTHY)

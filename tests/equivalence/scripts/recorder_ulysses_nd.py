"""A real 2-process gloo Ulysses attention step written the way DeepSpeed writes its all-to-all
(all_to_all_single on a permuted 5-D [P, s, batch, H/P, d] tensor) and, for an uneven sequence,
with split sizes on a 4-D input, recorded by tools/seqpar_recorder.py with the scenario in meta.

    recorder_ulysses_nd.py MODE OUT.jsonl SCENARIO_JSON
MODE: healthy | kv_not_repeated (KV head 1 < P sent as is) | seq_not_padded (15 tokens, 8 + 7)
      | stale_out_splits (16 tokens, 8 + 8; rank 1 passes the receive splits [9, 7] of an
        earlier step)
      | float64_rank (rank 1 runs its attention in float64 and sends float64 q)
The broken ones fail inside gloo (size mismatch) or time out; every rank's stream survives.
Writes OUT.jsonl (merged) for `seqpar replay`.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
import torch
import torch.distributed as dist

import recorded_job
import seqpar_recorder as spr

H, HKV, D, BS = 4, 1, 8, 1
HEALTHY = ("healthy", "kv_not_repeated", "seq_not_padded")  # the modes whose job ends normally


def scatter_heads(x, P, tag, splits=None):
    """[s, bs, h, d] → all-to-all → [P·s, bs, h/P, d] (DeepSpeed's single_all_to_all)."""
    s, bs, h, d = x.shape
    send = x.reshape(s, bs, P, h // P, d).permute(2, 0, 1, 3, 4).contiguous()
    if splits is None:
        recv = torch.empty_like(send)
        with REC.tag(tag):
            dist.all_to_all_single(recv, send)
        return recv.reshape(P * s, bs, h // P, d)
    recv = torch.empty(sum(splits), bs, h // P, d, dtype=x.dtype)
    with REC.tag(tag):
        dist.all_to_all_single(recv, send.reshape(P, s * bs, h // P, d), splits, None)
    return recv


def gather_heads(x, P, tag):
    """[P·s, bs, h/P, d] → all-to-all → [s, bs, h, d]."""
    S, bs, hp, d = x.shape
    send = x.reshape(P, S // P, bs, hp, d).contiguous()
    recv = torch.empty_like(send)
    with REC.tag(tag):
        dist.all_to_all_single(recv, send)
    return recv.permute(1, 2, 0, 3, 4).reshape(S // P, bs, P * hp, d)


def work(rank, P, mode, out, config, port):
    global REC
    # 10 s: the broken modes that hang end by this timeout.
    recorded_job.init_gloo(rank, P, port, None if mode in HEALTHY else 10)
    REC = spr.Recorder(out, config=config)
    REC.name_group(dist.group.WORLD, "ulysses0")
    torch.manual_seed(rank)
    lens = [8, 7] if mode == "seq_not_padded" else [8, 8]
    s = lens[rank]
    dtype = torch.float64 if mode == "float64_rank" and rank == 1 else torch.float32
    q = torch.randn(s, BS, H, D, dtype=dtype)
    k = torch.randn(s, BS, HKV, D, dtype=dtype)
    v = torch.randn(s, BS, HKV, D, dtype=dtype)
    if mode == "stale_out_splits":
        # Rank 1 keeps the receive splits of an earlier step.
        qg = scatter_heads(q, P, "L0.attn.q.fwd", splits=[9, 7] if rank == 1 else lens)
    elif mode == "seq_not_padded":
        qg = scatter_heads(q, P, "L0.attn.q.fwd", splits=lens)
    else:
        qg = scatter_heads(q, P, "L0.attn.q.fwd")
    if mode != "kv_not_repeated":  # repeat_interleave every KV head P/HKV times
        k = k.repeat_interleave(P // HKV, dim=2)
        v = v.repeat_interleave(P // HKV, dim=2)
        kg = scatter_heads(k, P, "L0.attn.k.fwd", splits=lens if mode == "seq_not_padded" else None)
        vg = scatter_heads(v, P, "L0.attn.v.fwd", splits=lens if mode == "seq_not_padded" else None)
    else:  # sent unrepeated: P blocks of the flat tensor, each rank gets half the tokens' head
        send = k.reshape(P, s // P, BS, HKV, D).contiguous()
        kg = torch.empty_like(send)
        with REC.tag("L0.attn.k.fwd"):
            dist.all_to_all_single(kg, send)
        vg = kg
    if mode != "seq_not_padded":
        o = torch.nn.functional.softmax(torch.einsum("sbhd,tbhd->bhst", qg, kg.expand_as(qg) if
                                                     kg.shape == qg.shape else qg), -1)
        attn = torch.einsum("bhst,tbhd->sbhd", o, qg)
        gather_heads(attn.contiguous(), P, "L0.attn.out.fwd")
    g = torch.ones(4)
    with REC.tag("grad.sync"):
        dist.all_reduce(g)
    REC.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    recorded_job.main(work, 2, HEALTHY)

"""Real jobs under the project's torch (2.x, gloo, CPU), recorded the two ways a user records a
job: the PyTorch profiler (Kineto chrome trace, record_shapes=True) and the Flight Recorder
(torch's own ring buffer of collectives, dumped as JSON). For `seqpar import` / `replay`.

    python torch_trace_jobs.py MODE OUT_DIR [--world P] [--port N]

writes OUT_DIR/kineto/rank<r>.json and (a torch whose Flight Recorder records gloo: 2.11 does,
2.1 does not) OUT_DIR/fr/nccl_trace_rank_<r>.json for every rank that lives to write them. The step is a Ulysses attention layer over all P ranks (P = 4 by default):
all-to-alls of q, of the fused k/v and of the output forward, their transposes backward, the
gradients all-reduced, the embedding broadcast from rank 0, a loss all-gathered, and one ring
hop (send to r+1, receive from r-1). Modes (traces/README.md's bugs, made for real):

  healthy         every rank does the step.
  stale_splits    rank 1 passes the output all-to-all a split list left from the previous
                  (longer) batch; rank 3 dies (os._exit) after the step, before writing a file.
  hang            rank 3 dies before the gradient all-reduce; the others wait out gloo's
                  timeout (8 s) in that call, catch the error and write their files.
  wrong_root      rank 2 broadcasts the embedding from root 1, the others from root 0.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import warnings
from torch.profiler import ProfilerActivity, profile

import recorded_job

H, HKV, D = 8, 4, 8  # heads, KV heads, head_dim


def _step(rank, P, mode, log):
    """One Ulysses layer's collectives; returns normally or after a caught timeout."""
    S = 4 * P  # tokens: 4 per rank
    s = S // P
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(s, H, D, generator=g)
    kv = torch.randn(s, 2 * HKV, D, generator=g)

    def seq_to_heads(x):  # [s, h, D] -> [S, h/P, D]: send head block j to rank j
        h = x.shape[1]
        send = x.reshape(s, P, h // P, D).permute(1, 0, 2, 3).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        return recv.reshape(S, h // P, D)

    def heads_to_seq(x, out_splits=None):  # [S, h/P, D] -> [s, h, D]
        hp = x.shape[1]
        send = x.contiguous()
        rows = [s] * P if out_splits is None else out_splits
        recv = torch.empty(sum(rows), hp, D)
        dist.all_to_all_single(recv, send, output_split_sizes=rows, input_split_sizes=[s] * P)
        return recv

    qg, kvg = seq_to_heads(q), seq_to_heads(kv)
    out = qg * 0.5 + kvg[:, : H // P]
    # The stale list: rows of the previous, longer batch (s + 2 from the last peer).
    stale = [s] * (P - 1) + [s + 2] if (mode == "stale_splits" and rank == 1) else None
    try:
        o = heads_to_seq(out, stale)
    except RuntimeError as e:
        log.append("rank %d: output all-to-all: %s" % (rank, str(e).splitlines()[0][:120]))
        o = torch.zeros(s, H // P, D)
    # Backward: the transposes, in reverse.
    dout = torch.ones(s, H, D)
    seq_to_heads(dout)
    heads_to_seq(torch.ones(S, 2 * HKV // P, D))
    heads_to_seq(torch.ones(S, H // P, D))
    if mode == "hang" and rank == P - 1:
        os._exit(3)  # a rank lost mid-step: no file
    grads = torch.full((64,), float(rank))
    try:
        dist.all_reduce(grads)
        emb = torch.arange(16.0) if rank == 0 else torch.zeros(16)
        dist.broadcast(emb, 1 if (mode == "wrong_root" and rank == 2) else 0)
        losses = torch.empty(P)
        dist.all_gather_into_tensor(losses, torch.tensor([float(o.sum())]))
        # One ring hop (ring attention's KV rotation).
        blk = torch.full((s, HKV, D), float(rank))
        recv = torch.empty_like(blk)
        reqs = [dist.isend(blk, (rank + 1) % P), dist.irecv(recv, (rank - 1) % P)]
        for r in reqs:
            r.wait()
    except RuntimeError as e:
        log.append("rank %d: %s" % (rank, str(e).splitlines()[0][:120]))


def has_flight_recorder():
    """Whether this torch records gloo collectives in its Flight Recorder (torch 2.1 does not)."""
    return hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json")


def _work(rank, P, mode, out, port):
    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # the Flight Recorder's ring buffer
    torch.set_num_threads(1)
    # The broken modes end by gloo's timeout (8 s) in their collectives; the rendezvous waits
    # for slow starters either way (16 processes importing torch at once on 2 cores).
    recorded_job.init_gloo(rank, P, port, None if mode == "healthy" else 8)
    log = []
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _step(rank, P, mode, log)
    for line in log:
        print(line, file=sys.stderr)
    if mode == "stale_splits" and rank == 3:
        os._exit(3)  # dies after the step, before writing anything
    prof.export_chrome_trace(os.path.join(out, "kineto", "rank%d.json" % rank))
    if not has_flight_recorder():
        os._exit(0)
    fr = torch._C._distributed_c10d._dump_fr_trace_json()
    fr = fr.decode() if isinstance(fr, bytes) else fr
    tmp = os.path.join(out, "fr", ".nccl_trace_rank_%d.json.tmp" % rank)
    with open(tmp, "w") as f:
        f.write(json.dumps(json.loads(fr), indent=None))
    os.replace(tmp, os.path.join(out, "fr", "nccl_trace_rank_%d.json" % rank))
    # No destroy_process_group: a peer may be dead; the process exits here.
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("healthy", "stale_splits", "hang", "wrong_root"))
    ap.add_argument("out")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--port", type=int, default=int(os.environ.get("SEQPAR_JOB_PORT", 0)),
                    help="the rendezvous port (default: a free one)")
    a = ap.parse_args()
    a.port = a.port or recorded_job.free_port()
    for sub in ("kineto", "fr") if has_flight_recorder() else ("kineto",):
        os.makedirs(os.path.join(a.out, sub), exist_ok=True)
    # Forked: the ranks start with torch imported (this process runs no torch work first).
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_work, args=(r, a.world, a.mode, a.out, a.port))
             for r in range(a.world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]
    print("%s: exit codes %s; torch %s" % (a.mode, codes, torch.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())

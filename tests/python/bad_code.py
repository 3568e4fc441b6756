"""User code that breaks the contract in the ways real code does; seqpar.testing must say which
and how, and leave nothing running. Each is the healthy example with one thing wrong."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "python", "examples"))
import zigzag_ring_attention as zra  # noqa: E402

healthy = zra.attention


def raises_on_rank1(q, k, v, ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1 gives up")
    return healthy(q, k, v, ctx)


def hangs_on_rank0(q, k, v, ctx):
    if ctx.rank == 0:
        while True:
            time.sleep(0.01)
    return healthy(q, k, v, ctx)


def wrong_shape(q, k, v, ctx):
    return healthy(q, k, v, ctx)[:, :1]


def wrong_dtype(q, k, v, ctx):
    return healthy(q, k, v, ctx).double()


def returns_tuple(q, k, v, ctx):
    out = healthy(q, k, v, ctx)
    return out, torch.zeros(1)


def writes_into_q(q, k, v, ctx):
    with torch.no_grad():
        q.mul_(1.5)  # "pre-scaling" q in place, on the caller's tensor
    return healthy(q, k, v, ctx)


def detached(q, k, v, ctx):
    return healthy(q.detach(), k, v, ctx)

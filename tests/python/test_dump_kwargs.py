"""Every keyword argument of the dump hook (seqpar.dump.Dumper) read from the users' side: a job
that computes its attention with an option and hands the hook that option's value, as the
docs say, is judged correct by `seqpar validate --dump`; its twin, the same correct job handing
the hook the value off by one (a window one key short, the right side taken from the left, a
chunk one longer, another cap, the causal flag flipped, a scale of another head_dim, a document
boundary one token late, positions from 1), is judged wrong. So a hook that records a value
other than the one it is given, or a reader that ignores one, fails here."""
import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(SRC, "python"))

import seqpar.dump as sd  # noqa: E402

SEQPAR = os.environ.get("SEQPAR") or os.path.join(SRC, "build", "tools", "seqpar")
S, H, HKV, D = 24, 4, 2, 8
CU = [0, 15, 24]   # two documents


def positions(cu):
    return [t - a for a, e in zip(cu, cu[1:]) for t in range(a, e)]


def attention(q, k, v, cu, causal=True, back=-1, ahead=-1, chunk=0, softcap=0.0, scale=None):
    """The attention the docs define (docs/attention.md), in float64: query p sees key j of its
    document iff (causal: j ≤ p), p − j ≤ back (back ≥ 0), j − p ≤ ahead (ahead ≥ 0), and
    p // chunk == j // chunk (chunk > 0), positions counted from each document's start."""
    pos = torch.tensor(positions(cu))
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu[1:]) -
                                  torch.tensor(cu[:-1]))
    p, j = pos[:, None], pos[None, :]
    seen = doc[:, None] == doc[None, :]
    if causal:
        seen &= j <= p
    if back >= 0:
        seen &= p - j <= back
    if ahead >= 0:
        seen &= j - p <= ahead
    if chunk:
        seen &= p // chunk == j // chunk
    kk = k.repeat_interleave(H // HKV, dim=1)
    vv = v.repeat_interleave(H // HKV, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * (scale or D ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~seen[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


# name: (the options the job computes with, the hook's keywords as the docs give them, the
# twin's keywords: one value off)
CASES = {
    "window_back": (dict(back=4), dict(window_back=4), dict(window_back=3)),
    "window_ahead": (dict(causal=False, back=3, ahead=5),
                     dict(causal=False, window_back=3, window_ahead=5),
                     dict(causal=False, window_back=3, window_ahead=3)),
    "chunk": (dict(chunk=4), dict(chunk=4), dict(chunk=5)),
    "softcap": (dict(softcap=0.5), dict(softcap=0.5), dict(softcap=1.0)),
    "causal": (dict(causal=False), dict(causal=False), dict(causal=True)),
    "scale": (dict(scale=0.5), dict(scale=0.5), dict(scale=D ** -0.5)),
    "cu_seqlens": (dict(), dict(cu_seqlens=CU), dict(cu_seqlens=[0, 16, 24])),
    "position_ids": (dict(), dict(position_ids=positions(CU)),
                     dict(position_ids=[p + 1 for p in positions(CU)])),
}


def dump_job(tmp, name, opts, kwargs):
    """The one-rank job: its attention with `opts`, the hook given `kwargs` (over defaults that
    describe the job without options). Returns (exit code, report) of validate --dump."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(S, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(S, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(S, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    kw = dict(ulysses=1, ring=1, ulysses_rank=0, ring_rank=0, heads=H, kv_heads=HKV,
              head_dim=D, scale=D ** -0.5, causal=True, cu_seqlens=CU,
              position_ids=positions(CU), rank=0, world_size=1, durable=False)
    kw.update(kwargs)
    out_dir = os.path.join(str(tmp), name)
    d = sd.Dumper(out_dir, **kw)
    with d.call("L0.attn"):
        out = d.tap("out.local", attention(d.tap("q.local", q), d.tap("k.local", k),
                                           d.tap("v.local", v), CU, **opts))
    out.sum().backward()
    d.close()
    p = subprocess.run([SEQPAR, "validate", "--dump", out_dir, "-q", "--json"],
                       capture_output=True, text=True, timeout=120)
    return p.returncode, (json.loads(p.stdout) if p.stdout.strip() else p.stderr)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_hook_keyword_is_read_and_its_twin_fails(tmp_path, name):
    opts, right, twin = CASES[name]
    rc, rep = dump_job(tmp_path, name, opts, right)
    assert rc == 0 and rep["pass"], (name, rc, rep)
    rc, rep = dump_job(tmp_path, name + "-twin", opts, twin)
    assert rc == 1 and not rep["pass"] and rep["first_difference"] is not None, (name, rc, rep)

#!/usr/bin/env python3
r"""Real distributed PyTorch sequence-parallel attention jobs (CPU, gloo) that write
`seqpar-dump/1` dumps through the user hook tools/seqpar_dump.py — healthy Ulysses, zigzag ring
and hybrid jobs, and broken variants that each change one realistic thing.

Every job spawns U·R processes, builds deterministic global q [S,H,D], k/v [S,Hkv,D] and a loss
weight w (loss = sum(out * w)), takes the rank's shard (zigzag over the ring, contiguous Ulysses
pieces inside a ring rank's tokens, cp_rank = ring_rank·U + ulysses_rank), runs ONE attention
call forward and backward, and dumps it as any user script would.

    python3 sp_jobs.py --list
    python3 sp_jobs.py --job ulysses --variant healthy_u4 --dtype bf16 --out /tmp/d
    python3 sp_jobs.py --all tests/equivalence/data/dumps      # dumps + expected.json
    python3 sp_jobs.py --compare DIR_A DIR_B                   # first stage where they differ
    python3 sp_jobs.py --selfcheck [ROOT]                      # healthy jobs vs a float64 reference
"""
import argparse
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(_HERE)), "tools"))  # for seqpar_dump
import seqpar_dump  # noqa: E402

# The jobs' ranks are forked from this process (run_job): it keeps torch to one thread, so
# that no OpenMP thread pool exists when it forks.
torch.set_num_threads(1)

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# The backends sdpa_attend can force (see there).
SDPA_KERNELS = ("flash", "efficient", "cudnn", "math", "math+tf32", "emulate")


# The large-logit jobs multiply q so that lse exceeds log of the largest finite value of their
# dtype (11.09 for f16, 88.7 for bf16) on many rows; the lse_merge_no_max variant merges in the
# job's own dtype (bf16 or f16). Fixed per dtype: a job means the same thing under every torch.
def lowp_qmul(dtype):
    return 8.0 if dtype == "f16" else 64.0


# ----------------------------------------------------------------------------- job table

_SHAPES = {
    "ulysses": dict(U=2, R=1, S=32, H=4, Hkv=2, D=8, docs=[12, 20]),
    "ring": dict(U=1, R=2, S=32, H=4, Hkv=2, D=8, docs=[8, 24]),
    "hybrid": dict(U=2, R=2, S=32, H=4, Hkv=2, D=8, docs=[12, 20]),
}

# variant -> (job, overrides, bug, short cause)
VARIANTS = {
    ("ulysses", "healthy_u2"): (dict(U=2), None, ""),
    ("ulysses", "healthy_u4"): (dict(U=4), None, ""),
    ("ring", "healthy_r2"): (dict(R=2), None, ""),
    ("ring", "healthy_r4"): (dict(R=4, S=64, docs=[16, 48]), None, ""),
    ("ring", "healthy_r2_bigq"): (dict(R=2, qmul="lowp"), None, ""),
    ("hybrid", "healthy_u2r2"): (dict(U=2, R=2), None, ""),
    ("ulysses", "no_kv_repeat"): (
        dict(U=4), "no_kv_repeat",
        "KV heads not repeated before the all-to-all: each rank gets half a KV head"),
    ("ulysses", "blockwise_repeat"): (
        dict(U=4), "blockwise_repeat",
        "KV heads tiled (repeat) instead of interleaved: rank u holds KV head u % Hkv"),
    ("ulysses", "a2a_wrong_dims"): (
        dict(U=2), "a2a_wrong_dims",
        "all-to-all on the token-major buffer: splits the sequence instead of the heads"),
    ("ring", "local_cu"): (
        dict(R=2), "local_cu",
        "cu_seqlens from local position_ids: documents merged on ring rank 1"),
    ("ring", "zigzag_swapped"): (
        dict(R=2), "zigzag_swapped",
        "zigzag shard holds the late chunk before the early chunk"),
    ("ulysses", "no_scale"): (
        dict(U=2), "no_scale", "softmax scale 1 instead of 1/sqrt(head_dim)"),
    ("ring", "lse_merge_no_max"): (
        dict(R=2, qmul="lowp"), "lse_merge_no_max",
        "ring merge exp(lse) without max subtraction overflows in the low precision"),
    ("ring", "ring_src_off_by_one"): (
        dict(R=4, S=64, docs=[16, 48]), "ring_src_off_by_one",
        "ring section chosen for source (r-i+1) mod R while holding KV of (r-i) mod R"),
    # The other ways round and the longer shifts (each only possible with more ring ranks: -1
    # needs R > 2, +2 and -2 differ from each other only for R > 4).
    ("ring", "ring_src_off_by_minus_one"): (
        dict(R=4, S=64, docs=[16, 48]), "ring_src_off_by_minus_one",
        "ring section chosen for source (r-i-1) mod R while holding KV of (r-i) mod R"),
    ("ring", "ring_src_off_by_two"): (
        dict(R=5, S=80, docs=[20, 60]), "ring_src_off_by_two",
        "ring section chosen for source (r-i+2) mod R while holding KV of (r-i) mod R"),
    ("ring", "ring_src_off_by_minus_two"): (
        dict(R=5, S=80, docs=[20, 60]), "ring_src_off_by_minus_two",
        "ring section chosen for source (r-i-2) mod R while holding KV of (r-i) mod R"),
    ("ring", "zigzag_halves_swapped"): (
        dict(R=2), "zigzag_halves_swapped",
        "the shard is right but the masks take each local document as [late | early]: lower "
        "sections see the KV's late half, upper ones give the early query rows every KV row"),
    ("ulysses", "kv_grad_not_summed"): (
        dict(U=4), "kv_grad_not_summed",
        "KV repeat backward keeps the first copy's gradient instead of summing the copies"),
    ("ulysses", "no_causal"): (
        dict(U=2), "no_causal", "causal mask missing inside documents"),
    # Mistakes no fixed list names; validate --dump's families of mistakes must (issue 31).
    ("ulysses", "causal_hides_diag"): (
        dict(U=2), "causal_hides_diag",
        "causal mask j < i instead of j <= i: a token does not attend to itself"),
    ("ulysses", "scale_inv_d_one_rank"): (
        dict(U=2), "scale_inv_d_one_rank",
        "softmax scale 1/head_dim instead of 1/sqrt(head_dim) on Ulysses rank 1 only"),
    ("ulysses", "last_token_own_doc"): (
        dict(U=2), "last_token_own_doc",
        "each document's last token attended as a document of its own (cu_seqlens off by one)"),
    ("ring", "kv_grad_not_reduced"): (
        dict(R=2), "kv_grad_not_reduced",
        "ring K/V gradients not reduced over the ring: each rank keeps its own queries' part"),
    # Mistakes a fixed list of family members does not hold; named by fitting (issue 46).
    ("ring", "scale_padded_d"): (
        dict(R=2, D=12), "scale_padded_d",
        "softmax scale 1/sqrt(8*ceil(D/8)) (head_dim rounded up as for a padded kernel)"),
    ("ring", "docmask_own_block"): (
        dict(R=2), "docmask_own_block",
        "document mask applied only on the ring's own (diagonal) block"),
    ("ring", "bwd_docmask_own_block"): (
        dict(R=2), "bwd_docmask_own_block",
        "the backward alone applies the document mask only on the ring's own (diagonal) block "
        "(the forward right)"),
    ("ring", "dq_other_blocks_unscaled"): (
        dict(R=2), "dq_other_blocks_unscaled",
        "dQ contributions of other ranks' KV blocks not multiplied by the softmax scale"),
    ("ring", "dkv_last_hop_wrong_way"): (
        dict(R=4, S=64, docs=[16, 48]), "dkv_last_hop_wrong_way",
        "the dK/dV accumulator's last hop sent to r-1 instead of r+1: rank r gets block r+2's"),
}

# Precision (issue 37): correct kernels that round or sum differently (healthy: the largest
# error a correct kernel may show), and precision bugs framework authors have made. They run on
# larger shapes (the error grows with the document length and head_dim); `prec` selects the
# code path. Their verdicts and errors are in tests/jobs/precision_catalogue.py.
_PREC_RING = dict(R=4, S=256, docs=[64, 192], D=32)
_PREC_ULY = dict(U=2, S=256, docs=[96, 160], D=32)
PRECISION = {
    ("ring", "healthy_r4_wide"): (dict(_PREC_RING), None, ""),
    ("ring", "healthy_r4_blocked"): (
        dict(_PREC_RING, prec="blocked"), None,
        "online softmax over blocks of 16 keys in float32 (a flash-style kernel's order)"),
    ("ring", "healthy_r4_p_lowp_gemm"): (
        dict(_PREC_RING, prec="p_lowp_gemm"), None,
        "P and dS rounded to the input dtype before each matrix product, float32 accumulation "
        "(what FlashAttention's tensor-core GEMMs do)"),
    ("ring", "healthy_r4_merge_reverse"): (
        dict(_PREC_RING, prec="merge_reverse"), None,
        "the ring's partial outputs merged from the last step to the first"),
    ("ring", "healthy_r4_merge_shuffled"): (
        dict(_PREC_RING, prec="merge_shuffled"), None,
        "the ring's partial outputs merged in a shuffled step order (2, 0, 3, 1 for R 4)"),
    ("ring", "healthy_r4_merge_tree"): (
        dict(_PREC_RING, prec="merge_tree"), None,
        "the ring's partial outputs merged pairwise as a tree ((0+1) + (2+3))"),
    ("ulysses", "healthy_u2_wide"): (dict(_PREC_ULY), None, ""),
    ("ulysses", "healthy_u2_blocked"): (
        dict(_PREC_ULY, prec="blocked"), None,
        "online softmax over blocks of 16 keys in float32 (a flash-style kernel's order)"),
    ("ulysses", "scores_lowp"): (
        dict(_PREC_ULY, prec="scores_lowp"), "scores_lowp",
        "scores and softmax computed in the input dtype instead of float32"),
    ("ring", "scores_lowp"): (
        dict(_PREC_RING, prec="scores_lowp"), "scores_lowp",
        "scores and softmax computed in the input dtype instead of float32"),
    ("ring", "lse_lowp"): (
        dict(_PREC_RING, prec="lse_lowp"), "lse_lowp",
        "LSE rounded to the input dtype when saved for the backward (the returned LSE is exact)"),
    ("ring", "merge_lowp"): (
        dict(_PREC_RING, prec="merge_lowp"), "merge_lowp",
        "the ring merges partial outputs and LSEs in the input dtype"),
    ("ring", "dkv_lowp"): (
        dict(_PREC_RING, prec="dkv_lowp"), "dkv_lowp",
        "dK/dV accumulated over the ring steps in the input dtype"),
    ("ring", "rescale_missing_step1"): (
        dict(_PREC_RING, prec="rescale_missing_step1"), "rescale_missing_step1",
        "ring step 1 adds its partial output without rescaling the accumulated one"),
    ("ulysses", "exp_nomax_lowp"): (
        dict(U=2, S=2048, docs=[2048], D=32, qmul=2.5, prec="exp_nomax_lowp"), "exp_nomax_lowp",
        "softmax as exp(s) / sum exp(s) in the input dtype, the row max not subtracted "
        "(float16 overflows on long documents)"),
}
VARIANTS.update(PRECISION)

# Real fused kernels (sdpa_attend): torch SDPA with one backend forced, Ulysses jobs at the
# catalogue's shape, two larger ones, 8× sharper scores and one 8K document. "emulate"
# (sp_jobs' own attend through the same per-document path, on the CPU) runs anywhere; the
# others need torch >= 2.3 and a CUDA device.
_SDPA_SHAPES = {
    "": dict(_PREC_ULY),
    "_d64": dict(U=2, S=2048, H=8, Hkv=8, D=64, docs=[2048]),
    "_d128": dict(U=4, S=4096, H=16, Hkv=4, D=128, docs=[1024, 3072]),
    "_bigq": dict(_PREC_ULY, qmul=8.0),  # scores ~8× larger: a sharper, saturating softmax
    "_long": dict(U=2, S=8192, H=8, Hkv=2, D=128, docs=[8192]),
}
SDPA = {}
for _k in SDPA_KERNELS:
    for _suffix, _shape in _SDPA_SHAPES.items():
        if _k == "emulate" and _suffix:
            continue
        # TF32 in a float32 job is a precision bug (10-bit mantissas where float32 was asked).
        SDPA[("ulysses", "sdpa_%s%s" % (_k.replace("+", "_"), _suffix))] = (
            dict(_shape, kernel=_k), "tf32_matmul" if _k == "math+tf32" else None,
            "torch SDPA, %s backend%s, per document" % (
                _k.replace("+tf32", " with TF32 matrix products (allow_tf32) in a float32 job"),
                " (sp_jobs' attend on the CPU)" if _k == "emulate" else " on the GPU"))
VARIANTS.update(SDPA)

STANDARD = [
    ("ulysses", "healthy_u2", "f32"),
    ("ulysses", "healthy_u4", "f32"),
    ("ulysses", "healthy_u4", "bf16"),
    ("ring", "healthy_r2", "f32"),
    ("ring", "healthy_r4", "bf16"),
    ("hybrid", "healthy_u2r2", "f32"),
    ("hybrid", "healthy_u2r2", "bf16"),
    ("ulysses", "no_kv_repeat", "f32"),
    ("ulysses", "blockwise_repeat", "f32"),
    ("ulysses", "a2a_wrong_dims", "f32"),
    ("ring", "local_cu", "f32"),
    ("ring", "zigzag_swapped", "f32"),
    ("ulysses", "causal_hides_diag", "f32"),
    ("ulysses", "scale_inv_d_one_rank", "f32"),
    ("ulysses", "last_token_own_doc", "f32"),
    ("ring", "kv_grad_not_reduced", "f32"),
    ("ring", "scale_padded_d", "f32"),
    ("ring", "docmask_own_block", "f32"),
    ("ring", "bwd_docmask_own_block", "f32"),
    ("ring", "dq_other_blocks_unscaled", "f32"),
    ("ring", "dkv_last_hop_wrong_way", "f32"),
    ("ulysses", "no_scale", "f32"),
    ("ring", "lse_merge_no_max", "bf16"),
    ("ring", "ring_src_off_by_one", "f32"),
    ("ring", "ring_src_off_by_minus_one", "f32"),
    ("ring", "ring_src_off_by_two", "f32"),
    ("ring", "ring_src_off_by_minus_two", "f32"),
    ("ring", "zigzag_halves_swapped", "f32"),
    ("ulysses", "kv_grad_not_summed", "f32"),
    ("ulysses", "no_causal", "f32"),
]

EXPECTED_CRASH = {"no_kv_repeat"}

# The ring source off by k: sections chosen for (r - i + k) mod R.
SOURCE_SHIFT = {"ring_src_off_by_one": 1, "ring_src_off_by_minus_one": -1,
                "ring_src_off_by_two": 2, "ring_src_off_by_minus_two": -2}


def make_cfg(job, variant, dtype, seed=0):
    if (job, variant) not in VARIANTS:
        raise SystemExit("unknown job/variant %s/%s (see --list)" % (job, variant))
    over, bug, cause = VARIANTS[(job, variant)]
    cfg = dict(_SHAPES[job])
    cfg.update(qmul=1.0, prec=None, kernel=None)
    cfg.update(over)
    cfg.update(job=job, variant=variant, dtype=dtype, seed=int(seed), bug=bug, cause=cause)
    if cfg["qmul"] == "lowp":
        cfg["qmul"] = lowp_qmul(dtype)
    for L in cfg["docs"]:
        if L % (2 * cfg["R"]):
            raise SystemExit("document length %d not divisible by 2R" % L)
    cfg["cu"] = [0]
    for L in cfg["docs"]:
        cfg["cu"].append(cfg["cu"][-1] + L)
    assert cfg["cu"][-1] == cfg["S"]
    return cfg


def job_string(cfg):
    return "sp_jobs.py --job %s --variant %s --dtype %s --seed %d" % (
        cfg["job"], cfg["variant"], cfg["dtype"], cfg["seed"])


def parse_job_string(s):
    toks = s.split()
    if not toks or toks[0] != "sp_jobs.py":
        return None
    kv = dict(zip(toks[1::2], toks[2::2]))
    return make_cfg(kv["--job"], kv["--variant"], kv["--dtype"], int(kv.get("--seed", 0)))


# ----------------------------------------------------------------------------- layout

def global_positions(cu, S):
    pos = [0] * S
    for a, b in zip(cu[:-1], cu[1:]):
        for t in range(a, b):
            pos[t] = t - a
    return pos


def ring_tokens(cu, R, r, swapped=False):
    """Global token indices of ring rank r (zigzag): per document chunk r then chunk 2R-1-r."""
    idx = []
    for a, b in zip(cu[:-1], cu[1:]):
        c = (b - a) // (2 * R)
        early = list(range(a + r * c, a + (r + 1) * c))
        late = list(range(a + (2 * R - 1 - r) * c, a + (2 * R - r) * c))
        idx += (late + early) if swapped else (early + late)
    return idx


def shard_tokens(cfg, ring_rank, ulysses_rank, swapped=False):
    toks = ring_tokens(cfg["cu"], cfg["R"], ring_rank, swapped)
    p = len(toks) // cfg["U"]
    return toks[ulysses_rank * p:(ulysses_rank + 1) * p]


# ----------------------------------------------------------------------------- masks / kernel

def doc_table(cu, n):
    cu_t = torch.tensor(cu, dtype=torch.long)
    ids = torch.arange(n)
    doc = torch.searchsorted(cu_t[1:], ids, right=True)
    start, end = cu_t[doc], cu_t[doc + 1]
    return doc, (start + end) // 2


def section_mask(kind, cu, n, causal=True):
    """[n, n] bool: which local q row may see which KV row of the block, per section kind.
    diag: causal inside local documents; lower: every q row sees the early half of its
    document's KV rows; upper: the late half of each document's q rows sees all its KV rows."""
    doc, mid = doc_table(cu, n)
    i = torch.arange(n)
    same = doc[:, None] == doc[None, :]
    if kind == "diag":
        return same & (i[None, :] <= i[:, None]) if causal else same
    if kind == "lower":
        return same & (i < mid)[None, :]
    if kind == "upper":
        return same & (i >= mid)[:, None]
    raise ValueError(kind)


def step_mask(plan, i, n, backward=False):
    """The mask of ring step i: section_mask, or (docmask_own_block; bwd_docmask_own_block in
    the backward only, the forward right) the document mask only on the diagonal block: other
    blocks' sections without document boundaries."""
    if plan.bug == "zigzag_halves_swapped" and plan.sections[i] != "diag":
        # BROKEN: each local document taken as [late | early]: the halves' roles swapped.
        doc, mid = doc_table(plan.cu, n)
        rows = torch.arange(n)
        same = doc[:, None] == doc[None, :]
        if plan.sections[i] == "lower":
            return same & (rows >= mid)[None, :]
        return same & (rows < mid)[:, None]
    own_block = plan.bug == "docmask_own_block" or (
        backward and plan.bug == "bwd_docmask_own_block")
    if not own_block or i == 0:
        return section_mask(plan.sections[i], plan.cu, n)
    _, mid = doc_table(plan.cu, n)
    rows = torch.arange(n)
    if plan.sections[i] == "lower":
        return (rows < mid)[None, :].expand(n, n)
    return (rows >= mid)[:, None].expand(n, n)


def _cdt(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mm(eq, a, b):
    """einsum; in float16/bfloat16 as the CPU's low-precision GEMM computes it (products summed
    in float32, the result rounded once to the input dtype), written out so that a job means the
    same under every torch (torch 2.1's CPU has no float16 GEMM)."""
    if a.dtype in (torch.float16, torch.bfloat16):
        return torch.einsum(eq, a.float(), b.float()).to(a.dtype)
    return torch.einsum(eq, a, b)


def attend(q, k, v, mask, scale, prec=None):
    """Masked softmax attention; q [n,h,D], k/v [m,hk,D] (GQA: q head i uses KV head
    i // (h/hk)). Accumulates in float32 like the fused kernels; returns out [n,h,D] in q's dtype
    and lse [h,n] in float32 (-inf, out 0 on rows that see nothing). Differentiable.
    prec "blocked": an online softmax over blocks of 16 keys (float32); "scores_lowp": scores
    and softmax in q's own dtype (a precision bug)."""
    if prec == "blocked":
        return _attend_blocked(q, k, v, mask, scale)
    if prec == "exp_nomax_lowp":
        return _attend_exp_nomax(q, k, v, mask, scale)
    cdt = q.dtype if prec == "scores_lowp" else _cdt(q.dtype)
    qf, kf, vf = q.to(cdt), k.to(cdt), v.to(cdt)
    h, hk = qf.shape[1], kf.shape[1]
    if h != hk:
        kf = kf.repeat_interleave(h // hk, dim=1)
        vf = vf.repeat_interleave(h // hk, dim=1)
    s = _mm("nhd,mhd->hnm", qf, kf) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))
    if prec == "p_lowp_gemm":  # P enters the P·V product in the input dtype
        p = p.to(q.dtype).to(cdt)
    out = _mm("hnm,mhd->nhd", p, vf)
    return out.to(q.dtype), lse.to(torch.float32)


def _attend_exp_nomax(q, k, v, mask, scale):
    """BROKEN (exp_nomax_lowp): softmax as exp(s) / sum exp(s) in q's own dtype, the row max not
    subtracted: the sum overflows float16 (65504) on long documents or large scores."""
    dt = q.dtype
    h, hk = q.shape[1], k.shape[1]
    kf, vf = k, v
    if h != hk:
        kf = k.repeat_interleave(h // hk, dim=1)
        vf = v.repeat_interleave(h // hk, dim=1)
    s = (_mm("nhd,mhd->hnm", q, kf) * scale).to(dt)
    p = torch.exp(s.masked_fill(~mask, float("-inf")))
    den = p.sum(-1)
    out = _mm("hnm,mhd->nhd", p, vf) / den.transpose(0, 1).unsqueeze(-1)
    return out.to(dt), torch.log(den).to(torch.float32)


def _attend_blocked(q, k, v, mask, scale, block=16):
    """attend's result by an online softmax over key blocks (running max, rescaled sums), in
    float32: the order a flash-style kernel adds in."""
    cdt = _cdt(q.dtype)
    qf, kf, vf = q.to(cdt), k.to(cdt), v.to(cdt)
    h, hk = qf.shape[1], kf.shape[1]
    if h != hk:
        kf = kf.repeat_interleave(h // hk, dim=1)
        vf = vf.repeat_interleave(h // hk, dim=1)
    n, m = qf.shape[0], kf.shape[0]
    run_max = torch.full((h, n), float("-inf"), dtype=cdt)
    run_sum = torch.zeros((h, n), dtype=cdt)
    acc = torch.zeros((h, n, qf.shape[2]), dtype=cdt)
    for b0 in range(0, m, block):
        b1 = min(m, b0 + block)
        s = torch.einsum("nhd,mhd->hnm", qf, kf[b0:b1]) * scale
        s = s.masked_fill(~mask[:, b0:b1], float("-inf"))
        new_max = torch.maximum(run_max, s.max(-1).values)
        safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(s - safe.unsqueeze(-1))
        alpha = torch.exp(torch.where(torch.isinf(run_max), torch.full_like(run_max, -1e30),
                                      run_max) - safe)
        run_sum = run_sum * alpha + p.sum(-1)
        acc = acc * alpha.unsqueeze(-1) + torch.einsum("hnm,mhd->hnd", p, vf[b0:b1])
        run_max = new_max
    seen = run_sum > 0
    out = torch.where(seen.unsqueeze(-1), acc / run_sum.clamp_min(1e-300).unsqueeze(-1),
                      torch.zeros_like(acc))
    lse = torch.where(seen, torch.log(run_sum.clamp_min(1e-300)) + torch.where(
        torch.isinf(run_max), torch.zeros_like(run_max), run_max), torch.full_like(run_sum, float("-inf")))
    return out.transpose(0, 1).to(q.dtype), lse.to(torch.float32)


# ----------------------------------------------------------------------------- torch's SDPA kernels

def _kernel_lse(name, q, k, v, scale):
    """The kernel's own log-sum-exp [1, h, L] (float32) for one causal document, from the
    backend's aten entry point (a second forward of the same kernel); None where the backend
    returns none (math) or its entry point is not there."""
    h, hk = q.shape[1], k.shape[1]
    if h != hk:
        k, v = k.repeat_interleave(h // hk, dim=1), v.repeat_interleave(h // hk, dim=1)
    L = q.shape[2]
    aten = torch.ops.aten
    with torch.no_grad():
        if name == "flash":
            r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        elif name == "efficient":
            r = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True,
                                                             scale=scale)
        elif name == "cudnn":
            r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False,
                                                         scale=scale)
        else:
            return None
    lse = r[1]
    return lse.reshape(lse.shape[0], lse.shape[1], -1)[..., :L].float()


def sdpa_attend(q, k, v, cu, scale, kernel):
    """Causal attention per document of cu through one SDPA backend on the GPU. q [n,h,D],
    k/v [n,hk,D] on the CPU (differentiable); returns out [n,h,D] on the CPU in q's dtype, the
    kernel's lse [h,n] (float32, None where the backend gives none) and what ran (a dict)."""
    name = kernel
    info = {"kernel": kernel, "torch": torch.__version__}
    if name == "emulate":
        dev = torch.device("cpu")
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH,
                   "math+tf32": SDPBackend.MATH}[name]
        dev = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = name == "math+tf32"
        info["device"] = torch.cuda.get_device_name(0)
    h, hk = q.shape[1], k.shape[1]
    qd, kd, vd = (t.to(dev).transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, n, D]
    outs, lses = [], []
    gqa = "none" if h == hk else ("repeat_interleave" if name == "emulate" else "native")
    for a, b in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (t[:, :, a:b].contiguous() for t in (qd, kd, vd))
        if name == "emulate":
            mask = torch.tril(torch.ones(b - a, b - a, dtype=torch.bool))
            o, l = attend(qs[0].transpose(0, 1), ks[0].transpose(0, 1), vs[0].transpose(0, 1),
                          mask, scale)
            outs.append(o.transpose(0, 1).unsqueeze(0))
            lses.append(l.unsqueeze(0))
            continue
        with sdpa_kernel([backend]):
            o = None
            if gqa == "native":
                try:
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                       enable_gqa=True)
                except RuntimeError:
                    gqa = "repeat_interleave"  # this backend has no GQA: KV heads repeated
            if o is None:
                kr, vr = ks, vs
                if h != hk:
                    kr = ks.repeat_interleave(h // hk, dim=1)
                    vr = vs.repeat_interleave(h // hk, dim=1)
                o = F.scaled_dot_product_attention(qs, kr, vr, is_causal=True, scale=scale)
        outs.append(o)
        try:
            lses.append(_kernel_lse(name, qs.detach(), ks.detach(), vs.detach(), scale))
        except (RuntimeError, AttributeError, TypeError) as e:
            info["lse_error"] = str(e).strip().splitlines()[0][:200] if str(e).strip() else repr(e)
            lses.append(None)
    info["gqa"] = gqa
    out = torch.cat(outs, dim=2)[0].transpose(0, 1).to("cpu")
    lse = None
    if all(x is not None for x in lses):
        lse = torch.cat(lses, dim=2)[0].to("cpu").float()
    info["lse"] = lse is not None
    return out.to(q.dtype), lse, info


# ----------------------------------------------------------------------------- collectives

def _wire(t):
    # gloo has no bfloat16: move the bits as float16 (same size; all-to-all does no arithmetic).
    return t.view(torch.float16) if t.dtype == torch.bfloat16 else t


def _a2a(send, group):
    recv = torch.empty_like(send)
    dist.all_to_all_single(_wire(recv), _wire(send), group=group)
    return recv


def seq_to_head(x, U, group):
    """[s, Hh, D] -> [U*s, Hh/U, D]: scatter heads, gather sequence (Ulysses rank order)."""
    s, hh, d = x.shape
    send = x.reshape(s, U, hh // U, d).transpose(0, 1).contiguous()  # head-major blocks
    return _a2a(send, group).reshape(U * s, hh // U, d)


def head_to_seq(y, U, group):
    """[U*s, h, D] -> [s, U*h, D]: the inverse of seq_to_head."""
    n, h, d = y.shape
    s = n // U
    recv = _a2a(y.reshape(U, s, h, d).contiguous(), group)
    return recv.transpose(0, 1).reshape(s, U * h, d)


class SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, U, group):
        ctx.U, ctx.group = U, group
        return seq_to_head(x.contiguous(), U, group)

    @staticmethod
    def backward(ctx, g):
        return head_to_seq(g.contiguous(), ctx.U, ctx.group), None, None


class HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, U, group):
        ctx.U, ctx.group = U, group
        return head_to_seq(y.contiguous(), U, group)

    @staticmethod
    def backward(ctx, g):
        return seq_to_head(g.contiguous(), ctx.U, ctx.group), None, None


class TokenMajorA2A(torch.autograd.Function):
    """BROKEN (a2a_wrong_dims): all_to_all_single straight on the [s, H, D] buffer, i.e. the
    sequence is split, then the result is viewed as [U*s, H/U, D]."""

    @staticmethod
    def forward(ctx, x, U, group):
        ctx.U, ctx.group, ctx.shape = U, group, x.shape
        s, hh, d = x.shape
        return _a2a(x.contiguous(), group).reshape(U * s, hh // U, d)

    @staticmethod
    def backward(ctx, g):
        return _a2a(g.contiguous(), ctx.group).reshape(ctx.shape), None, None


class RepeatKeepFirstGrad(torch.autograd.Function):
    """BROKEN (kv_grad_not_summed): repeat_interleave whose backward keeps copy 0's gradient."""

    @staticmethod
    def forward(ctx, x, rep):
        ctx.rep = rep
        return x.repeat_interleave(rep, dim=1)

    @staticmethod
    def backward(ctx, g):
        s, hr, d = g.shape
        return g.reshape(s, hr // ctx.rep, ctx.rep, d)[:, :, 0].contiguous(), None


# ----------------------------------------------------------------------------- ring attention

class RingPlan(object):
    def __init__(self, group, ranks, r, cu_local, scale, sections, merge="softplus",
                 lowp=torch.bfloat16, prec=None, dtype=torch.float32):
        self.group = group        # the ring process group
        self.ranks = ranks        # global ranks of the ring group, in ring-rank order
        self.R = len(ranks)
        self.r = r
        self.cu = cu_local        # the local cu_seqlens this rank uses
        self.scale = scale
        self.sections = sections  # kind per step ("diag", "lower", "upper")
        self.merge = merge
        self.lowp = lowp
        self.prec = prec          # precision variant (see PRECISION)
        self.no_kv_reduce = False  # the kv_grad_not_reduced bug: K/V gradients kept unreduced
        self.bug = None            # the other ring bugs (docmask_own_block, dq_other_blocks_…)
        self.dtype = dtype        # the job's input dtype


def _merge_softplus(o_acc, l_acc, o_new, l_new):
    d = l_new - l_acc
    w_acc = torch.exp(-F.softplus(d)).transpose(0, 1).unsqueeze(-1)
    w_new = torch.exp(-F.softplus(-d)).transpose(0, 1).unsqueeze(-1)
    return o_acc * w_acc + o_new * w_new, l_acc + F.softplus(d)


# Correct ring merges in other orders than step by step (issue 37's healthy side).
MERGE_ORDERS = ("merge_reverse", "merge_shuffled", "merge_tree")


def _merge_pair(a, b):
    """Two partial results (out [n,h,D], lse [h,n], rows that saw keys) merged exactly."""
    (oa, la, ra), (ob, lb, rb) = a, b
    both, only_b = ra & rb, rb & ~ra
    o, l = oa.clone(), la.clone()
    if both.any():
        o[both], l[:, both] = _merge_softplus(oa[both], la[:, both], ob[both], lb[:, both])
    o[only_b], l[:, only_b] = ob[only_b], lb[:, only_b]
    return o, l, ra | rb


def _merge_in_order(parts, order):
    """The ring's partials (one per step) merged from the last step to the first, in a shuffled
    step order, or pairwise as a tree."""
    if order == "merge_tree":
        while len(parts) > 1:
            parts = [_merge_pair(parts[i], parts[i + 1]) if i + 1 < len(parts) else parts[i]
                     for i in range(0, len(parts), 2)]
        return parts[0]
    if order == "merge_reverse":
        idx = list(reversed(range(len(parts))))
    else:  # merge_shuffled: a fixed permutation that is neither forward nor reverse
        idx = [2, 0, 3, 1] if len(parts) == 4 else [i for i in range(1, len(parts), 2)] + [
            i for i in range(0, len(parts), 2)]
    acc = parts[idx[0]]
    for i in idx[1:]:
        acc = _merge_pair(acc, parts[i])
    return acc


def _merge_no_max(o_acc, l_acc, o_new, l_new, lowp):
    # BROKEN (lse_merge_no_max): exp(lse) straight in the low precision.
    oa, la, ob, lb = (t.to(lowp) for t in (o_acc, l_acc, o_new, l_new))
    ea, eb = torch.exp(la), torch.exp(lb)
    tot = ea + eb
    out = (ea.transpose(0, 1).unsqueeze(-1) * oa + eb.transpose(0, 1).unsqueeze(-1) * ob) \
        / tot.transpose(0, 1).unsqueeze(-1)
    return out.to(o_acc.dtype), torch.log(tot).to(l_acc.dtype)


def _exchange(buf, plan):
    """Sends buf to ring rank r+1 and receives the buffer of ring rank r-1."""
    nxt = plan.ranks[(plan.r + 1) % plan.R]
    prv = plan.ranks[(plan.r - 1) % plan.R]
    recv = torch.empty_like(buf)
    reqs = [dist.isend(buf, nxt, group=plan.group), dist.irecv(recv, prv, group=plan.group)]
    return recv, reqs


class RingAttn(torch.autograd.Function):
    """Zigzag ring attention over plan.group; returns out [n,h,D] (q's dtype), lse [h,n] f32."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        cdt = _cdt(q.dtype)
        qf = q.to(cdt)
        n = qf.shape[0]
        kv = torch.stack([k.to(cdt), v.to(cdt)]).contiguous()
        o_acc = l_acc = None
        parts = []
        # Variants whose kernel takes its inputs in the job's dtype (rounds inside to it).
        lowp_in = plan.prec in ("scores_lowp", "p_lowp_gemm")
        for i in range(plan.R):
            reqs = []
            if i + 1 < plan.R:
                nxt_kv, reqs = _exchange(kv, plan)
            mask = step_mask(plan, i, n)
            if lowp_in:
                o, l = attend(qf.to(plan.dtype), kv[0].to(plan.dtype), kv[1].to(plan.dtype), mask,
                              plan.scale, plan.prec)
                o = o.to(cdt)
            else:
                o, l = attend(qf, kv[0], kv[1], mask, plan.scale,
                              "blocked" if plan.prec == "blocked" else None)
            if plan.prec in MERGE_ORDERS:
                parts.append((o, l, mask.any(dim=1)))
            elif o_acc is None:
                o_acc, l_acc = o, l
            else:
                rows = mask.any(dim=1)
                if plan.prec == "merge_lowp":
                    lo = plan.dtype
                    mo, ml = _merge_softplus(o_acc[rows].to(lo), l_acc[:, rows].to(lo),
                                             o[rows].to(lo), l[:, rows].to(lo))
                    mo, ml = mo.to(cdt), ml.to(cdt)
                elif plan.prec == "rescale_missing_step1" and i == 1:
                    d = l[:, rows] - l_acc[:, rows]
                    w_new = torch.exp(-F.softplus(-d)).transpose(0, 1).unsqueeze(-1)
                    mo, ml = o_acc[rows] + o[rows] * w_new, l_acc[:, rows] + F.softplus(d)
                elif plan.merge == "softplus":
                    mo, ml = _merge_softplus(o_acc[rows], l_acc[:, rows], o[rows], l[:, rows])
                else:
                    mo, ml = _merge_no_max(o_acc[rows], l_acc[:, rows], o[rows], l[:, rows],
                                           plan.lowp)
                o_acc, l_acc = o_acc.clone(), l_acc.clone()
                o_acc[rows], l_acc[:, rows] = mo, ml
            for w in reqs:
                w.wait()
            if reqs:
                kv = nxt_kv
        if parts:  # the same partials, merged in another order (MERGE_ORDERS)
            o_acc, l_acc, _ = _merge_in_order(parts, plan.prec)
        ctx.plan = plan
        saved_lse = l_acc.to(plan.dtype).to(l_acc.dtype) if plan.prec == "lse_lowp" else l_acc
        ctx.save_for_backward(q, k, v, o_acc, saved_lse)
        lse = l_acc.to(torch.float32)
        ctx.mark_non_differentiable(lse)
        return o_acc.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        plan = ctx.plan
        q, k, v, out, lse = ctx.saved_tensors
        cdt = _cdt(q.dtype)
        qf, do = q.to(cdt), dout.to(cdt)
        n, h, d = qf.shape
        hk = k.shape[1]
        g = h // hk
        kf, vf = k.to(cdt).contiguous(), v.to(cdt).contiguous()
        k_all = [torch.empty_like(kf) for _ in range(plan.R)]
        v_all = [torch.empty_like(vf) for _ in range(plan.R)]
        dist.all_gather(k_all, kf, group=plan.group)
        dist.all_gather(v_all, vf, group=plan.group)
        drow = (do * out).sum(-1).transpose(0, 1)  # [h, n]
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        dq = torch.zeros_like(qf)
        acc_dt = plan.dtype if plan.prec == "dkv_lowp" else cdt
        dk_all = torch.zeros((plan.R,) + tuple(kf.shape), dtype=acc_dt)
        dv_all = torch.zeros_like(dk_all)
        for i in range(plan.R):
            src = (plan.r - i) % plan.R
            mask = step_mask(plan, i, n, backward=True)
            kk = k_all[src].repeat_interleave(g, dim=1)
            vv = v_all[src].repeat_interleave(g, dim=1)
            s = torch.einsum("nhd,mhd->hnm", qf, kk) * plan.scale
            p = torch.exp(s.masked_fill(~mask, float("-inf")) - safe.unsqueeze(-1))
            lowp = (lambda t: t.to(plan.dtype).to(cdt)) if plan.prec == "p_lowp_gemm" else (
                lambda t: t)
            dv = torch.einsum("hnm,nhd->mhd", lowp(p), do)
            dp = torch.einsum("nhd,mhd->hnm", do, vv)
            ds = lowp(p * (dp - drow.unsqueeze(-1)))
            # BROKEN (dq_other_blocks_unscaled): other ranks' blocks without the scale.
            dq_scale = 1.0 if plan.bug == "dq_other_blocks_unscaled" and i > 0 else plan.scale
            dq += dq_scale * torch.einsum("hnm,mhd->nhd", ds, kk)
            dk = plan.scale * torch.einsum("hnm,nhd->mhd", ds, qf)
            dk_all[src] += dk.reshape(n, hk, g, d).sum(2).to(acc_dt)
            dv_all[src] += dv.reshape(n, hk, g, d).sum(2).to(acc_dt)
        if acc_dt != cdt:  # gloo sums in float32; the low-precision accumulation happened above
            dk_all, dv_all = dk_all.to(cdt), dv_all.to(cdt)
        # gloo has no reduce_scatter: all-reduce (SUM) and keep the own shard (the
        # kv_grad_not_reduced bug keeps its own queries' part only).
        if not plan.no_kv_reduce:
            dist.all_reduce(dk_all, group=plan.group)
            dist.all_reduce(dv_all, group=plan.group)
        # A P2P backward passes each block's dK/dV accumulator along the ring (+1 per step) and
        # after R-1 hops sends it home; BROKEN (dkv_last_hop_wrong_way): that last hop goes to
        # r-1, so rank r receives the accumulator of block r+2.
        own = (plan.r + 2) % plan.R if plan.bug == "dkv_last_hop_wrong_way" else plan.r
        return (dq.to(q.dtype), dk_all[own].to(k.dtype), dv_all[own].to(v.dtype), None)


# ----------------------------------------------------------------------------- one job

def global_inputs(cfg):
    dt = DTYPES[cfg["dtype"]]
    g = torch.Generator().manual_seed(1000 + cfg["seed"])
    S, H, Hkv, D = cfg["S"], cfg["H"], cfg["Hkv"], cfg["D"]
    q = torch.randn(S, H, D, generator=g) * cfg["qmul"]
    k = torch.randn(S, Hkv, D, generator=g)
    v = torch.randn(S, Hkv, D, generator=g)
    w = torch.randn(S, H, D, generator=g)
    return q.to(dt), k.to(dt), v.to(dt), w.to(dt)


def _local_cu_from_positions(pos):
    n = len(pos)
    cuts = sorted(set([0, n] + [i for i, p in enumerate(pos) if p == 0]))
    return cuts


def _wait_for_calls(out_dir, world, deadline=120.0):
    """Until every rank's meta lists its first call (its forward file written), or deadline."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        done = 0
        for r in range(world):
            try:
                with open(os.path.join(out_dir, "rank%d.json" % r)) as f:
                    done += bool(json.load(f).get("calls"))
            except (OSError, ValueError):
                pass
        if done == world:
            return
        time.sleep(0.02)



def _worker(rank, cfg, out_dir, port):
    torch.set_num_threads(1)
    U, R = cfg["U"], cfg["R"]
    world = U * R
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world)
    bug = cfg["bug"]
    H, Hkv, D = cfg["H"], cfg["Hkv"], cfg["D"]
    ring_rank, urank = rank // U, rank % U
    ugroups = [dist.new_group(list(range(rr * U, rr * U + U))) for rr in range(R)] if U > 1 else []
    rgroups = [dist.new_group([u + U * j for j in range(R)]) for u in range(U)] if R > 1 else []
    ug = ugroups[ring_rank] if U > 1 else None

    Q, K, V, W = global_inputs(cfg)
    idx = shard_tokens(cfg, ring_rank, urank, swapped=(bug == "zigzag_swapped"))
    gpos = global_positions(cfg["cu"], cfg["S"])
    pos = [gpos[t] for t in idx]
    it = torch.tensor(idx, dtype=torch.long)
    q = Q[it].clone().requires_grad_(True)
    k = K[it].clone().requires_grad_(True)
    v = V[it].clone().requires_grad_(True)
    w = W[it].clone()

    scale = 1.0 / math.sqrt(D)
    scale_used = 1.0 if bug == "no_scale" else scale
    if bug == "scale_padded_d":  # BROKEN: the scale of head_dim padded to a multiple of 8
        scale_used = 1.0 / math.sqrt(8 * math.ceil(D / 8))
    dumper = seqpar_dump.Dumper(
        out_dir, ulysses=U, ring=R, ulysses_rank=urank, ring_rank=ring_rank, heads=H,
        kv_heads=Hkv, head_dim=D, scale=scale, causal=True, cu_seqlens=cfg["cu"],
        position_ids=pos, ring_layout="zigzag", dtype=DTYPES[cfg["dtype"]], job=job_string(cfg))

    def make_plan():
        rr = ring_rank
        if bug == "local_cu":
            cu_local = _local_cu_from_positions(pos)
        else:
            cu_local = [c // R for c in cfg["cu"]]
        sections = []
        for i in range(R):
            src = (rr - i + SOURCE_SHIFT.get(bug, 0)) % R
            sections.append("diag" if i == 0 else ("lower" if src < rr else "upper"))
        plan = RingPlan(rgroups[urank], [urank + U * j for j in range(R)], rr, cu_local,
                        scale_used, sections,
                        merge="no_max" if bug == "lse_merge_no_max" else "softplus",
                        lowp=DTYPES[cfg["dtype"] if cfg["dtype"] in ("bf16", "f16") else "bf16"], prec=cfg["prec"], dtype=DTYPES[cfg["dtype"]])
        plan.no_kv_reduce = bug == "kv_grad_not_reduced"
        plan.bug = bug
        return plan

    try:
        with dumper.call(name="L0.attn"):
            dumper.tap("q.local", q)
            dumper.tap("k.local", k)
            dumper.tap("v.local", v)
            if U > 1:
                kr, vr = k, v
                if U > Hkv and bug != "no_kv_repeat":
                    rep = U // Hkv
                    if bug == "blockwise_repeat":
                        kr, vr = k.repeat(1, rep, 1), v.repeat(1, rep, 1)
                    elif bug == "kv_grad_not_summed":
                        kr, vr = RepeatKeepFirstGrad.apply(k, rep), RepeatKeepFirstGrad.apply(v, rep)
                    else:
                        kr, vr = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
                    dumper.tap("k.repeated", kr)
                    dumper.tap("v.repeated", vr)
                if bug == "no_kv_repeat":
                    # fewer KV heads than ranks: split the flattened head dims U ways instead
                    s = kr.shape[0]
                    kr, vr = kr.reshape(s, U, -1), vr.reshape(s, U, -1)
                a2a = TokenMajorA2A.apply if bug == "a2a_wrong_dims" else SeqToHead.apply
                qg = dumper.tap("q.gathered", a2a(q, U, ug))
                kg = dumper.tap("k.gathered", a2a(kr, U, ug))
                vg = dumper.tap("v.gathered", a2a(vr, U, ug))
                if R == 1:
                    cu_used = cfg["cu"]
                    if bug == "last_token_own_doc":
                        cu_used = sorted(set(cu_used) | {c - 1 for c in cu_used[1:]})
                    mask = section_mask("diag", cu_used, qg.shape[0], causal=(bug != "no_causal"))
                    if bug == "causal_hides_diag":
                        mask = mask & ~torch.eye(qg.shape[0], dtype=torch.bool)
                    s_used = scale_used
                    if bug == "scale_inv_d_one_rank" and urank == 1:
                        s_used = 1.0 / D
                    if cfg["kernel"]:
                        out_attn, lse, info = sdpa_attend(qg, kg, vg, cu_used, s_used, cfg["kernel"])
                        if rank == 0:
                            with open(os.path.join(out_dir, "kernel.json"), "w") as f:
                                json.dump(info, f)
                    else:
                        out_attn, lse = attend(qg, kg, vg, mask, s_used, cfg["prec"])
                else:
                    out_attn, lse = RingAttn.apply(qg, kg, vg, make_plan())
                dumper.tap("out.attn", out_attn)
                if lse is not None:
                    dumper.tap("lse", lse, layout="hs")
                out = HeadToSeq.apply(out_attn, U, ug)
            else:
                out, lse = RingAttn.apply(q, k, v, make_plan())
                dumper.tap("lse", lse, layout="hs")
            dumper.tap("out.local", out)
    except Exception:
        # This rank's call raised (the expected crash of no_kv_repeat); call() wrote its forward
        # file on the way out. The launcher stops every other rank as soon as one fails: first
        # wait until every rank's call is on disk, so that a slower rank is never stopped in the
        # middle of its call (beside a load one was, and the dump held no complete call).
        _wait_for_calls(out_dir, world)
        raise
    loss = (out * w).sum()
    loss.backward()
    dumper.close()
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _clear_dump_dir(out):
    if not os.path.isdir(out):
        return
    for name in os.listdir(out):
        p = os.path.join(out, name)
        if name.startswith("rank") and os.path.isdir(p):
            shutil.rmtree(p)
        elif name.startswith("rank") and name.endswith(".json") or name.startswith(".seqpar-tmp-"):
            os.unlink(p)


def run_job(cfg, out, quiet=False):
    """Runs one job into out; True when every rank finished."""
    os.makedirs(out, exist_ok=True)
    _clear_dump_dir(out)
    try:
        # Forked, not spawned, from the main thread: the ranks start with torch already
        # imported (3 CPU-seconds a process otherwise). The parent runs no parallel torch work
        # (one thread, set at import above), so no OpenMP pool is forked in use. (A process
        # forked from another thread exits 1 in multiprocessing's teardown: spawned there.)
        main = threading.current_thread() is threading.main_thread()
        mp.start_processes(_worker, args=(cfg, out, _free_port()), nprocs=cfg["U"] * cfg["R"],
                           join=True, start_method="fork" if main else "spawn")
        return True
    except Exception as e:  # a rank raised (expected for no_kv_repeat)
        if not quiet:
            msg = str(e).strip().splitlines()
            sys.stderr.write("job %s failed: %s\n" % (job_string(cfg), msg[-1] if msg else e))
        return False


# ----------------------------------------------------------------------------- reading dumps

def load_dump(d):
    """{rank: {"meta": meta, "t": {stage: tensor}}} of call 0 of every rank in dump dir d."""
    ranks = {}
    for name in sorted(os.listdir(d)):
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        with open(os.path.join(d, name)) as f:
            meta = json.load(f)
        tensors = {}
        for c in meta.get("calls", [])[:1]:
            for key in ("forward", "backward"):
                if key in c:
                    tensors.update(seqpar_dump.read_safetensors(os.path.join(d, c[key])))
        ranks[meta["rank"]] = {"meta": meta, "t": tensors}
    return ranks


ORDER = ["layout", "q.local", "k.local", "v.local", "k.repeated", "v.repeated", "q.gathered",
         "k.gathered", "v.gathered", "out.attn", "lse", "out.local", "grad.out.local",
         "grad.out.attn", "grad.q.gathered", "grad.k.gathered", "grad.v.gathered",
         "grad.k.repeated", "grad.v.repeated", "grad.q.local", "grad.k.local", "grad.v.local"]


# Stages the format marks optional (a job may or may not tap them).
OPTIONAL = {"k.repeated", "v.repeated", "grad.k.repeated", "grad.v.repeated", "lse"}


def _tensor_differs(a, b):
    if a is None or b is None:
        return (a is None) != (b is None)
    if tuple(a.shape) != tuple(b.shape):
        return True
    a64, b64 = a.double(), b.double()
    na, nb = torch.isnan(a64), torch.isnan(b64)
    if not torch.equal(na, nb):
        return True
    ia, ib = torch.isinf(a64), torch.isinf(b64)
    if not torch.equal(ia, ib) or not torch.equal(a64[ia], b64[ib]):
        return True
    fin = ~(na | ia)
    if not fin.any():
        return False
    tol = 1e-5 if a.dtype in (torch.float32, torch.float64) and b.dtype in (
        torch.float32, torch.float64) else 1e-2
    ref = b64[fin].abs().max().item()
    return (a64[fin] - b64[fin]).abs().max().item() > tol * max(ref, 1e-30)


def compare_dumps(da, db):
    """Stage by stage (ORDER) comparison of dump da against dump db (the healthy one)."""
    A, B = load_dump(da), load_dump(db)
    differing = {}
    for stage in ORDER:
        for rk in sorted(set(A) | set(B)):
            ra, rb = A.get(rk), B.get(rk)
            if ra is None or rb is None:
                differing.setdefault(stage, []).append(rk)
                continue
            if stage == "layout":
                ma, mb = ra["meta"], rb["meta"]
                bad = (ma["position_ids"] != mb["position_ids"] or
                       ma["cu_seqlens"] != mb["cu_seqlens"] or
                       (ma["ulysses_rank"], ma["ring_rank"]) != (mb["ulysses_rank"], mb["ring_rank"]))
            else:
                xa, xb = ra["t"].get(stage), rb["t"].get(stage)
                if stage in OPTIONAL and (xa is None or xb is None):
                    continue  # optional taps: absence is not a difference
                bad = _tensor_differs(xa, xb)
            if bad:
                differing.setdefault(stage, []).append(rk)
    first = next((s for s in ORDER if s in differing), None)
    first_mand = next((s for s in ORDER if s in differing and s not in OPTIONAL), None)
    return {"first_stage": first, "ranks": differing.get(first, []),
            "first_mandatory_stage": first_mand,
            "first_mandatory_ranks": differing.get(first_mand, []),
            "differing": [[s, differing[s]] for s in ORDER if s in differing]}


# ----------------------------------------------------------------------------- reference

_REFERENCES = {}
_REFERENCE_LOCK = threading.Lock()


def reference(cfg):
    """Non-SP attention on the global tensors in float64 with autograd (kept per inputs: jobs
    that differ in their kernel only share it)."""
    key = json.dumps([cfg[x] for x in ("S", "H", "Hkv", "D", "docs", "dtype", "seed", "qmul")])
    with _REFERENCE_LOCK:  # one at a time: a large one takes much memory
        if key not in _REFERENCES:
            _REFERENCES[key] = _reference(cfg)
        return _REFERENCES[key]


def _reference(cfg):
    Q, K, V, W = (t.double() for t in global_inputs(cfg))
    Q.requires_grad_(True)
    K.requires_grad_(True)
    V.requires_grad_(True)
    S, H, Hkv, D = cfg["S"], cfg["H"], cfg["Hkv"], cfg["D"]
    kk = K.repeat_interleave(H // Hkv, dim=1)
    vv = V.repeat_interleave(H // Hkv, dim=1)
    cu = cfg["cu"]
    doc = torch.zeros(S, dtype=torch.long)
    for j, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc[a:b] = j
    i = torch.arange(S)
    allowed = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    s = torch.einsum("nhd,mhd->hnm", Q, kk) / math.sqrt(D)
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), vv)
    (out * W).sum().backward()
    return {"out.local": out.detach(), "lse": lse.detach(), "grad.q.local": Q.grad,
            "grad.k.local": K.grad, "grad.v.local": V.grad}


def _stage_pairs(d, cfg):
    """(rank, stage, dumped tensor or None, float64 reference) of dump d's local stages and LSE,
    against the non-SP reference of cfg; ("layout", None, None) where a rank's positions differ."""
    ref = reference(cfg)
    dump = load_dump(d)
    U, R = cfg["U"], cfg["R"]
    for rk, rd in dump.items():
        m, t = rd["meta"], rd["t"]
        rr, u = m["ring_rank"], m["ulysses_rank"]
        idx = torch.tensor(shard_tokens(cfg, rr, u), dtype=torch.long)
        if [int(x) for x in torch.tensor(global_positions(cfg["cu"], cfg["S"]))[idx]] != m["position_ids"]:
            yield rk, "layout", None, None
        want = {
            "out.local": ref["out.local"][idx], "grad.q.local": ref["grad.q.local"][idx],
            "grad.k.local": ref["grad.k.local"][idx], "grad.v.local": ref["grad.v.local"][idx],
        }
        hq = cfg["H"] // U
        gidx = torch.tensor(ring_tokens(cfg["cu"], R, rr), dtype=torch.long)
        if "lse" in t:
            want["lse"] = ref["lse"][u * hq:(u + 1) * hq][:, gidx]
        for stage, r in want.items():
            yield rk, stage, t.get(stage), r


def selfcheck_dump(d, cfg):
    """Max normalized error (max|x - ref| / max|ref|) per stage over the ranks of dump d."""
    errs = {}
    for _, stage, x, r in _stage_pairs(d, cfg):
        if r is None or x is None or tuple(x.shape) != tuple(r.shape):
            e = float("inf")
        else:
            e = ((x.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
            if math.isnan(e):
                e = float("inf")
        errs[stage] = max(errs.get(stage, 0.0), e)
    return errs


def error_stats(d, cfg):
    """Per local stage of dump d against the float64 non-SP reference, over all ranks: the
    norm-wise relative error ||x - ref||_2 / ||ref||_2 ("rms") and max|x - ref| / max|ref|
    ("max"); inf where a stage is missing, misshapen or not finite."""
    acc = {}
    for _, stage, x, r in _stage_pairs(d, cfg):
        a = acc.setdefault(stage, [0.0, 0.0, 0.0, 0.0])  # sum err², sum ref², max err, max ref
        if r is None or x is None or tuple(x.shape) != tuple(r.shape) or \
                not torch.isfinite(x.double()).all():
            a[0] = float("inf")
            continue
        fin = torch.isfinite(r)
        e = (x.double() - r)[fin]
        a[0] += float((e * e).sum())
        a[1] += float((r[fin] * r[fin]).sum())
        a[2] = max(a[2], float(e.abs().max())) if e.numel() else a[2]
        a[3] = max(a[3], float(r[fin].abs().max())) if e.numel() else a[3]
    out = {}
    for stage, (se, sr, me, mr) in acc.items():
        if se == float("inf"):
            out[stage] = {"rms": float("inf"), "max": float("inf")}
        else:
            out[stage] = {"rms": math.sqrt(se / max(sr, 1e-300)), "max": me / max(mr, 1e-300)}
    return out


def _tolerance(dtype):
    return 1e-5 if dtype == "f32" else 3e-2


# ----------------------------------------------------------------------------- CLI

def _dir_name(job, variant, dtype):
    return "%s-%s-%s" % (job, variant, dtype)


def _twin_key(cfg):
    return tuple(json.dumps(cfg[k]) for k in
                 ("job", "U", "R", "S", "H", "Hkv", "D", "docs", "qmul", "dtype", "seed"))


def cmd_all(root, seed, only=None, twins=True):
    """Every standard job (or only the variants named), dumped under root with expected.json;
    the entries of jobs not run are kept. twins=False: the dumps only (no healthy twins run, no
    expected.json written), for a test that judges them against the committed expectations."""
    os.makedirs(root, exist_ok=True)
    ok = True
    expected = {}
    healthy = {}
    with tempfile.TemporaryDirectory(prefix="sp_jobs-twins-") as tmp:
        for job, variant, dtype in STANDARD:
            if only and variant not in only:
                continue
            cfg = make_cfg(job, variant, dtype, seed)
            name = _dir_name(job, variant, dtype)
            out = os.path.join(root, name)
            fine = run_job(cfg, out, quiet=variant in EXPECTED_CRASH)
            crashed = not fine
            if crashed and variant not in EXPECTED_CRASH:
                ok = False
            if fine and variant in EXPECTED_CRASH:
                sys.stderr.write("job %s was expected to crash but finished\n" % name)
                ok = False
            entry = {"job": job, "variant": variant, "dtype": dtype,
                     "healthy": cfg["bug"] is None}
            if cfg["bug"] is None:
                entry.update(first_stage=None, ranks=[], cause="")
                if fine:
                    healthy[_twin_key(cfg)] = out
            elif not twins:
                pass
            else:
                # The healthy twin: the same job and inputs without the bug (a healthy dump of
                # the standard set when one has exactly this configuration).
                tdir = healthy.get(_twin_key(cfg))
                if tdir is None:
                    tdir = os.path.join(tmp, name)
                    if not run_job(dict(cfg, bug=None), tdir):
                        ok = False
                        continue
                cmp_ = compare_dumps(out, tdir)
                entry.update(first_stage=cmp_["first_stage"], ranks=cmp_["ranks"],
                             first_mandatory_stage=cmp_["first_mandatory_stage"],
                             first_mandatory_ranks=cmp_["first_mandatory_ranks"],
                             cause=cfg["cause"], crashed=crashed,
                             differing=cmp_["differing"])
            expected[name] = entry
            print("%-40s %s%s" % (name, "healthy" if entry["healthy"] else
                                  "first_stage=%s ranks=%s"
                                  % (entry.get("first_stage"), entry.get("ranks")),
                                  " (crashed, as expected)" if crashed else ""))
    if not twins:
        return ok
    path = os.path.join(root, "expected.json")
    if os.path.exists(path):  # keep the entries of other jobs (veomni_ulysses_job.py's "veomni")
        with open(path) as f:
            expected = dict({n: e for n, e in json.load(f).items()
                             if only or e.get("job") not in _SHAPES}, **expected)
    with open(path, "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    return ok


def cmd_selfcheck(root, seed):
    ok = True
    rows = []
    if root:
        for name in sorted(os.listdir(root)):
            d = os.path.join(root, name)
            mp_ = os.path.join(d, "rank0.json")
            if not os.path.isfile(mp_):
                continue
            with open(mp_) as f:
                cfg = parse_job_string(json.load(f).get("job", ""))
            if cfg is None or cfg["bug"] is not None:
                continue
            rows.append((name, d, cfg))
        tmp = None
    else:
        tmp = tempfile.mkdtemp(prefix="sp_jobs-selfcheck-")
        sets = [s for s in STANDARD if VARIANTS[(s[0], s[1])][1] is None]
        sets.append(("ring", "healthy_r2_bigq", "bf16"))
        for job, variant, dtype in sets:
            cfg = make_cfg(job, variant, dtype, seed)
            d = os.path.join(tmp, _dir_name(job, variant, dtype))
            if not run_job(cfg, d):
                ok = False
                continue
            rows.append((_dir_name(job, variant, dtype), d, cfg))
    try:
        for name, d, cfg in rows:
            errs = selfcheck_dump(d, cfg)
            tol = _tolerance(cfg["dtype"])
            good = all(e <= tol for e in errs.values())
            ok = ok and good
            print("%-34s %s  %s" % (name, "ok  " if good else "FAIL",
                                    "  ".join("%s=%.2e" % (k, v) for k, v in sorted(errs.items()))))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=sorted(_SHAPES))
    ap.add_argument("--variant")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    ap.add_argument("--out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--all", metavar="OUTROOT")
    ap.add_argument("--only", help="with --all: these variants only (comma-separated)")
    ap.add_argument("--no-twins", action="store_true",
                    help="with --all: the dumps only (no healthy twins, no expected.json)")
    ap.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"))
    ap.add_argument("--selfcheck", nargs="?", const="", metavar="ROOT")
    a = ap.parse_args(argv)
    if a.list:
        std = {(j, v): d for j, v, d in STANDARD}
        for (job, variant), (over, bug, cause) in VARIANTS.items():
            cfg = make_cfg(job, variant, "f32")
            print("%-8s %-20s U=%d R=%d S=%d H=%d Hkv=%d D=%d docs=%s%s dtypes=f32,bf16,f16%s%s" % (
                job, variant, cfg["U"], cfg["R"], cfg["S"], cfg["H"], cfg["Hkv"], cfg["D"],
                cfg["docs"], " qmul=%g" % cfg["qmul"] if cfg["qmul"] != 1 else "",
                " (--all: %s)" % ",".join(d for j, v, d in STANDARD if (j, v) == (job, variant))
                if (job, variant) in std else "",
                "  # " + cause if cause else ""))
        return 0
    if a.compare:
        r = compare_dumps(*a.compare)
        print(json.dumps(r))
        print("first differing stage: %s on ranks %s" % (r["first_stage"], r["ranks"]))
        return 0 if r["first_stage"] is None else 1
    if a.all:
        return 0 if cmd_all(a.all, a.seed, set(a.only.split(",")) if a.only else None,
                            twins=not a.no_twins) else 1
    if a.selfcheck is not None:
        return 0 if cmd_selfcheck(a.selfcheck, a.seed) else 1
    if not (a.job and a.variant and a.out):
        ap.error("--job, --variant and --out are needed (or --list/--all/--compare/--selfcheck)")
    cfg = make_cfg(a.job, a.variant, a.dtype, a.seed)
    return 0 if run_job(cfg, a.out) else 1


if __name__ == "__main__":
    sys.exit(main())

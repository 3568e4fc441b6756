"""The SP attention of the frameworks users pip-install, as seqpar.testing implementations: each
calls the installed package's own code (requirements.txt pins the versions; nothing of theirs is
copied here). The glue only adapts layouts: seqpar.testing hands each rank q [s, H, D] and
k/v [s, Hkv, D] and wants out [s, H, D].

- `veomni_ulysses`: VeOmni's prepare_ulysses_qkv / restore_ulysses_output
  (veomni.ops.kernels.attention.ulysses: KV repeat for U > Hkv, the all-to-alls of
  veomni.distributed.sequence_parallel).
- `deepspeed_ulysses`: DeepSpeed's DistributedAttention (deepspeed.sequence.layer) around a local
  attention; DeepSpeed asserts KV heads >= U, so its users repeat KV heads first (as here).
- `deepspeed_alst`: DeepSpeed ALST's Hugging Face Ulysses attention (UlyssesSPAttentionHF,
  deepspeed.runtime.sequence_parallel.ulysses_sp) around a local attention.
- `torch_cp_ring`: torch's own context-parallel ring attention
  (torch.distributed.tensor.experimental._context_parallel: _templated_ring_attention forward
  and backward, its head-tail load balancing when the layout is zigzag) with the CPU's fused
  SDPA kernel. The public context_parallel() refuses the CPU kernel (see _TORCH_CP_PUBLIC).
- `yunchang_usp`: yunchang's LongContextAttention (Ulysses x ring, USP) with its torch
  backend; forward only (see YUNCHANG_BACKWARD).

Between the all-to-alls of the Ulysses frameworks sits the same local attention: masked varlen
causal softmax over the gathered rows' documents (ctx.cu_seqlens_ring), float32 sums.
"""
import os
import sys

import torch
import torch.distributed as dist
# The frameworks are imported here, in the test's own process, from which seqpar.testing forks
# every rank: the ranks inherit them. Imported inside the functions below alone, they were paid
# by every rank of every pool (VeOmni's and transformers' ~2 s of CPU each, ten ranks per
# property at world ≤ 4, more where a raising example restarts the pool); the imports there now
# find them loaded.
import deepspeed.runtime.sequence_parallel.ulysses_sp  # noqa: F401,E402
import deepspeed.sequence.layer  # noqa: F401,E402
import transformers.models.gpt_oss.modeling_gpt_oss  # noqa: F401,E402
import veomni.ops.kernels.attention.ulysses  # noqa: F401,E402
import yunchang  # noqa: F401,E402
import yunchang.kernels.attention  # noqa: F401,E402
from torch.distributed.tensor.experimental._context_parallel import _attention  # noqa: F401,E402

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(_ROOT, "tests", "jobs"))
import sp_jobs  # noqa: F401,E402


def local_attention(q, k, v, cu, scale, causal=True):
    """q [n, h, D], k/v [n, hk, D] over the documents cu of these rows -> out [n, h, D]
    (sp_jobs.py's masked varlen attention, float32 sums)."""
    import sp_jobs
    mask = sp_jobs.section_mask("diag", cu, q.shape[0], causal=causal)
    return sp_jobs.attend(q, k, v, mask, scale)[0]


# ----------------------------------------------------------------------------- VeOmni

def veomni_ulysses(q, k, v, ctx):
    from veomni.ops.kernels.attention.ulysses import prepare_ulysses_qkv, restore_ulysses_output
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # VeOmni's [1, s, H, D]
    qg, kg, vg, _ = prepare_ulysses_qkv(q4, k4, v4, group=ctx.ulysses_group,
                                        ulysses_size=ctx.ulysses)
    ctx.tap("q.gathered", qg, layout="bshd")
    ctx.tap("k.gathered", kg, layout="bshd")
    ctx.tap("v.gathered", vg, layout="bshd")
    o = local_attention(qg[0], kg[0], vg[0], ctx.cu_seqlens_ring, ctx.scale, ctx.causal)
    o = ctx.tap("out.attn", o.unsqueeze(0), layout="bshd")
    return restore_ulysses_output(o, group=ctx.ulysses_group)[0]


# ----------------------------------------------------------------------------- DeepSpeed

_DS_READY = []


def deepspeed_ulysses(q, k, v, ctx):
    from deepspeed.sequence.layer import DistributedAttention
    _deepspeed_comm()
    U, Hkv = ctx.ulysses, ctx.kv_heads
    if U > Hkv:  # DeepSpeed asserts KV heads >= U: repeat them first, as its users do
        k = ctx.tap("k.repeated", k.repeat_interleave(U // Hkv, 1))
        v = ctx.tap("v.repeated", v.repeat_interleave(U // Hkv, 1))

    def local(qg, kg, vg, *args, **kwargs):  # [1, S, h, D]
        ctx.tap("q.gathered", qg, layout="bshd")
        ctx.tap("k.gathered", kg, layout="bshd")
        ctx.tap("v.gathered", vg, layout="bshd")
        o = local_attention(qg[0], kg[0], vg[0], ctx.cu_seqlens_ring, ctx.scale, ctx.causal)
        return ctx.tap("out.attn", o.unsqueeze(0), layout="bshd")

    da = DistributedAttention(local, ctx.ulysses_group)
    return da(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0)[0]


def _deepspeed_comm():
    import deepspeed
    if not _DS_READY:  # deepspeed.comm over the gloo world the harness made
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        _DS_READY.append(True)


_ALST = {}


def deepspeed_alst(q, k, v, ctx):
    """DeepSpeed ALST's UlyssesSPAttentionHF (deepspeed.runtime.sequence_parallel.ulysses_sp):
    the Hugging Face attention wrapper, called as a transformers model calls it (HF layout
    [batch, heads, tokens, head_dim], this rank's position_ids, which it all-gathers), around a
    core attention; it repeats KV heads itself when U > Hkv."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    _deepspeed_comm()
    s, H, D = q.shape

    def core(module, qg, kg, vg, mask, *args, **kwargs):  # [1, h_local, S, D]
        t = lambda x: x.transpose(1, 2)  # -> [1, S, h_local, D]
        ctx.tap("q.gathered", t(qg), layout="bshd")
        ctx.tap("k.gathered", t(kg), layout="bshd")
        ctx.tap("v.gathered", t(vg), layout="bshd")
        o = local_attention(t(qg)[0], t(kg)[0], t(vg)[0], ctx.cu_seqlens_ring, ctx.scale,
                            ctx.causal)
        return ctx.tap("out.attn", o.unsqueeze(0), layout="bshd"), None  # [1, S, h_local, D]

    key = (ctx.ulysses, H, ctx.kv_heads, D, id(ctx.ulysses_group))
    if key not in _ALST:
        _ALST[key] = UlyssesSPAttentionHF(
            attn=core, batch_size=1, attn_head_count=H, attn_head_size=D,
            kv_head_count=ctx.kv_heads, num_hidden_layers=1, process_group=ctx.ulysses_group,
            seq_length_is_variable=True)
    u = _ALST[key]
    u.attn = core
    hf = lambda x: x.transpose(0, 1).unsqueeze(0)  # [s, h, D] -> [1, h, s, D]
    pos = torch.as_tensor(ctx.position_ids, dtype=torch.long).reshape(1, -1)
    module = torch.nn.Module()
    module.num_key_value_groups = H // ctx.kv_heads
    out, _ = u(module, hf(q), hf(k), hf(v), None, position_ids=pos)
    return out[0].reshape(s, H, D)


# ----------------------------------------------------------------------------- torch CP

# Measured with torch 2.11 on gloo CPU ranks: context_parallel(mesh, buffers=…) around
# F.scaled_dot_product_attention raises "Operator aten._scaled_dot_product_flash_attention_for_cpu
# .default does not have a sharding strategy registered" (both rotate methods, load balancing on
# or off): the public API dispatches only the CUDA kernels (flash, efficient, cuDNN). The ring
# itself is device-independent; it runs here with the CPU kernel.
_TORCH_CP_PUBLIC = ("torch.distributed.tensor.experimental.context_parallel dispatches only the "
                    "CUDA SDPA kernels; on the CPU it raises (no sharding strategy for "
                    "_scaled_dot_product_flash_attention_for_cpu)")


class _TorchRing(torch.autograd.Function):
    """torch's ring forward and backward (its own functions), as one autograd node."""

    @staticmethod
    def forward(fn_ctx, q, k, v, group, scale, load_balance):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cpa
        old = cpa._cp_options.enable_load_balance
        cpa._cp_options.enable_load_balance = load_balance
        try:
            out, lse, *_ = cpa._templated_ring_attention(
                group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
                is_causal=True, dropout_p=0.0, scale=scale)
        finally:
            cpa._cp_options.enable_load_balance = old
        fn_ctx.save_for_backward(q, k, v, out, lse)
        fn_ctx.group, fn_ctx.scale, fn_ctx.lb = group, scale, load_balance
        return out

    @staticmethod
    def backward(fn_ctx, dout):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cpa
        q, k, v, out, lse = fn_ctx.saved_tensors
        old = cpa._cp_options.enable_load_balance
        cpa._cp_options.enable_load_balance = fn_ctx.lb
        try:
            dq, dk, dv, *_ = cpa._templated_ring_attention_backward(
                fn_ctx.group, 2,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                grad_out=dout.contiguous(), grad_out_name="grad_out", query=q, key=k, value=v,
                out=out, logsumexp=lse, is_causal=True, dropout_p=0.0, scale=fn_ctx.scale)
        finally:
            cpa._cp_options.enable_load_balance = old
        return dq, dk, dv, None, None, None


def torch_cp_ring(q, k, v, ctx):
    """Ring only (U = 1): zigzag = torch's head-tail load balancing, contiguous = without."""
    t = lambda x: x.transpose(0, 1).unsqueeze(0)  # [s, h, D] -> [1, h, s, D]
    if ctx.kv_heads != ctx.heads:  # GQA: as torch's SDPA callers do, KV repeated to q's heads
        k = k.repeat_interleave(ctx.heads // ctx.kv_heads, 1)
        v = v.repeat_interleave(ctx.heads // ctx.kv_heads, 1)
    o = _TorchRing.apply(t(q), t(k), t(v), ctx.ring_group, ctx.scale, ctx.layout == "zigzag")
    return o[0].transpose(0, 1)


# ----------------------------------------------------------------------------- yunchang

# yunchang 0.6.4's torch backends (AttnType.TORCH_*) raise in backward
# (kernels/attention.py: pytorch_attn_backward), and TORCH_MATH returns an all-zero LSE, which
# the ring merge then uses; TORCH_FLASH calls the CUDA-only aten._scaled_dot_product_flash_
# attention, so on the CPU the same op's CPU twin is put in its place. Varlen (documents) exists
# only through flash-attn: one document per row.
YUNCHANG_BACKWARD = ("yunchang 0.6.4's torch attention backends raise NotImplementedError in "
                     "backward; its backward needs flash-attn (CUDA)")
_YC = {}


def yunchang_usp(q, k, v, ctx):
    import yunchang
    import yunchang.kernels.attention as yka
    from yunchang.kernels import AttnType
    yka._scaled_dot_product_flash_attention = (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    key = (ctx.ulysses, ctx.ring)
    if key not in _YC:
        # seqpar's cp rank = ring_rank * U + ulysses_rank: yunchang's use_ulysses_low=True.
        yunchang.set_seq_parallel_pg(ctx.ulysses, ctx.ring, dist.get_rank(), dist.get_world_size(),
                                     use_ulysses_low=True)
        impl = "zigzag" if ctx.layout == "zigzag" else "basic"
        _YC[key] = yunchang.LongContextAttention(ring_impl_type=impl,
                                                 attn_type=AttnType.TORCH_FLASH)
    # The layer's options as yunchang takes them: causal or not, flash-attn's window_size
    # (left, right) and softcap.
    out = _YC[key](q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale=ctx.scale,
                   causal=ctx.causal, window_size=ctx.window_size, softcap=ctx.softcap)
    return out[0]


def _flash_cpu_lse_kept(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True,
                        window_size=(-1, -1), softcap=None, alibi_slopes=None,
                        return_softmax=False, op_type="flash"):
    """yunchang's torch "flash" backend as its CUDA flash-attn twin behaves: the same kernel
    (the CPU one put in for the CUDA one, as above), its LSE returned as the kernel makes it
    (float32). yunchang 0.6.4's own pytorch_attn_forward casts each block's LSE to q's dtype
    before the ring merges the blocks with it (kernels/attention.py, `lse.to(q.dtype)`)."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        t(q), t(k), t(v), dropout_p=dropout_p, is_causal=causal, scale=softmax_scale)[:2]
    return t(out), lse


def yunchang_usp_lse_f32(q, k, v, ctx):
    """yunchang's LongContextAttention with each ring block's LSE kept in float32 (every other
    line of its code as it is): what its merge gives when the LSE is not rounded."""
    import yunchang.kernels as yk
    yk.pytorch_attn_forward = _flash_cpu_lse_kept
    return yunchang_usp(q, k, v, ctx)


# ----------------------------------------------------------------------------- gpt-oss sinks

_ALST_GPT_OSS = {}


def _gathered_mask(ctx):
    """Additive mask [1, 1, S, S] over the gathered rows: same document, causal (or not), and
    the layer's window (what the Hugging Face model's mask says for the whole sequence)."""
    pos = torch.tensor([ctx.global_position_ids[t] for t in ctx.ring_tokens])
    cu = torch.tensor(ctx.cu_seqlens_ring)
    n = pos.numel()
    doc = torch.searchsorted(cu[1:], torch.arange(n), right=True)
    p, k = pos[:, None], pos[None, :]
    ok = doc[:, None] == doc[None, :]
    if ctx.causal:
        ok &= k <= p
    if ctx.window_back >= 0:
        ok &= p - k <= ctx.window_back
    m = torch.zeros(n, n, dtype=torch.float32)
    return m.masked_fill(~ok, torch.finfo(torch.float32).min)[None, None]


def deepspeed_alst_gpt_oss(q, k, v, ctx, slice_sinks=False):
    """DeepSpeed ALST's UlyssesSPAttentionHF around transformers' own gpt-oss eager attention
    (transformers.models.gpt_oss.modeling_gpt_oss.eager_attention_forward: the sink as an extra
    softmax column read from module.sinks), called as GptOssAttention calls its attention
    interface (module, q, k, v, mask, scaling=…, s_aux=module.sinks). The module's sinks are
    ctx.sinks (every head, as the model holds them); slice_sinks: the module the core sees holds
    only the rank's heads' sinks (what a wrapper would have to do)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    _deepspeed_comm()
    s, H, D = q.shape
    module = torch.nn.Module()
    module.num_key_value_groups = H // ctx.kv_heads
    module.training = False
    # gpt-oss always has sinks; a scenario without them is a sink of −∞ (no weight).
    module.sinks = ctx.sinks if ctx.sinks is not None else torch.full((H,), float("-inf"))

    def core(mod, qg, kg, vg, mask, *args, **kwargs):  # [1, h_local, S, D]
        t = lambda x: x.transpose(1, 2)
        ctx.tap("q.gathered", t(qg), layout="bshd")
        ctx.tap("k.gathered", t(kg), layout="bshd")
        ctx.tap("v.gathered", t(vg), layout="bshd")
        if slice_sinks:
            h = qg.shape[1]
            inner = torch.nn.Module()
            inner.num_key_value_groups, inner.training = mod.num_key_value_groups, False
            inner.sinks = mod.sinks[ctx.ulysses_rank * h:(ctx.ulysses_rank + 1) * h]
            mod = inner
        o, w = eager_attention_forward(mod, qg.float(), kg.float(), vg.float(), mask,
                                       scaling=ctx.scale, **kwargs)
        return ctx.tap("out.attn", o.to(qg.dtype), layout="bshd"), w

    key = (ctx.ulysses, H, ctx.kv_heads, D, id(ctx.ulysses_group))
    if key not in _ALST_GPT_OSS:
        _ALST_GPT_OSS[key] = UlyssesSPAttentionHF(
            attn=core, batch_size=1, attn_head_count=H, attn_head_size=D,
            kv_head_count=ctx.kv_heads, num_hidden_layers=1, process_group=ctx.ulysses_group,
            seq_length_is_variable=True)
    u = _ALST_GPT_OSS[key]
    u.attn = core
    hf = lambda x: x.transpose(0, 1).unsqueeze(0)  # [s, h, D] -> [1, h, s, D]
    pos = torch.as_tensor(ctx.position_ids, dtype=torch.long).reshape(1, -1)
    out, _ = u(module, hf(q), hf(k), hf(v), _gathered_mask(ctx), position_ids=pos,
               s_aux=module.sinks)
    return out[0].reshape(s, H, D)


def deepspeed_alst_gpt_oss_sliced(q, k, v, ctx):
    """The same with the sinks sliced to the rank's heads around the eager attention."""
    return deepspeed_alst_gpt_oss(q, k, v, ctx, slice_sinks=True)


# ----------------------------------------------------------------------------- negative controls
# The same code on shards it does not lay out: the property must see it fail.

def torch_cp_ring_no_load_balance(q, k, v, ctx):
    """torch's ring with load balancing off, whatever the layout."""
    t = lambda x: x.transpose(0, 1).unsqueeze(0)
    if ctx.kv_heads != ctx.heads:
        k = k.repeat_interleave(ctx.heads // ctx.kv_heads, 1)
        v = v.repeat_interleave(ctx.heads // ctx.kv_heads, 1)
    return _TorchRing.apply(t(q), t(k), t(v), ctx.ring_group, ctx.scale, False)[0].transpose(0, 1)


def yunchang_usp_basic(q, k, v, ctx):
    """yunchang's ring with ring_impl_type="basic" (contiguous shards), whatever the layout."""
    import yunchang
    import yunchang.kernels.attention as yka
    from yunchang.kernels import AttnType
    yka._scaled_dot_product_flash_attention = (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    key = ("basic", ctx.ulysses, ctx.ring)
    if key not in _YC:
        yunchang.set_seq_parallel_pg(ctx.ulysses, ctx.ring, dist.get_rank(), dist.get_world_size(),
                                     use_ulysses_low=True)
        _YC[key] = yunchang.LongContextAttention(ring_impl_type="basic",
                                                 attn_type=AttnType.TORCH_FLASH)
    return _YC[key](q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale=ctx.scale,
                    causal=True)[0]

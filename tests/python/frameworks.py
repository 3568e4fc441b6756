"""The frameworks' own Ulysses code as seqpar.testing implementations (their code is read from a
checkout at run time, never copied here):

- `veomni_ulysses`: VeOmni's prepare_ulysses_qkv / restore_ulysses_output (and the all-to-alls
  under them), loaded from $VEOMNI_DIR by tools/crosscheck/async_ulysses_veomni.load_veomni.
- `deepspeed_ulysses`: DeepSpeed's DistributedAttention / _SeqAllToAll from
  $DEEPSPEED_DIR/deepspeed/sequence/layer.py (only the definitions, exec'd with torch.distributed
  as deepspeed.comm; the uneven-heads, overlap-stream and RoPE paths are stubbed to raise).

Between the all-to-alls sits the same local attention: masked varlen causal softmax over the
gathered rows' documents (ctx.cu_seqlens_ring), float32 sums, like SDPA with a block mask.
"""
import ast
import os
import sys
import typing

import torch
import torch.distributed as dist

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(_ROOT, "tools", "crosscheck"))


def local_attention(q, k, v, cu, scale, causal=True):
    """q [n, h, D], k/v [n, hk, D] over the documents cu of these rows -> out [n, h, D]
    (sp_jobs.py's masked varlen attention, float32 sums)."""
    import sp_jobs
    mask = sp_jobs.section_mask("diag", cu, q.shape[0], causal=causal)
    return sp_jobs.attend(q, k, v, mask, scale)[0]


# ----------------------------------------------------------------------------- VeOmni

_VEOMNI = {}


def _veomni(group, U):
    import async_ulysses_veomni
    import veomni_ulysses_job
    key = (id(group), U)
    if key not in _VEOMNI:
        root = os.environ["VEOMNI_DIR"]
        _VEOMNI[key] = async_ulysses_veomni.load_veomni(root, group, files=veomni_ulysses_job.FILES,
                                                        world_size=U)[0]
    return _VEOMNI[key]


def veomni_ulysses(q, k, v, ctx):
    ns = _veomni(ctx.ulysses_group, ctx.ulysses)
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # VeOmni's [1, s, H, D]
    qg, kg, vg, _ = ns["prepare_ulysses_qkv"](q4, k4, v4, group=ctx.ulysses_group,
                                              ulysses_size=ctx.ulysses)
    ctx.tap("q.gathered", qg, layout="bshd")
    ctx.tap("k.gathered", kg, layout="bshd")
    ctx.tap("v.gathered", vg, layout="bshd")
    o = local_attention(qg[0], kg[0], vg[0], ctx.cu_seqlens_ring, ctx.scale, ctx.causal)
    o = ctx.tap("out.attn", o.unsqueeze(0), layout="bshd")
    return ns["restore_ulysses_output"](o, group=ctx.ulysses_group)[0]


# ----------------------------------------------------------------------------- DeepSpeed

_DEEPSPEED = {}
_DS_NAMES = ["_generate_layout_params", "post_all2all", "pre_all2all_fun", "single_all_to_all",
             "_SeqAllToAll", "DistributedAttention"]


def _refuse(what):
    def f(*a, **k):
        raise RuntimeError("DeepSpeed path not available on the CPU harness: %s" % what)
    return f


def load_deepspeed(root):
    """DistributedAttention and its helpers from root/deepspeed/sequence/layer.py."""
    if root in _DEEPSPEED:
        return _DEEPSPEED[root]
    path = os.path.join(root, "deepspeed", "sequence", "layer.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = [n for n in tree.body
             if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in _DS_NAMES]
    missing = sorted(set(_DS_NAMES) - {n.name for n in found})
    if missing:
        raise RuntimeError("%s: no definition of %s" % (path, ", ".join(missing)))
    ns = {"torch": torch, "dist": dist, "Tensor": torch.Tensor, "Module": torch.nn.Module,
          "Any": typing.Any, "Tuple": typing.Tuple, "get_num_kv_heads": lambda: None,
          "set_num_kv_heads": _refuse("set_num_kv_heads (uneven heads)"),
          "get_shard_size_list": _refuse("get_shard_size_list (uneven heads)"),
          "uneven_heads_all2all": _refuse("uneven_heads_all2all"),
          "get_accelerator": _refuse("get_accelerator (overlap streams)"),
          "apply_rotary_pos_emb": _refuse("apply_rotary_pos_emb"),
          "rearrange": _refuse("einops.rearrange")}
    exec(compile(ast.Module(body=found, type_ignores=[]), path, "exec"), ns)
    _DEEPSPEED[root] = ns
    return ns


def deepspeed_ulysses(q, k, v, ctx):
    ns = load_deepspeed(os.environ["DEEPSPEED_DIR"])
    U, Hkv = ctx.ulysses, ctx.kv_heads
    if U > Hkv:  # DeepSpeed asserts KV heads ≥ U: repeat them first, as its users do
        k = ctx.tap("k.repeated", k.repeat_interleave(U // Hkv, 1))
        v = ctx.tap("v.repeated", v.repeat_interleave(U // Hkv, 1))

    def local(qg, kg, vg, *args, **kwargs):  # [1, S, h, D]
        ctx.tap("q.gathered", qg, layout="bshd")
        ctx.tap("k.gathered", kg, layout="bshd")
        ctx.tap("v.gathered", vg, layout="bshd")
        o = local_attention(qg[0], kg[0], vg[0], ctx.cu_seqlens_ring, ctx.scale, ctx.causal)
        return ctx.tap("out.attn", o.unsqueeze(0), layout="bshd")

    da = ns["DistributedAttention"](local, ctx.ulysses_group)
    return da(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0)[0]

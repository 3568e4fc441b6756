"""SP attentions that each read one field of seqpar.testing's context, as a user following the
docs would, and their off-by-one twins: `make(field, twin=False)`.

Every reader is the same all-gather attention — each rank gathers every rank's K, V and token
indices over ctx.cp_group, then attends its own queries over them — and differs only in how it
builds the one mask term or score transform its field describes:

  window_size     flash-attn's (left, right): k ∈ [p − left, p + right], −1 unlimited (the
                  causal mask is in it: right 0 on a causal layer)
  sliding_window  transformers' W on a causal layer: W keys, the query's own counted (p − k < W)
  window          ctx.window_back / ctx.window_ahead: p − k ≤ back, k − p ≤ ahead (−1: none)
  chunk           ctx.chunk: query and key in the same chunk of their document (positions // chunk)
  softcap         ctx.softcap: cap·tanh(s / cap) before the mask
  sinks           ctx.sinks: one logit per query head, a column of its own in the softmax
  causal          ctx.causal: k ≤ p within the document, or every key of it
  documents       ctx.cu_seqlens: the documents of the global packed row (SP padding one of its own)
  positions       ctx.global_position_ids: each token's position in its document

The twins are the slips a user makes with that field: a window one key short, (left, left) for
a lopsided bidirectional window, a chunk one longer, cap·tanh(s) (the scores not divided by the
cap), the previous head's sink value (its gradient still reaching the head's own, so that only
sinks that differ across heads show it), a causal mask that hides the query itself, a document
boundary one token late, positions counted from 1. Each twin differs from its healthy reader in
that one field's reading alone, so that it fails only where the draws exercise the field."""
import torch
import torch.distributed as dist

FIELDS = ("window_size", "sliding_window", "window", "chunk", "softcap", "sinks", "causal",
          "documents", "positions")


class _Gather(torch.autograd.Function):
    """Every rank's rows, concatenated in group order; backward: the gathered gradient summed
    over the group (all_reduce), this rank's rows kept."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n, ctx.rank = group, dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(ctx.n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        s = g.shape[0] // ctx.n
        return g[ctx.rank * s:(ctx.rank + 1) * s], None


class _ValueOf(torch.autograd.Function):
    """`values` forward, the gradient to `x` backward (x's own entries)."""

    @staticmethod
    def forward(ctx, x, values):
        return values.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None


def _gather(x, group):
    return _Gather.apply(x, group)


def _doc_ids(cu, n, late=False):
    doc = torch.zeros(n, dtype=torch.long)
    for a in cu[1:-1]:
        a = min(a + 1, n) if late else a
        doc[a:] += 1
    return doc


def _mask(ctx, field, twin, q_tok, k_tok):
    """[s, S] bool: which gathered keys each local query sees."""
    n = len(ctx.global_position_ids)
    doc = _doc_ids(ctx.cu_seqlens, n, late=twin and field == "documents")
    pos = torch.tensor(ctx.global_position_ids, dtype=torch.long)
    if field == "positions" and twin:
        pos = pos + (pos > 0).long()   # counted from 1 after each document's first token
    qd, kd = doc[q_tok][:, None], doc[k_tok][None, :]
    p, k = pos[q_tok][:, None], pos[k_tok][None, :]
    seen = qd == kd
    if field == "window_size":
        left, right = ctx.window_size
        if twin and not ctx.causal:
            right = left
        if left >= 0:
            seen = seen & (k >= p - left)
        if right >= 0:
            seen = seen & (k <= p + right)
    else:
        if ctx.causal:
            seen = seen & ((k < p) if (twin and field == "causal") else (k <= p))
        if field == "sliding_window":
            W = ctx.sliding_window
            if W is not None:
                seen = seen & (p - k < (W - 1 if twin else W))
        else:
            back, ahead = ctx.window_back, ctx.window_ahead
            if field == "window" and twin and back >= 0:
                back += 1
            if back >= 0:
                seen = seen & (p - k <= back)
            if ahead >= 0 and not ctx.causal:
                seen = seen & (k - p <= ahead)
    if ctx.chunk > 0:
        c = ctx.chunk + 1 if (twin and field == "chunk") else ctx.chunk
        seen = seen & (torch.div(p, c, rounding_mode="floor") ==
                       torch.div(k, c, rounding_mode="floor"))
    return seen


def make(field, twin=False):
    if field not in FIELDS:
        raise ValueError("ctx_readers: no field %r (one of %s)" % (field, ", ".join(FIELDS)))

    def attention(q, k, v, ctx):
        g = ctx.cp_group
        tok = torch.tensor(ctx.tokens, dtype=torch.long)
        k_all, v_all = _gather(k, g), _gather(v, g)
        parts = [torch.empty_like(tok) for _ in range(ctx.cp_size)]
        dist.all_gather(parts, tok, group=g)
        k_tok = torch.cat(parts)
        # the arithmetic in float64 (only the output's rounding to the inputs' dtype is left for
        # the error model: these readers test fields, not rounding)
        wt = torch.float64
        dt, q, k_all, v_all = q.dtype, q.to(wt), k_all.to(wt), v_all.to(wt)
        rep = q.shape[1] // k.shape[1]
        k_all = k_all.repeat_interleave(rep, dim=1)
        v_all = v_all.repeat_interleave(rep, dim=1)
        s = torch.einsum("shd,Shd->hsS", q, k_all) * ctx.scale
        if ctx.softcap > 0:
            cap = ctx.softcap
            s = cap * torch.tanh(s) if (twin and field == "softcap") else cap * torch.tanh(s / cap)
        seen = _mask(ctx, field, twin, tok, k_tok)
        s = s.masked_fill(~seen[None], float("-inf"))
        if ctx.sinks is not None:
            sinks = ctx.sinks
            if twin and field == "sinks":   # another head's value, the gradient still its own
                sinks = _ValueOf.apply(sinks, sinks.detach().roll(1))
            col = sinks.to(s.dtype)[:, None, None].expand(-1, s.shape[1], 1)
            p = torch.cat([s, col], dim=-1).softmax(-1)[..., :-1]
        else:
            p = s.softmax(-1)
        p = torch.nan_to_num(p)   # a query that sees no key (none here: its own is always seen)
        return torch.einsum("hsS,Shd->shd", p, v_all).to(dt)

    attention.__name__ = "reads_%s%s" % (field, "_twin" if twin else "")
    return attention

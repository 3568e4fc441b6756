"""A hybrid Ulysses × zigzag-ring attention in plain torch, written the way ring-flash-attention
writes its zigzag varlen ring (our own code): the worked example of seqpar.testing's contract.

Per rank, `attention(q, k, v, ctx)` with q [s_local, H, D], k/v [s_local, Hkv, D]:
  1. Ulysses (ctx.ulysses > 1): KV heads repeat_interleave'd U/Hkv times when Hkv < U, then one
     all-to-all per tensor scatters heads and gathers the ring rank's tokens.
  2. Ring (ctx.ring > 1, zigzag): every local document is [early chunk | late chunk]; step 0
     attends causally to the own block; at step i the block of ring rank src = (r − i) mod R is
     seen by every row through its early half (src < r) or by the late half of the rows in full
     (src > r). Partial outputs merge with out −= σ(lse_b − lse)·(out − out_b),
     lse −= log σ(lse − lse_b). Backward recomputes every block with the final lse and sends
     each block's dK/dV accumulator around the ring with its KV (R hops: home again).
  3. The reverse all-to-all.
Scores, softmax and sums in float32 (float64 for float64 inputs), like the fused kernels.
Today's attention options (ctx): a bidirectional layer sees every key of its document at every
step; windows and chunks mask each block by the rows' positions in their documents; capping
goes into every block's scores; the sinks of the rank's heads enter once, after the last merge.

    python3 -m seqpar.testing check python/examples/zigzag_ring_attention.py:attention
        (SUPPORTS below declares the zigzag layout alone: read where --supports is not given)
    python3 -m seqpar.testing check python/examples/zigzag_ring_attention.py:attention \\
        --supports "$(python3 -c 'import json; print(json.dumps(dict(layouts=["zigzag"],
            bidirectional=True, window=True, chunk=True, sinks=True, softcap=True)))')"

Each step is a method, so a variant overrides one of them.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

SUPPORTS = {"layouts": ("zigzag",)}


def _work_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _wire(t):
    # gloo moves no bfloat16: its bits travel as float16 (same size; no arithmetic on the way).
    return t.view(torch.float16) if t.dtype == torch.bfloat16 else t


class _SeqToHead(torch.autograd.Function):
    """[s, Hh, D] -> [U·s, Hh/U, D] over the Ulysses group; backward is the inverse."""

    @staticmethod
    def forward(ctx, x, impl, c):
        ctx.impl, ctx.c = impl, c
        return impl.seq_to_head(x.contiguous(), c)

    @staticmethod
    def backward(ctx, g):
        return ctx.impl.head_to_seq(g.contiguous(), ctx.c), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, impl, c):
        ctx.impl, ctx.c = impl, c
        return impl.head_to_seq(y.contiguous(), c)

    @staticmethod
    def backward(ctx, g):
        return ctx.impl.seq_to_head(g.contiguous(), ctx.c), None, None


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, impl, c):
        out, lse = impl.ring_forward(q, k, v, sinks, c)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.impl, ctx.c = impl, c
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = ctx.impl.ring_backward(q, k, v, out, lse, dout, sinks, ctx.c)
        return dq, dk, dv, dsinks, None, None


class ZigzagRingAttention(object):
    """The hybrid attention; an instance is the per-rank function of seqpar.testing's contract."""

    # ---------------------------------------------------------------- Ulysses
    def repeat_kv(self, x, rep):
        return x.repeat_interleave(rep, dim=1)

    def all_to_all(self, send, c):
        recv = torch.empty_like(send)
        dist.all_to_all_single(_wire(recv), _wire(send), group=c.ulysses_group)
        return recv

    def seq_to_head(self, x, c):
        U = c.ulysses
        s, hh, d = x.shape
        send = x.reshape(s, U, hh // U, d).transpose(0, 1).contiguous()
        return self.all_to_all(send, c).reshape(U * s, hh // U, d)

    def head_to_seq(self, y, c):
        U = c.ulysses
        n, h, d = y.shape
        recv = self.all_to_all(y.reshape(U, n // U, h, d).contiguous(), c)
        return recv.transpose(0, 1).reshape(n // U, U * h, d)

    # ---------------------------------------------------------------- masks
    def ring_cu(self, c):
        """Documents of the gathered ring-rank rows (zigzag: cu_seqlens // R)."""
        return c.cu_seqlens_ring

    def scale(self, c):
        return c.scale

    def doc_and_half(self, c, n):
        """Per gathered row: its document and whether it is in the late half of its local
        document (zigzag: [early chunk | late chunk])."""
        cu = torch.tensor(self.ring_cu(c), dtype=torch.long)
        i = torch.arange(n)
        doc = torch.searchsorted(cu[1:], i, right=True)
        mid = (cu[doc] + cu[doc + 1]) // 2
        return doc, i >= mid

    def section(self, r, src):
        return "diag" if src == r else ("lower" if src < r else "upper")

    def positions(self, c, ring_rank):
        """Document positions of a ring rank's gathered rows."""
        return torch.tensor([c.global_position_ids[t] for t in c.ring_tokens_of[ring_rank]])

    def mask(self, kind, c, n, src=None):
        doc, late = self.doc_and_half(c, n)
        same = doc[:, None] == doc[None, :]
        if not c.causal:  # bidirectional: every key of the document, at every step
            m = same
        elif kind == "diag":
            i = torch.arange(n)
            m = same & (i[None, :] <= i[:, None])
        elif kind == "lower":
            m = same & ~late[None, :]
        else:
            m = same & late[:, None]
        if (c.window_back >= 0 or c.chunk > 0) and src is not None:
            p = self.positions(c, c.ring_rank)[:, None]
            k = self.positions(c, src)[None, :]
            back, ahead = self.window(c)
            if back >= 0:
                m = m & (p - k <= back)
            if ahead >= 0:
                m = m & (k - p <= ahead)
            if c.chunk > 0:
                m = m & (torch.div(p, c.chunk, rounding_mode="floor") ==
                         torch.div(k, c.chunk, rounding_mode="floor"))
        return m

    def window(self, c):
        """(keys back, keys ahead) a query sees: ctx.window_back, ctx.window_ahead."""
        return c.window_back, c.window_ahead

    def scores(self, q, k, c):
        """[h, n, m] scaled scores, capped as cap·tanh(s/cap) when ctx.softcap is set."""
        s = torch.einsum("nhd,mhd->hnm", q, k) * self.scale(c)
        return c.softcap * torch.tanh(s / c.softcap) if c.softcap > 0 else s

    # ---------------------------------------------------------------- one block
    def block(self, q, k, v, mask, c):
        """out [n, h, D], lse [h, n] of q against one KV block under mask (rows that see
        nothing: out 0, lse −inf)."""
        h, hk = q.shape[1], k.shape[1]
        if h != hk:
            k, v = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
        s = self.scores(q, k, c).masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
        return torch.einsum("hnm,mhd->nhd", p, v), lse

    def merge(self, out, lse, bout, blse):
        w = torch.sigmoid(blse - lse).transpose(0, 1)[..., None]
        return out - w * (out - bout), lse - F.logsigmoid(lse - blse)

    # ---------------------------------------------------------------- the ring
    def exchange(self, bufs, c):
        """Sends bufs to the next ring rank, receives the previous one's."""
        nxt = c.ring_ranks[(c.ring_rank + 1) % c.ring]
        prv = c.ring_ranks[(c.ring_rank - 1) % c.ring]
        recv = [torch.empty_like(b) for b in bufs]
        ops = [dist.isend(b, nxt, group=c.ring_group) for b in bufs]
        ops += [dist.irecv(b, prv, group=c.ring_group) for b in recv]
        for op in ops:
            op.wait()
        return recv

    def fold_sinks(self, out, lse, sinks):
        """The sinks enter once, after the last merge: lse' = log(e^lse + e^sink),
        out' = out·e^(lse − lse')."""
        if sinks is None:
            return out, lse
        s = sinks.to(lse.dtype)[:, None].expand_as(lse)
        folded = torch.logaddexp(lse, s)
        return out * torch.exp(lse - folded).transpose(0, 1)[..., None], folded

    def ring_forward(self, q, k, v, sinks, c):
        wt = _work_dtype(q)
        qf, kv = q.to(wt), torch.stack([k.to(wt), v.to(wt)])
        n, R, r = q.shape[0], c.ring, c.ring_rank
        out = lse = None
        for i in range(R):
            src = (r - i) % R
            bout, blse = self.block(qf, kv[0], kv[1], self.mask(self.section(r, src), c, n, src),
                                    c)
            out, lse = (bout, blse) if out is None else self.merge(out, lse, bout, blse)
            if i + 1 < R:
                kv = self.exchange([kv], c)[0]
        out, lse = self.fold_sinks(out, lse, sinks)
        return out.to(q.dtype), lse.to(torch.float32)

    def ring_backward(self, q, k, v, out, lse, dout, sinks, c):
        wt = _work_dtype(q)
        qf, do, of = q.to(wt), dout.to(wt), out.to(wt)
        kv = torch.stack([k.to(wt), v.to(wt)])
        n, h, d = qf.shape
        hk = k.shape[1]
        g = h // hk
        R, r = c.ring, c.ring_rank
        scale = self.scale(c)
        lse_w = lse.to(wt)
        safe = torch.where(torch.isinf(lse_w), torch.zeros_like(lse_w), lse_w)
        delta = (do * of).sum(-1).transpose(0, 1)  # [h, n]
        dq = torch.zeros_like(qf)
        dkv = torch.zeros_like(kv)
        # The sinks' gradient: −Σ_rows e^(sink − lse)·(dO·O), from the sinked output and LSE.
        dsinks = None
        if sinks is not None:
            p_sink = torch.exp(sinks.to(wt)[:, None] - lse_w)
            dsinks = -(p_sink * delta).sum(-1).to(sinks.dtype)
        for i in range(R):
            src = (r - i) % R
            mask = self.mask(self.section(r, src), c, n, src)
            kk, vv = kv[0].repeat_interleave(g, 1), kv[1].repeat_interleave(g, 1)
            s = self.scores(qf, kk, c)
            p = torch.exp(s.masked_fill(~mask, float("-inf")) - safe[..., None])
            dv = torch.einsum("hnm,nhd->mhd", p, do)
            ds = p * (torch.einsum("nhd,mhd->hnm", do, vv) - delta[..., None])
            if c.softcap > 0:  # through the capping: 1 − tanh²
                ds = ds * (1 - (s / c.softcap) ** 2)
            dq += scale * torch.einsum("hnm,mhd->nhd", ds, kk)
            dk = scale * torch.einsum("hnm,nhd->mhd", ds, qf)
            dkv = dkv + torch.stack([dk.reshape(n, hk, g, d).sum(2),
                                     dv.reshape(n, hk, g, d).sum(2)])
            if R > 1:
                # The accumulator travels with its KV block; after R hops it is home.
                if i + 1 < R:
                    kv, dkv = self.exchange([kv, dkv], c)
                else:
                    dkv = self.exchange([dkv], c)[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks

    # ---------------------------------------------------------------- the whole call
    def rank_sinks(self, c):
        """The sinks of the query heads this rank holds after the all-to-all (None: none)."""
        if c.sinks is None:
            return None
        h = c.heads // c.ulysses
        return c.sinks[c.ulysses_rank * h:(c.ulysses_rank + 1) * h]

    def __call__(self, q, k, v, c):
        U, Hkv = c.ulysses, c.kv_heads
        if U > 1:
            if U > Hkv:
                k, v = self.repeat_kv(k, U // Hkv), self.repeat_kv(v, U // Hkv)
                c.tap("k.repeated", k)
                c.tap("v.repeated", v)
            q = c.tap("q.gathered", _SeqToHead.apply(q, self, c))
            k = c.tap("k.gathered", _SeqToHead.apply(k, self, c))
            v = c.tap("v.gathered", _SeqToHead.apply(v, self, c))
        out, lse = _Ring.apply(q, k, v, self.rank_sinks(c), self, c)
        c.tap("lse", lse)
        if U > 1:
            out = _HeadToSeq.apply(c.tap("out.attn", out), self, c)
        return out


attention = ZigzagRingAttention()

"""Broken variants of python/examples/zigzag_ring_attention.py: each overrides one step with a
mistake SP authors have made (the broken jobs of tests/jobs/sp_jobs.py, as user code).
`make(name)` returns the per-rank function; `VARIANTS` lists them with the mistake in words."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "python", "examples"))
import zigzag_ring_attention as zra  # noqa: E402


class NoKvRepeat(zra.ZigzagRingAttention):
    """KV heads not repeated when U > Hkv: the all-to-all splits what is there."""

    def repeat_kv(self, x, rep):
        return x


class BlockwiseRepeat(zra.ZigzagRingAttention):
    """KV heads tiled (repeat) instead of interleaved (repeat_interleave)."""

    def repeat_kv(self, x, rep):
        return x.repeat(1, rep, 1)


class A2aWrongDims(zra.ZigzagRingAttention):
    """all_to_all_single on the token-major buffer: splits the sequence, not the heads."""

    def seq_to_head(self, x, c):
        U = c.ulysses
        s, hh, d = x.shape
        return self.all_to_all(x.contiguous(), c).reshape(U * s, hh // U, d)

    def head_to_seq(self, y, c):
        U = c.ulysses
        n, h, d = y.shape
        return self.all_to_all(y.contiguous(), c).reshape(n // U, U * h, d)


class LocalCu(zra.ZigzagRingAttention):
    """cu_seqlens of the ring from the gathered rows' position ids (a document starts where
    the position is 0): zigzag chunks of neighbouring documents merge."""

    def ring_cu(self, c):
        pos = [c.global_position_ids[t] for t in c.ring_tokens]
        return sorted(set([0, len(pos)] + [i for i, p in enumerate(pos) if p == 0]))


class ZigzagSwapped(zra.ZigzagRingAttention):
    """Takes each local document as [late chunk | early chunk]."""

    def doc_and_half(self, c, n):
        doc, late = super().doc_and_half(c, n)
        return doc, ~late


class NoScale(zra.ZigzagRingAttention):
    """Softmax scale 1 instead of 1/sqrt(head_dim)."""

    def scale(self, c):
        return 1.0


class LseMergeNoMax(zra.ZigzagRingAttention):
    """Ring merge through exp(lse) in bfloat16, without subtracting the max."""

    def merge(self, out, lse, bout, blse):
        lp = torch.bfloat16
        ea, eb = torch.exp(lse.to(lp)), torch.exp(blse.to(lp))
        tot = ea + eb
        o = (ea.transpose(0, 1)[..., None] * out.to(lp) + eb.transpose(0, 1)[..., None] *
             bout.to(lp)) / tot.transpose(0, 1)[..., None]
        return o.to(out.dtype), torch.log(tot).to(lse.dtype)


class RingSrcOffByOne(zra.ZigzagRingAttention):
    """Section chosen for source (r − i + 1) mod R while holding the KV of (r − i) mod R."""

    def section(self, r, src):
        if src != r:
            src = (src + 1) % self._ring
        return super().section(r, src)

    def __call__(self, q, k, v, c):
        self._ring = c.ring
        return super().__call__(q, k, v, c)


class _RepeatKeepFirst(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rep):
        ctx.rep = rep
        return x.repeat_interleave(rep, dim=1)

    @staticmethod
    def backward(ctx, g):
        s, hr, d = g.shape
        return g.reshape(s, hr // ctx.rep, ctx.rep, d)[:, :, 0].contiguous(), None


class KvGradNotSummed(zra.ZigzagRingAttention):
    """The KV repeat's backward keeps the first copy's gradient instead of summing them."""

    def repeat_kv(self, x, rep):
        return _RepeatKeepFirst.apply(x, rep)


class NoCausal(zra.ZigzagRingAttention):
    """No causal mask inside the own block."""

    def mask(self, kind, c, n, src=None):
        if kind == "diag":
            doc, _ = self.doc_and_half(c, n)
            return doc[:, None] == doc[None, :]
        return super().mask(kind, c, n, src)


# ---- today's attention options (docs/attention.md): the mistakes made with them in public

class SinksDropped(zra.ZigzagRingAttention):
    """The sinks never enter the softmax (a wrapper that swallows the keyword)."""

    def fold_sinks(self, out, lse, sinks):
        return out, lse


class SinksFirstSlice(zra.ZigzagRingAttention):
    """Every Ulysses rank takes the first H/U sinks: the full [H] sinks read by the rank's local
    head index (a wrapper handing every head's sinks to a kernel that indexes them)."""

    def rank_sinks(self, c):
        return None if c.sinks is None else c.sinks[:c.heads // c.ulysses]


class SinksNegated(zra.ZigzagRingAttention):
    """The sinks enter the softmax with the wrong sign."""

    def rank_sinks(self, c):
        s = super().rank_sinks(c)
        return None if s is None else -s


class SinkPerStep(zra.ZigzagRingAttention):
    """The sinks folded into every ring step's block before the merge, not once after it."""

    def ring_forward(self, q, k, v, sinks, c):
        self._sinks = sinks
        out, lse = super().ring_forward(q, k, v, None, c)
        self._sinks = None
        return out, lse

    def block(self, q, k, v, mask, c):
        out, lse = super().block(q, k, v, mask, c)
        return self.fold_sinks(out, lse, getattr(self, "_sinks", None))


class WindowOffByOne(zra.ZigzagRingAttention):
    """transformers' sliding_window W passed as flash-attn's left = W (not W − 1)."""

    def window(self, c):
        back, ahead = super().window(c)
        return back + 1 if back >= 0 else back, ahead


class PositionsInRankOrder(zra.ZigzagRingAttention):
    """Windows and chunks measured in the order the rank holds its rows (its block's own row
    index), not in the documents' positions: chunk boundaries fall per rank."""

    def positions(self, c, ring_rank):
        return torch.arange(len(c.ring_tokens_of[ring_rank]))


class PositionsRebuiltLocally(zra.ZigzagRingAttention):
    """Position ids rebuilt on the rank, counted from each document's first row among the rows
    it holds (a zigzag rank's two chunks of a document as one run): chunk boundaries fall per
    rank."""

    def positions(self, c, ring_rank):
        cu = torch.tensor(self.ring_cu(c))
        i = torch.arange(len(c.ring_tokens_of[ring_rank]))
        return i - cu[torch.searchsorted(cu[1:], i, right=True)]


class SoftcapWithoutScale(zra.ZigzagRingAttention):
    """Capping of the unscaled score, then scaled: scale·cap·tanh(q·k/cap)."""

    def scores(self, q, k, c):
        s = torch.einsum("nhd,mhd->hnm", q, k)
        if c.softcap > 0:
            s = c.softcap * torch.tanh(s / c.softcap)
        return s * self.scale(c)


class SoftcapAfterMask(zra.ZigzagRingAttention):
    """The mask added to the scores before the capping: a hidden key scores cap·tanh(−∞) = −cap
    instead of −∞ and keeps a weight."""

    def block(self, q, k, v, mask, c):
        if c.softcap <= 0:
            return super().block(q, k, v, mask, c)
        h, hk = q.shape[1], k.shape[1]
        if h != hk:
            k, v = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
        s = (torch.einsum("nhd,mhd->hnm", q, k) * self.scale(c)).masked_fill(~mask, float("-inf"))
        s = c.softcap * torch.tanh(s / c.softcap)
        lse = torch.logsumexp(s, -1)
        return torch.einsum("hnm,mhd->nhd", torch.exp(s - lse[..., None]), v), lse


class SinkSigmoidLseKept(zra.ZigzagRingAttention):
    """The sink as out·sigmoid(lse − sink), the LSE left as it was."""

    def fold_sinks(self, out, lse, sinks):
        folded, _ = super().fold_sinks(out, lse, sinks)
        return folded, lse


class CausalLeftIn(zra.ZigzagRingAttention):
    """A bidirectional layer run with the causal ring's sections (its mask left in)."""

    def mask(self, kind, c, n, src=None):
        class Causal(object):
            def __getattr__(self, name):
                return True if name == "causal" else getattr(c, name)
        return super().mask(kind, Causal(), n, src)


class WindowPerCall(zra.ZigzagRingAttention):
    """The window measured in each step's call, as a kernel given no position ids measures it
    (flash-attn's window_size on each section's rows): a query counted from the first query row
    of its document in the call and aligned to the call's last key row, a key from the first
    key row of its document in the call."""

    def mask(self, kind, c, n, src=None):
        class NoWindow(object):
            def __getattr__(self, name):
                return -1 if name in ("window_back", "window_ahead") else getattr(c, name)
        m = super().mask(kind, NoWindow(), n, src)
        if c.window_back < 0 and c.window_ahead < 0:
            return m
        cu = torch.tensor(self.ring_cu(c))
        i = torch.arange(n)
        doc = torch.searchsorted(cu[1:], i, right=True)
        start, length = cu[doc], cu[doc + 1] - cu[doc]
        half = length // 2
        q, lq, lk = i - start, length, length
        if c.causal and kind == "lower":  # every query row, the early half of the keys
            lk = half
        elif c.causal and kind == "upper":  # the late half of the query rows, every key
            q, lq = i - start - half, length - half
        p = (q + lk - lq)[:, None]
        k = (i - start)[None, :]
        if c.window_back >= 0:
            m = m & (p - k <= c.window_back)
        if c.window_ahead >= 0:
            m = m & (k - p <= c.window_ahead)
        return m


class WindowLeftOnly(zra.ZigzagRingAttention):
    """A bidirectional window passed on its left side only (the keys ahead unbounded)."""

    def window(self, c):
        return c.window_back, -1


class WindowSymmetric(zra.ZigzagRingAttention):
    """A bidirectional window's right side taken equal to its left (flash-attn's window_size
    given as (left, left))."""

    def window(self, c):
        back, ahead = super().window(c)
        return back, (back if ahead >= 0 else ahead)


class WindowRightOnly(zra.ZigzagRingAttention):
    """A bidirectional window passed on its right side only (the keys back unbounded)."""

    def window(self, c):
        return -1, c.window_ahead


class WindowSymmetricRight(zra.ZigzagRingAttention):
    """A bidirectional window's left side taken equal to its right."""

    def window(self, c):
        back, ahead = super().window(c)
        return (ahead if back >= 0 else back), ahead


class DocMaskOffDiagonal(zra.ZigzagRingAttention):
    """The document mask on the own (diagonal) block only: the lower and upper sections attend
    across document boundaries (their halves and windows as before), forward and backward."""

    one_doc = False

    def mask(self, kind, c, n, src=None):
        self.one_doc = kind != "diag" and c.causal
        try:
            return super().mask(kind, c, n, src)
        finally:
            self.one_doc = False

    def doc_and_half(self, c, n):
        doc, late = super().doc_and_half(c, n)
        return (torch.zeros_like(doc) if self.one_doc else doc), late


class WholeBlocks(zra.ZigzagRingAttention):
    """A plain whole-block ring, any layout: every step computes the rank's rows against the
    whole KV block, masked by the tokens' global order, their documents and the window and chunk
    by document positions (no sections)."""

    def docs_masked(self, c, src):
        return True

    def mask(self, kind, c, n, src=None):
        cu = torch.tensor(c.cu_seqlens)
        tq = torch.tensor(c.ring_tokens_of[c.ring_rank])
        tk = torch.tensor(c.ring_tokens_of[src])
        m = torch.ones(len(tq), len(tk), dtype=torch.bool)
        if self.docs_masked(c, src):
            m &= (torch.searchsorted(cu[1:], tq, right=True)[:, None] ==
                  torch.searchsorted(cu[1:], tk, right=True)[None, :])
        if c.causal:
            m &= tk[None, :] <= tq[:, None]
        # The window and chunk by the tokens' document positions.
        p = self.positions(c, c.ring_rank)[:, None]
        k = self.positions(c, src)[None, :]
        back, ahead = self.window(c)
        if back >= 0:
            m &= p - k <= back
        if ahead >= 0:
            m &= k - p <= ahead
        if c.chunk > 0:
            m &= torch.div(p, c.chunk, rounding_mode="floor") == torch.div(
                k, c.chunk, rounding_mode="floor")
        return m


class WholeBlocksDocMaskOffDiagonal(WholeBlocks):
    """The whole-block ring with its document mask on the own block only."""

    def docs_masked(self, c, src):
        return src == c.ring_rank


class WholeBlocksDocMaskOffDiagonalBackward(WholeBlocks):
    """The whole-block ring whose backward alone drops the document mask off the own block
    (its forward right)."""

    backward = False

    def docs_masked(self, c, src):
        return src == c.ring_rank or not self.backward

    def ring_backward(self, *args):
        self.backward = True
        try:
            return super().ring_backward(*args)
        finally:
            self.backward = False


VARIANTS = {
    "no_kv_repeat": NoKvRepeat,
    "blockwise_repeat": BlockwiseRepeat,
    "a2a_wrong_dims": A2aWrongDims,
    "local_cu": LocalCu,
    "zigzag_swapped": ZigzagSwapped,
    "no_scale": NoScale,
    "lse_merge_no_max": LseMergeNoMax,
    "ring_src_off_by_one": RingSrcOffByOne,
    "kv_grad_not_summed": KvGradNotSummed,
    "no_causal": NoCausal,
    "sinks_dropped": SinksDropped,
    "sink_per_step": SinkPerStep,
    "sinks_first_slice": SinksFirstSlice,
    "sinks_negated": SinksNegated,
    "window_off_by_one": WindowOffByOne,
    "positions_in_rank_order": PositionsInRankOrder,
    "softcap_without_scale": SoftcapWithoutScale,
    "causal_left_in": CausalLeftIn,
    "softcap_after_mask": SoftcapAfterMask,
    "sink_sigmoid_lse_kept": SinkSigmoidLseKept,
    "positions_rebuilt_locally": PositionsRebuiltLocally,
    "window_per_call": WindowPerCall,
    "window_left_only": WindowLeftOnly,
    "window_right_only": WindowRightOnly,
    "window_symmetric_right": WindowSymmetricRight,
    "window_symmetric": WindowSymmetric,
    "docmask_off_diagonal": DocMaskOffDiagonal,
    "whole_blocks": WholeBlocks,
    "whole_blocks_docmask_off_diagonal": WholeBlocksDocMaskOffDiagonal,
    "whole_blocks_docmask_off_diagonal_backward": WholeBlocksDocMaskOffDiagonalBackward,
}


def make(name):
    return VARIANTS[name]()


"""What the user's `attention(q, k, v, ctx)` receives as ctx, and the data of an example."""
import math

import torch

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}

# Stages a user may tap besides the ones the harness taps itself (docs/dump_format.md).
TAPPABLE = ("k.repeated", "v.repeated", "q.gathered", "k.gathered", "v.gathered", "out.attn",
            "lse")


def _cu_of(doc_ids):
    """cu_seqlens of a token list whose documents are given per token (a new document starts
    wherever the document id changes)."""
    cu = [0]
    for i in range(1, len(doc_ids)):
        if doc_ids[i] != doc_ids[i - 1]:
            cu.append(i)
    cu.append(len(doc_ids))
    return cu


class AttentionContext(object):
    """Everything one rank's attention needs besides q, k, v.

    Groups: `ulysses_group` (the U ranks that exchange heads; cp ranks ring_rank·U + 0..U-1),
    `ring_group` (the R ranks of the ring; cp ranks u + U·0..R-1), `cp_group` (all U·R ranks).
    Each is a torch.distributed process group (a group of one where that degree is 1);
    `ulysses_ranks` / `ring_ranks` are their members' global ranks in group order.

    Tokens: `tokens` (the global indices of this rank's s_local rows), `ring_tokens` (the tokens
    of this rank's ring rank: what the Ulysses all-to-all gathers, in gathered order),
    `position_ids` (local), `cu_seqlens` (the global packed row's documents; SP padding is a
    document of its own), `cu_seqlens_local` (documents of this rank's own rows, split where the
    document changes), `cu_seqlens_ring` (documents of the gathered ring-rank rows: zigzag gives
    cu_seqlens // ring), `max_seqlen` (longest global document).
    """

    def __init__(self, scn, lay, rank, groups, dumper):
        U, R = scn.ulysses, scn.ring
        self.scenario = scn
        self.rank = rank
        self.world_size = U * R
        self.ulysses = U
        self.ring = R
        self.cp_size = U * R
        self.ulysses_rank = rank % U
        self.ring_rank = rank // U
        self.cp_rank = rank
        self.ulysses_group, self.ring_group, self.cp_group = groups
        self.ulysses_ranks = [self.ring_rank * U + u for u in range(U)]
        self.ring_ranks = [self.ulysses_rank + U * j for j in range(R)]
        self.layout = scn.layout if R > 1 else "contiguous"
        self.zigzag = R > 1 and scn.layout == "zigzag"
        self.profile = scn.profile
        self.heads = scn.heads
        self.kv_heads = scn.kv_heads
        self.head_dim = scn.head_dim
        self.scale = 1.0 / math.sqrt(scn.head_dim)
        self.causal = scn.causal
        # The attention options (docs/attention.md), in the conventions kernels take them:
        # window_back / window_ahead: p − k ≤ back, k − p ≤ ahead (−1: no limit); window_size:
        # flash-attn's (left, right), −1 = unlimited (a causal call: right 0); sliding_window:
        # transformers' W (W keys, the query's own counted; None without a window); chunk: the
        # chunk length (0: none; chunks aligned to each document's start); softcap: cap·tanh(s/cap)
        # before the mask (0: none); sinks: a leaf tensor [H] (one logit per query head, the
        # scenario's dtype) whose gradient seqpar judges, or None.
        self.window_back = scn.window_back
        self.window_ahead = scn.window_ahead
        self.window_size = (scn.window_back, 0 if scn.causal else scn.window_ahead)
        self.sliding_window = (scn.window_back + 1 if scn.causal else scn.window_back) \
            if scn.window_back >= 0 else None
        self.chunk = scn.chunk
        self.softcap = scn.softcap
        self.sinks = None
        self.dtype = TORCH_DTYPES[scn.dtype]
        doc = lay.doc_of()
        pos = lay.positions()
        self.tokens = list(lay.rank_tokens[rank])
        self.ring_tokens = [t for u in range(U) for t in lay.rank_tokens[self.ring_rank * U + u]]
        # Every ring rank's gathered tokens (a block a ring step receives: ring_tokens_of[src]).
        self.ring_tokens_of = [[t for u in range(U) for t in lay.rank_tokens[j * U + u]]
                               for j in range(R)]
        self.position_ids = [pos[t] for t in self.tokens]
        self.global_position_ids = pos
        self.cu_seqlens = list(lay.cu_seqlens)
        self.cu_seqlens_local = _cu_of([doc[t] for t in self.tokens])
        self.cu_seqlens_ring = _cu_of([doc[t] for t in self.ring_tokens])
        self.max_seqlen = max(b - a for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]))
        self.padded_length = lay.padded_length
        self.original_length = lay.original_length
        self._dumper = dumper

    def tap(self, stage, t, layout=None):
        """Records an intermediate stage for seqpar to check (returns t unchanged): one of
        q/k/v.gathered [S_g, h, D] (after the pre-attention all-to-all), k/v.repeated
        [s, Hkv·rep, D], out.attn [S_g, h_q, D] (before the reverse all-to-all), lse [h_q, S_g].
        `layout` as in seqpar.dump (shd, bshd, bhsd, hsd; lse: hs, bhs, sh). Gradients of tapped
        tensors that require grad are recorded too."""
        if stage not in TAPPABLE:
            raise ValueError("ctx.tap: stage %r is not one seqpar checks; use one of %s" % (
                stage, ", ".join(TAPPABLE)))
        return self._dumper.tap(stage, t, layout=layout)

    def __repr__(self):
        return ("AttentionContext(rank=%d, ulysses %d/%d, ring %d/%d, %s, tokens=%s, "
                "cu_seqlens=%s)" % (self.rank, self.ulysses_rank, self.ulysses, self.ring_rank,
                                    self.ring, self.layout, self.tokens, self.cu_seqlens))


def global_inputs(scn, n):
    """The example's global q [n, H, D], k, v [n, Hkv, D] and the loss weight w [n, H, D] (the
    gradient arriving at the output), from the scenario's seed; in the scenario's dtype."""
    g = torch.Generator().manual_seed(0x5E9 + scn.seed)
    H, Hkv, D = scn.heads, scn.kv_heads, scn.head_dim
    q = torch.randn(n, H, D, generator=g) * scn.q_scale
    k = torch.randn(n, Hkv, D, generator=g)
    v = torch.randn(n, Hkv, D, generator=g)
    w = torch.randn(n, H, D, generator=g)
    dt = TORCH_DTYPES[scn.dtype]
    return q.to(dt), k.to(dt), v.to(dt), w.to(dt)


def global_sinks(scn):
    """The example's sink logits [H] in [0, 2) (a visible share of every row), from its seed."""
    g = torch.Generator().manual_seed(0x51C + scn.seed)
    return (2 * torch.rand(scn.heads, generator=g)).to(TORCH_DTYPES[scn.dtype])

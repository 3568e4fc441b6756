"""A whole SP training step under seqpar's property (seqpar.testing.check_step): a small decoder
whose attention gathers the SP group's keys and values (the context-parallel all-gather), a step
that shards the batch, takes the loss over the global batch and reduces the gradients — and the
classic step mistakes, each one keyword away:

    python3 -m seqpar.testing check-step "python/examples/sp_training_step.py:make_step()" \\
        --model python/examples/sp_training_step.py:TinyLM --seed 0
    python3 -m seqpar.testing check-step \\
        "python/examples/sp_training_step.py:make_step('shift_after_shard')" \\
        --model python/examples/sp_training_step.py:TinyLM --seed 0

The same step runs a Hugging Face model drawn down from its config (seqpar.testing.hf_model):
make_step(hf=True) calls the model as transformers does and registers `sp_gather_attention`
with transformers' AttentionInterface — the group's keys and values gathered, the document,
causal, sliding-window and chunk masks from the tokens' global indices and positions, the
layer's scaling, soft-capping and sinks — so Qwen3, Llama 4, gpt-oss and Gemma 3 layers run
their SP path through it:

    python3 -m seqpar.testing check-step "python/examples/sp_training_step.py:make_step(hf=True)" \
        --hf-config tests/python/data/hf_configs/qwen3-8b.json --seed 0

Mistakes (make_step(bug)): 'shift_after_shard' (labels shifted after sharding instead of
before: each shard's last token loses its target), 'local_denominator' (the loss summed over the
SP group but divided by the rank's own valid labels), 'dp_group_only' (gradients reduced over the
DP group only, so each SP rank keeps the part of its own tokens), 'mean_of_means' (each DP
replica's mean, the replicas' gradients averaged: wrong when their valid labels differ),
'local_positions' (RoPE from the shard's own positions 0..s-1), 'shift_twice' (the labels
shifted before sharding and again, each token given the target two ahead), 'count_padding' (the
denominator counts the batch's non-padding tokens, not its valid labels); with per-token loss
weights (check_step's loss_weights): 'weights_unshifted' (each target weighted by its input
token's weight), 'weights_unsharded' (each rank weighting its tokens by the row's first weights).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _GatherSeq(torch.autograd.Function):
    """all_gather along the sequence (dim 1) over a group; backward: every rank's gradient of
    the gathered tensor summed (all_reduce), this rank's slice kept."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.rank, ctx.n = dist.get_rank(group), n
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        s = g.shape[1] // ctx.n
        return g[:, ctx.rank * s:(ctx.rank + 1) * s], None


def _gather_plain(x, group):
    n = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def doc_ids(position_ids):
    """Per token the index of its document in the row (a new one wherever position_ids restart
    at 0)."""
    return torch.cumsum((position_ids == 0).long(), dim=-1)


class SpShard(object):
    """What the SP path needs in the model: the group, the global indices of the rank's tokens
    in the (padded) row and their document ids."""

    def __init__(self, group, tokens, docs, positions=None):
        self.group, self.tokens, self.docs, self.positions = group, tokens, docs, positions


def rope(x, pos):
    """Rotary embedding of x [B, s, H, D] at positions pos [B, s]."""
    D = x.shape[-1]
    half = D // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=x.dtype) / half))
    ang = pos.to(x.dtype)[..., None] * inv  # [B, s, half]
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., 2 * half:]], dim=-1)


class Block(nn.Module):
    def __init__(self, hidden, heads, mlp):
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        self.norm1 = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, mlp)
        self.down = nn.Linear(mlp, hidden)

    def forward(self, x, pos, docs, sp):
        B, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, s, 3, self.heads, self.dim).unbind(2)
        q, k = rope(q, pos), rope(k, pos)
        tok = torch.arange(s).expand(B, s) if sp is None else sp.tokens.expand(B, s)
        ktok, kdoc = tok, docs
        if sp is not None:  # the SP group's keys and values, in group order
            k, v = _GatherSeq.apply(k, sp.group), _GatherSeq.apply(v, sp.group)
            ktok, kdoc = _gather_plain(tok, sp.group), _gather_plain(docs, sp.group)
        sees = (kdoc[:, None, :] == docs[:, :, None]) & (ktok[:, None, :] <= tok[:, :, None])
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.dim ** 0.5
        scores = scores.masked_fill(~sees[:, None], float("-inf"))
        att = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(B, s, -1)
        x = x + self.o(att)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """A small decoder: embedding, `layers` pre-norm blocks (RoPE, causal attention within
    documents), a final norm, an untied head. forward(input_ids, position_ids, sp=None):
    without sp the whole row; with sp (SpShard) the rank's tokens, attending to the group's."""

    def __init__(self, vocab=40, hidden=16, heads=2, layers=2, mlp=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, mlp) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, position_ids, sp=None, docs=None):
        docs = doc_ids(position_ids) if docs is None else docs
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x, position_ids, docs, sp)
        return self.head(self.norm(x))


# -- the SP path of a transformers model: one attention function for every layer -------------

_SHARD = []  # the shard of the forward in progress (set by the step around the model's call)


def sp_gather_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention interface (query [B, H, s, D], key/value [B, Hkv, s, D] ->
    ([B, s, H, D], None)) for the rank's queries over the SP group's keys. The model's own mask
    (built from the rank's local rows) is not used: visibility comes from the global token
    indices, document ids and positions of the shard."""
    sh = _SHARD[-1]
    B, H, s, D = query.shape
    k = _GatherSeq.apply(key.transpose(1, 2), sh.group).transpose(1, 2)
    v = _GatherSeq.apply(value.transpose(1, 2), sh.group).transpose(1, 2)
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    tok = sh.tokens.expand(B, s)
    ktok, kdoc, kpos = (_gather_plain(t, sh.group) for t in (tok, sh.docs, sh.positions))
    sees = (kdoc[:, None, :] == sh.docs[:, :, None]) & (ktok[:, None, :] <= tok[:, :, None])
    cfg = getattr(module, "config", None)
    kind = None
    if cfg is not None and getattr(cfg, "layer_types", None) and hasattr(module, "layer_idx"):
        kind = cfg.layer_types[module.layer_idx]
    window = sliding_window or (getattr(cfg, "sliding_window", None)
                                if kind == "sliding_attention" else None)
    if window:  # transformers' W: W keys, the query's own counted
        sees &= (tok[:, :, None] - ktok[:, None, :]) < window
    if kind == "chunked_attention":  # Llama 4: chunks from each document's start (positions)
        c = cfg.attention_chunk_size
        sees &= (kpos[:, None, :] // c) == (sh.positions[:, :, None] // c)
    if scaling is None:
        scaling = D ** -0.5
    scores = torch.einsum("bhqd,bhkd->bhqk", query, k) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~sees[:, None], float("-inf"))
    if s_aux is not None:  # gpt-oss: one sink logit per head, a column dropped after the softmax
        sink = s_aux.reshape(1, H, 1, 1).expand(B, H, s, 1).to(scores.dtype)
        p = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        p = scores.softmax(-1)
    return torch.einsum("bhqk,bhkd->bqhd", p.to(v.dtype), v), None


def _use_sp_attention(model):
    from transformers import AttentionInterface
    AttentionInterface.register("seqpar_sp_gather", sp_gather_attention)
    if getattr(model.config, "_attn_implementation", None) != "seqpar_sp_gather":
        model.set_attn_implementation("seqpar_sp_gather")


def _shift(labels, ignore):
    out = torch.full_like(labels, ignore)
    out[:, :-1] = labels[:, 1:]
    return out


def _pad(t, n, value):
    return F.pad(t, (0, n - t.shape[1]), value=value)


def make_step(bug=None, hf=False):
    """The step as a trainer with SP would write it (bug=None), or with one classic mistake;
    hf=True: the model is a transformers causal LM (its SP path: sp_gather_attention)."""
    bugs = (None, "shift_after_shard", "local_denominator", "dp_group_only", "mean_of_means",
            "local_positions", "shift_twice", "count_padding", "weights_unshifted",
            "weights_unsharded")
    if bug not in bugs:
        raise ValueError("make_step: bug %r; one of %s" % (bug, bugs))

    def step(model, batches, ctx):
        ig = ctx.ignore_index
        dt = torch.float64 if ctx.dtype == torch.float64 else torch.float32
        # Shift before sharding: a shard's last token keeps the target held by the next shard.
        shifted = [b["labels"] if bug == "shift_after_shard" else _shift(b["labels"], ig)
                   for b in batches]
        if bug == "shift_twice":
            shifted = [_shift(y, ig) for y in shifted]
        local = []
        for b, lab in zip(batches, shifted):
            L = b["input_ids"].shape[1]
            P = ctx.padded_length(L)
            idx = torch.tensor(ctx.shard_indices(L))
            ids = _pad(b["input_ids"], P, 0)[:, idx]
            pos = _pad(b["position_ids"], P, 0)
            docs = _pad(doc_ids(b["position_ids"]), P, -1)[:, idx]
            pos = (torch.arange(len(idx)).expand_as(ids) if bug == "local_positions"
                   else pos[:, idx])
            y = _pad(lab, P, ig)[:, idx]
            if bug == "shift_after_shard":
                y = _shift(y, ig)
            wl = None
            if "loss_weights" in b:   # label t's weight: shifted and sharded with the labels
                w = b["loss_weights"] if bug == "weights_unshifted" else _shift(
                    b["loss_weights"], 0.0)
                w = _pad(w, P, 0.0)
                wl = w[:, :len(idx)] if bug == "weights_unsharded" else w[:, idx]
            local.append((ids, pos, docs, y, idx, wl))
        # The loss's denominator: the valid shifted labels of the global batch.
        n_rank = torch.tensor(float(sum(int((y != ig).sum()) for *_, y, _, _ in local)),
                              dtype=dt)
        if bug == "count_padding":  # the shard's tokens that are not padding (id 0)
            n_rank = torch.tensor(float(sum(int((ids != 0).sum()) for ids, *_ in local)),
                                  dtype=dt)
        n_replica = n_rank.clone()
        dist.all_reduce(n_replica, group=ctx.sp_group)
        n = n_replica.clone()
        if bug != "mean_of_means":
            dist.all_reduce(n, group=ctx.dp_group)
        if bug == "local_denominator":
            n = n_rank
        total = torch.zeros((), dtype=dt)
        if hf:
            _use_sp_attention(model)
        for ids, pos, docs, y, idx, wl in local:
            shard = SpShard(ctx.sp_group, idx, docs, pos)
            if hf:
                _SHARD.append(shard)
                try:
                    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
                finally:
                    _SHARD.pop()
            else:
                logits = model(ids, pos, sp=shard, docs=docs)
            s = F.cross_entropy(logits.flatten(0, 1).to(dt), y.flatten(), ignore_index=ig,
                                reduction="none" if wl is not None else "sum")
            if wl is not None:   # Σ weight · token loss (ignored labels' losses are 0)
                s = (s * wl.flatten().to(dt)).sum()
            (s / n if float(n) else s * 0).backward()
            total = total + s.detach()
        # Each rank holds the gradient of its own tokens' share of the global mean: summed over
        # every rank (SP and DP). mean_of_means: the replicas' gradients averaged instead.
        group = ctx.dp_group if bug == "dp_group_only" else ctx.world_group
        for p in model.parameters():
            if p.grad is not None:
                if bug == "mean_of_means":
                    dist.all_reduce(p.grad, group=ctx.sp_group)
                    dist.all_reduce(p.grad, group=ctx.dp_group)
                    p.grad /= ctx.dp_size
                else:
                    dist.all_reduce(p.grad, group=group)
        logged = total.clone()
        dist.all_reduce(logged, group=ctx.sp_group)
        if bug == "mean_of_means":  # each replica's mean, averaged over DP
            logged = logged / n
            dist.all_reduce(logged, group=ctx.dp_group)
            return logged / ctx.dp_size
        if bug != "local_denominator":
            dist.all_reduce(logged, group=ctx.dp_group)
        return logged / n if float(n) else logged

    step.__name__ = "step" if bug is None else "step_" + bug
    return step

"""A whole SP training step under the property: the user's step (sharding, forward through their
SP path, loss, backward, gradient reduction) on DP × SP gloo ranks against the same model without
SP, in float64 on one process, with transformers' causal-LM loss semantics.

The user gives a model factory (called with torch's RNG seeded the same way on every rank and for
the reference, so every copy has the same weights) and a step::

    def step(model, batches, ctx):    # batches: this DP rank's micro-batches, as the dataloader
        ...                           # yields them before SP; shard, forward, loss, backward,
        return loss                   # reduce gradients as the trainer does; the logged loss

seqpar draws the global batch (packed documents, 1-token ones, prompt-masked spans, all-masked
documents, padding, lengths that need SP padding), the layout (DP × Ulysses × ring, zigzag or
contiguous), unequal valid tokens per DP rank and gradient accumulation, runs the step on every
rank and judges, on every rank, the returned loss and every parameter's gradient against the
reference: the gradient of (sum of the token losses over every valid shifted label of the global
batch) / (their count), all in float64.
"""
import math
import os
import time

import torch

IGNORE_INDEX = -100
F64_TOLERANCE = 1e-10  # relative, normwise: SP and non-SP differ only in summation order


# -- the scenario and its batch -------------------------------------------------------------

class StepScenario(object):
    """One drawn example. rows[d][m] is DP rank d's micro-batch m: a list of rows, each a list of
    documents (length, prompt tokens: the first `prompt` tokens' labels are -100; prompt ≥
    length masks the whole document). A micro-batch's rows are padded to its longest row.
    weights: every micro-batch carries per-token loss weights (make_batch's loss_weights)."""

    FIELDS = ("dp", "ulysses", "ring", "layout", "dtype", "rows", "seed", "weights")

    def __init__(self, dp=1, ulysses=1, ring=1, layout="zigzag", dtype="f64", rows=None,
                 seed=0, weights=False):
        self.dp, self.ulysses, self.ring = int(dp), int(ulysses), int(ring)
        self.layout = layout if self.ring > 1 else "contiguous"
        self.dtype = dtype
        self.rows = rows if rows is not None else [[[[4, 1]]]]
        self.seed = int(seed)
        self.weights = bool(weights)

    @property
    def sp(self):
        return self.ulysses * self.ring

    @property
    def world(self):
        return self.dp * self.sp

    @property
    def accumulation(self):
        return len(self.rows[0])

    def to_json(self):
        import json
        return json.dumps({k: getattr(self, k) for k in self.FIELDS}, separators=(",", ":"))

    @staticmethod
    def from_json(text):
        import json
        d = json.loads(text) if isinstance(text, str) else dict(text)
        unknown = sorted(set(d) - set(StepScenario.FIELDS))
        if unknown:
            raise ValueError("step scenario: unknown fields %s (known: %s)" % (
                ", ".join(unknown), ", ".join(StepScenario.FIELDS)))
        s = StepScenario(**d)
        s.validate()
        return s

    def validate(self):
        if min(self.dp, self.ulysses, self.ring) < 1:
            raise ValueError("step scenario: dp=%d ulysses=%d ring=%d; each must be ≥ 1" % (
                self.dp, self.ulysses, self.ring))
        if self.dtype not in ("f64", "f32"):
            raise ValueError("step scenario: dtype %r; f64 or f32" % self.dtype)
        if self.layout not in ("zigzag", "contiguous"):
            raise ValueError("step scenario: layout %r; zigzag or contiguous" % self.layout)
        if len(self.rows) != self.dp or len({len(m) for m in self.rows}) != 1:
            raise ValueError("step scenario: rows must hold dp=%d lists of the same number of "
                             "micro-batches (got %s)" % (self.dp, [len(m) for m in self.rows]))
        for d, mbs in enumerate(self.rows):
            for m, mb in enumerate(mbs):
                if not mb or any(not row or any(len(doc) != 2 or doc[0] < 1 or doc[1] < 0
                                                for doc in row) for row in mb):
                    raise ValueError("step scenario: DP rank %d micro-batch %d: every row needs "
                                     "documents [length ≥ 1, prompt ≥ 0] (got %s)" % (d, m, mb))

    def describe(self):
        toks = [[sum(doc[0] for doc in row) for row in mb] for mbs in self.rows for mb in mbs]
        return ("dp %d × ulysses %d × ring %d %s (world %d), %d micro-batch%s per DP rank, row "
                "lengths %s, %s%s, seed %d" % (
                    self.dp, self.ulysses, self.ring, self.layout, self.world, self.accumulation,
                    "" if self.accumulation == 1 else "es", toks, self.dtype,
                    ", per-token loss weights" if self.weights else "", self.seed))


TORCH_DTYPES = {"f64": torch.float64, "f32": torch.float32}


WEIGHTS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0)   # per-token loss weights: exact in every dtype


def make_batch(rows, vocab, seed, pad_id=0, weights=False):
    """A micro-batch as a dataloader yields it before SP: input_ids, labels, position_ids [B, L]
    (long). Documents are packed along a row with position_ids restarting at 0 at each (the
    flattening collator's convention); a document's first label and its prompt tokens' labels are
    -100 (so no target crosses a document boundary after the shift); a row shorter than the
    longest is padded with pad_id tokens, labels -100 and position_ids of their own run from 0.
    weights: also loss_weights [B, L] (float64), aligned with the labels as ms-swift's loss_scale
    is: the weight of label t (the target of token t − 1 after the shift), drawn from WEIGHTS;
    the loss is Σ weight·token loss over the valid shifted labels / their count."""
    g = torch.Generator().manual_seed(0x57E9 + seed)
    L = max(sum(doc[0] for doc in row) for row in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), L), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros((len(rows), L), dtype=torch.long)
    for b, row in enumerate(rows):
        t = 0
        for n, prompt in row:
            ids[b, t:t + n] = torch.randint(1, vocab, (n,), generator=g)
            labels[b, t:t + n] = ids[b, t:t + n]
            labels[b, t:t + min(n, max(prompt, 1))] = IGNORE_INDEX
            pos[b, t:t + n] = torch.arange(n)
            t += n
        pos[b, t:] = torch.arange(L - t)
    out = {"input_ids": ids, "labels": labels, "position_ids": pos}
    if weights:   # a generator of their own: the tokens are those of the unweighted batch
        gw = torch.Generator().manual_seed(0x3E1D + seed)
        pick = torch.randint(0, len(WEIGHTS), (len(rows), L), generator=gw)
        out["loss_weights"] = torch.tensor(WEIGHTS, dtype=torch.float64)[pick]
    return out


def batches_of(scn, vocab):
    """[d][m]: DP rank d's micro-batch m."""
    return [[make_batch(mb, vocab, scn.seed * 1009 + d * 31 + m, weights=scn.weights)
             for m, mb in enumerate(mbs)] for d, mbs in enumerate(scn.rows)]


def _shift(t, fill):
    """Each row's t[:, 1:] moved one position to the left, the last position `fill`."""
    out = torch.full_like(t, fill)
    out[:, :-1] = t[:, 1:]
    return out


def shift_weights(weights):
    """The weight of each token's target: weights[t + 1] of its row (0 for a row's last)."""
    return _shift(weights, 0.0)


def shift_labels(labels):
    """transformers' shift: the target of token t is labels[t + 1] of its row; the last token
    of a row has none (-100)."""
    return _shift(labels, IGNORE_INDEX)


# -- what the step gets ---------------------------------------------------------------------

class StepContext(object):
    """Everything one rank's step needs besides the model and its batches.

    Ranks: world rank = dp_rank · sp_size + sp_rank, sp_rank = ring_rank · ulysses +
    ulysses_rank. Groups (torch.distributed process groups; a group of one where the degree is
    1): `dp_group` (the ranks with this sp_rank in every DP replica: a replicated parameter's
    gradient is reduced here by a pure-DP trainer), `sp_group` (this replica's U·R ranks, which
    share one micro-batch), `ulysses_group`, `ring_group`, `world_group`; `dp_ranks`, `sp_ranks`
    their members' world ranks in group order.

    Layout (what the trainer is asked to do; the step shards the batch itself): `layout` is
    'zigzag' (the row padded to a multiple of 2·sp_size, cut into 2·sp_size chunks, SP rank s
    holding chunks s and 2·sp_size − 1 − s) or 'contiguous' (padded to a multiple of sp_size,
    rank s holding the s-th of sp_size equal parts); `shard_indices(L)` gives those token
    indices. `accumulation` micro-batches per DP rank; `ignore_index` = -100.

    Gradients: seqpar judges each parameter's `.grad` after the step, or, where the step sets
    `ctx.grads` = {parameter name: full gradient}, those: the hook of a sharded optimizer whose
    parameters hold a shard only (DeepSpeed ZeRO 3: safe_get_full_grad; FSDP2: full_tensor()).
    """

    def __init__(self, scn, rank, groups):
        self.scenario = scn
        self.grads = None
        self.rank = rank
        self.world_size = scn.world
        self.dp_size, self.sp_size = scn.dp, scn.sp
        self.ulysses, self.ring = scn.ulysses, scn.ring
        self.dp_rank, self.sp_rank = divmod(rank, scn.sp)
        self.ring_rank, self.ulysses_rank = divmod(self.sp_rank, scn.ulysses)
        self.dp_ranks = [d * scn.sp + self.sp_rank for d in range(scn.dp)]
        self.sp_ranks = [self.dp_rank * scn.sp + s for s in range(scn.sp)]
        (self.world_group, self.dp_group, self.sp_group, self.ulysses_group,
         self.ring_group) = groups
        self.layout = scn.layout
        self.zigzag = scn.layout == "zigzag" and scn.sp > 1
        self.dtype = TORCH_DTYPES[scn.dtype]
        self.accumulation = scn.accumulation
        self.ignore_index = IGNORE_INDEX

    def padded_length(self, length):
        m = self.sp_size * (2 if self.zigzag else 1)
        return -(-length // m) * m

    def shard_indices(self, length, sp_rank=None):
        return shard_indices(self.padded_length(length), self.sp_size,
                             self.sp_rank if sp_rank is None else sp_rank, self.zigzag)

    def __repr__(self):
        return ("StepContext(rank=%d, dp %d/%d, sp %d/%d (ulysses %d/%d, ring %d/%d), %s)" % (
            self.rank, self.dp_rank, self.dp_size, self.sp_rank, self.sp_size, self.ulysses_rank,
            self.ulysses, self.ring_rank, self.ring, self.layout))


def shard_indices(padded, sp, s, zigzag):
    if zigzag:
        c = padded // (2 * sp)
        return list(range(s * c, (s + 1) * c)) + list(range((2 * sp - 1 - s) * c,
                                                             (2 * sp - s) * c))
    c = padded // sp
    return list(range(s * c, (s + 1) * c))


def make_groups(scn, cache):
    """(world, dp, sp, ulysses, ring) groups of every rank; each created by every rank in the
    same order (torch.distributed.new_group is collective over the world)."""
    import torch.distributed as dist
    key = (scn.dp, scn.ulysses, scn.ring)
    if key not in cache:
        D, U, R, P = scn.dp, scn.ulysses, scn.ring, scn.sp
        dp = [dist.new_group([d * P + s for d in range(D)]) for s in range(P)]
        sp = [dist.new_group([d * P + s for s in range(P)]) for d in range(D)]
        ul = [dist.new_group([d * P + r * U + u for u in range(U)])
              for d in range(D) for r in range(R)]
        ri = [dist.new_group([d * P + r * U + u for r in range(R)])
              for d in range(D) for u in range(U)]
        cache[key] = (dp, sp, ul, ri)
    dp, sp, ul, ri = cache[key]
    return dp, sp, ul, ri


def groups_of(scn, rank, cache):
    import torch.distributed as dist
    dp, sp, ul, ri = make_groups(scn, cache)
    d, s = divmod(rank, scn.sp)
    r, u = divmod(s, scn.ulysses)
    return (dist.group.WORLD, dp[s], sp[d], ul[d * scn.ring + r], ri[d * scn.ulysses + u])


# -- the model ------------------------------------------------------------------------------

def build_model(factory, seed, dtype):
    """The factory's model with torch's RNG seeded by `seed`, in `dtype`."""
    torch.manual_seed(0xD0E + seed)
    m = factory()
    if not isinstance(m, torch.nn.Module):
        raise TypeError("the model factory returned %s, not a torch.nn.Module" %
                        type(m).__name__)
    return m.to(dtype)


def vocab_of(model):
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        embs = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
        if not embs:
            raise ValueError("the model has no torch.nn.Embedding (nor get_input_embeddings()): "
                             "seqpar cannot tell its vocabulary size; give vocab=")
        emb = embs[0]
    return emb.num_embeddings


def weights_digest(model):
    """A float64 sum over every parameter: equal on every rank when the weights are."""
    with torch.no_grad():
        return [float(p.double().sum()) for _, p in model.named_parameters()]


def default_forward(model, batch):
    """model(input_ids=, position_ids=), its .logits when it has them. A transformers model is
    called with use_cache=False: only without a cache does transformers read packed documents
    from position_ids (masking_utils: with a cache the packed row is one causal sequence)."""
    kw = {}
    if hasattr(model, "config") and hasattr(model, "get_input_embeddings"):
        kw["use_cache"] = False
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **kw)
    return getattr(out, "logits", out)


def documents_of(position_ids):
    """[(start, end)] of a row's documents: a new one wherever position_ids restart at 0."""
    starts = [i for i, p in enumerate(position_ids.tolist()) if p == 0 or i == 0]
    return list(zip(starts, starts[1:] + [len(position_ids)]))


def by_document(model, batch, forward, vocab):
    """The logits [B, L, V] of a micro-batch with every document run as a sequence of its own:
    what a packed row must give (the flattening collator's promise), whatever the model's own
    code does with packed position_ids (transformers 5.9's gpt-oss mask, for one, ignores them)."""
    ids, pos = batch["input_ids"], batch["position_ids"]
    rows = []
    for b in range(ids.shape[0]):
        parts = []
        for a, e in documents_of(pos[b]):
            doc = {"input_ids": ids[b:b + 1, a:e], "position_ids": pos[b:b + 1, a:e]}
            logits = forward(model, doc)
            if tuple(logits.shape) != (1, e - a, vocab):
                raise ValueError("the reference forward returned logits of shape %s for "
                                 "input_ids [1, %d]; want [B, L, vocab=%d]" % (
                                     list(logits.shape), e - a, vocab))
            parts.append(logits[0])
        rows.append(torch.cat(parts, dim=0))
    return torch.stack(rows)


# -- where the forward departs: each layer's hidden states, summed over tokens ----------------

FP_STAGES = ("input", "attention output", "output")


def _decoder_layers(model):
    """The model's decoder layers: the first ModuleList whose every element has an attention
    submodule (self_attn, attn or attention), else the first ModuleList of one class (a
    model's own blocks); None when there is none."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    for mod in lists:
        if all(_attention_of(x) is not None for x in mod):
            return mod
    for mod in lists:
        if len({type(x) for x in mod}) == 1:
            return mod
    return None


def _attention_of(layer):
    for name in ("self_attn", "attn", "attention"):
        sub = getattr(layer, name, None)
        if isinstance(sub, torch.nn.Module):
            return sub
    return None


class Fingerprints(object):
    """Per (layer, stage): the sum over the non-padding token rows (input id ≠ 0) of the hidden
    states entering the layer, leaving its attention and leaving the layer, and the number of
    rows summed. The sums do not depend on how the rows are laid out — any SP layout's shards,
    summed over the ranks, and the reference's documents run one by one give the same means —
    so where the forward departs is found without knowing the step's layout. The hooks are
    plain functions (a deepcopy of the model keeps feeding the same sums). The row mask comes
    from the input embedding's last call: the ids that reach the layers, after any SP split."""

    def __init__(self, model):
        self.sums, self.counts, self.handles = {}, {}, []
        layers = _decoder_layers(model)
        emb = None
        try:
            emb = model.get_input_embeddings()
        except Exception:
            emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
        if layers is None or emb is None:
            return
        state = {"mask": None}
        sums, counts = self.sums, self.counts

        def add(key, h):
            mask = state["mask"]
            if not isinstance(h, torch.Tensor) or mask is None or h.dim() < 2 or \
                    tuple(h.shape[:-1]) != tuple(mask.shape):
                return
            with torch.no_grad():
                rows = h.detach()[mask].double()
                sums[key] = sums[key] + rows.sum(0) if key in sums else rows.sum(0)
                counts[key] = counts.get(key, 0) + int(rows.shape[0])

        def ids(mod, args):
            if args and isinstance(args[0], torch.Tensor):
                state["mask"] = args[0] != 0

        self.handles.append(emb.register_forward_pre_hook(ids))
        for i, layer in enumerate(layers):
            def pre(mod, args, kwargs, i=i):
                add((i, 0), args[0] if args else kwargs.get("hidden_states"))

            def attn(mod, args, out, i=i):
                add((i, 1), out[0] if isinstance(out, (tuple, list)) else out)

            def post(mod, args, out, i=i):
                add((i, 2), out[0] if isinstance(out, (tuple, list)) else out)
            self.handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            sub = _attention_of(layer)
            if sub is not None:
                self.handles.append(sub.register_forward_hook(attn))
            self.handles.append(layer.register_forward_hook(post))

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles = []
        return {k: (self.sums[k], self.counts[k]) for k in self.sums}


def forward_departure(results, ref, scn, tol):
    """Lines naming the first (layer, stage) whose token mean of the hidden states differs from
    the reference's, from every rank's fingerprints summed (None when they cannot tell)."""
    prints = [r.get("prints") or {} for r in results]
    keys = sorted(set(ref.prints).intersection(*[set(p) for p in prints])) if prints else []
    if not keys:
        return []
    worst = None
    for key in keys:
        s_ref, n_ref = ref.prints[key]
        s = sum(p[key][0] for p in prints)
        n = sum(p[key][1] for p in prints)
        if not n or not n_ref:
            return []
        a, b = s / n, s_ref / n_ref
        err = float((a - b).norm()) / max(float(b.norm()), 1e-300)
        if not math.isfinite(err) or err > max(tol, 1e-12) * 10:
            worst = (key, err)
            break
    if worst is None:
        return ["  the forward agrees at every layer (the token means of each layer's input, "
                "attention output and output, over every rank's tokens): the difference is in "
                "the loss, the backward or the reductions"]
    (layer, stage), err = worst
    where = ("the layer's input: what reaches the first layer (the embedding, the sharding of "
             "the ids)" if (layer, stage) == (0, 0) else
             "the attention under SP (the positions RoPE reads, the masks, the kernel, the "
             "all-to-all or the ring)" if stage == 1 else
             "the MLP or the norms after an attention that agrees" if stage == 2 and any(
                 k == (layer, 1) for k in keys) else
             "the layer (its attention, MLP or norms)" if stage == 2 else
             "a layer's input after the previous layer's output agreed")
    return ["  the forward departs first at layer %d's %s (its token mean differs by %.3g "
            "relative%s): %s" % (layer, FP_STAGES[stage], err,
                                 "" if (layer, stage) == (0, 0) else ", every earlier stage "
                                 "agreeing", where)]


class Reference(object):
    """The step without SP: the model in float64 on one process over every DP rank's every
    micro-batch, each packed document run as its own sequence; per token its loss against the shifted label (log-softmax in float64), the
    global mean over the valid shifted labels, and every parameter's gradient of it."""

    def __init__(self, factory, scn, forward=None):
        self.scn = scn
        model = build_model(factory, scn.seed, torch.float64)
        self.model_tolerance = getattr(factory, "tolerance", None)
        self.vocab = vocab_of(model)
        self.batches = batches_of(scn, self.vocab)
        forward = forward or default_forward
        total = torch.zeros((), dtype=torch.float64)
        self.logp = {}      # (d, m) -> [B, L, V] log-probabilities (detached)
        self.targets = {}   # (d, m) -> [B, L] shifted labels
        # (d, m) -> (gradient of the micro-batch's summed token losses, its valid labels): the
        # micro-batches' graphs are disjoint, so a backward each costs what one over all does,
        # and the weightings a step may use instead of the global mean are sums of them
        self.grad_sums = {}
        count = 0
        params = list(model.named_parameters())
        prints = Fingerprints(model)
        for d, mbs in enumerate(self.batches):
            for m, b in enumerate(mbs):
                logits = by_document(model, b, forward, self.vocab)  # checks each shape
                logp = torch.log_softmax(logits.double(), dim=-1)
                tgt = shift_labels(b["labels"])
                valid = tgt != IGNORE_INDEX
                nll = -logp.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
                if "loss_weights" in b:   # the weight of each token's target (its label's)
                    nll = nll * shift_weights(b["loss_weights"])
                part = nll[valid].sum()
                n = int(valid.sum())
                model.zero_grad(set_to_none=True)
                if n:
                    part.backward()
                self.grad_sums[(d, m)] = ({k: (p.grad.detach().clone() if p.grad is not None
                                               else torch.zeros_like(p.detach()))
                                           for k, p in params}, n)
                total = total + part.detach()
                count += n
                self.logp[(d, m)] = logp.detach()
                self.targets[(d, m)] = tgt
        self.prints = prints.close()
        self.count = count
        self.loss_tensor = total / count if count else total
        self.loss = float(self.loss_tensor)
        self.grads = self.weighted(lambda d, m, n: 1.0 / count if count else 0.0)
        self.top = max([float(g.abs().max()) for g in self.grads.values() if g.numel()] or
                       [0.0])
        self.digest = weights_digest(model)

    def grad_scale(self, n):
        """What parameter n's gradient differences are relative to: its largest entry, or a
        thousandth of the largest entry of any parameter if that is more. Rounding errors scale
        with the gradients they flow from, not with a sum that nearly cancels (a 3-token row's
        q_proj gradient of 1e-17 meets float32 noise of 1e-8 otherwise)."""
        g = self.grads[n]
        return max(float(g.abs().max()) if g.numel() else 0.0, 1e-3 * self.top)

    def weighted(self, w):
        """{parameter: Σ over micro-batches (d, m) of w(d, m, valid labels) · the gradient of
        their summed token losses}, summed in (d, m) order."""
        out = None
        for (d, m), (g, n) in self.grad_sums.items():
            f = w(d, m, n)
            if out is None:
                out = {k: f * v for k, v in g.items()}
            else:
                for k, v in g.items():
                    out[k] = out[k] + f * v
        return out

    def sums(self, d=None, m=None, sp=None, tokens_of=None, sources_of=None, weight_of=None):
        """(sum of token losses, valid labels) over DP rank d (all when None), micro-batch m,
        the tokens of SP rank sp as tokens_of(L, sp) gives them. Token t's target is label
        sources_of(d, m, b)[t] of its row (−1: none; default t + 1, transformers' shift), weighted
        by weight_of(d, m, b, t, source) (default: the batch's loss weight of that label, or 1)."""
        s, n = 0.0, 0
        for (dd, mm), logp in self.logp.items():
            if (d is not None and dd != d) or (m is not None and mm != m):
                continue
            batch = self.batches[dd][mm]
            B, L = batch["labels"].shape
            for b in range(B):
                lab = batch["labels"][b].tolist()
                w = batch["loss_weights"][b].tolist() if "loss_weights" in batch else None
                src = (sources_of(dd, mm, b) if sources_of else
                       [t + 1 if t + 1 < L else -1 for t in range(L)])
                toks = range(L) if sp is None else [t for t in tokens_of(L, sp) if t < L]
                for t in toks:
                    j = src[t]
                    if j < 0 or lab[j] == IGNORE_INDEX:
                        continue
                    wt = (weight_of(dd, mm, b, t, j) if weight_of else
                          (w[j] if w is not None else 1.0))
                    s += wt * float(-logp[b, t, lab[j]])
                    n += 1
        return s, n


# -- one rank --------------------------------------------------------------------------------

def run_on_rank(rank_state, task, spec):
    """In a worker: build the model, run the user's step, return its loss and gradients."""
    import traceback
    from .worker import _user_traceback
    scn = StepScenario.from_json(task["scenario"])
    t0 = time.perf_counter()
    groups = groups_of(scn, rank_state.rank, rank_state.groups)
    ctx = StepContext(scn, rank_state.rank, groups)
    phase = "model"
    try:
        model = build_model(spec.model, scn.seed, ctx.dtype)
        digest = weights_digest(model)
        vocab = vocab_of(model)
        batches = [{k: v.clone() for k, v in b.items()}
                   for b in batches_of(scn, vocab)[ctx.dp_rank]]
        phase = "step"
        prints = Fingerprints(model)
        try:
            loss = spec.step(model, batches, ctx)
        finally:
            prints = prints.close()
    except Exception as e:
        return {"status": "raised", "phase": phase, "error": _user_traceback(e),
                "exception": type(e).__name__}
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            return {"status": "bad_output", "message": "the step returned a tensor of shape %s; "
                    "it must return the loss the trainer logs (a number or a 1-element tensor)"
                    % list(loss.shape)}
        loss = float(loss.detach().double())
    elif isinstance(loss, (int, float)):
        loss = float(loss)
    else:
        return {"status": "bad_output", "message": "the step returned %s; it must return the "
                "loss the trainer logs (a number or a 1-element tensor)" % type(loss).__name__}
    try:
        handed = ctx.grads   # the step's full gradients (a sharded optimizer's), by name
        if handed is not None:
            grads = {n: (handed[n].detach().double().clone() if handed.get(n) is not None
                         else None) for n, _ in model.named_parameters()}
        else:
            grads = {n: (p.grad.detach().double().clone() if p.grad is not None else None)
                     for n, p in model.named_parameters()}
    except Exception:
        return {"status": "harness_error", "error": traceback.format_exc()}
    return {"status": "ok", "loss": loss, "grads": grads, "digest": digest, "prints": prints,
            "seconds": time.perf_counter() - t0}


def is_hf_config(model):
    """Whether `model` names a transformers config rather than a factory: a config object, a
    dict, or a path to a .json file or to a directory holding config.json."""
    if isinstance(model, dict):
        return True
    if isinstance(model, (str, os.PathLike)):
        p = os.fspath(model)
        return p.endswith(".json") or os.path.isdir(p)
    try:
        from transformers import PretrainedConfig
    except ImportError:
        return False
    return isinstance(model, PretrainedConfig)


class StepSpec(object):
    """What a rank pool runs: the user's step and model factory."""

    def __init__(self, step, model):
        self.step = step
        self.model = model


# -- the verdict -----------------------------------------------------------------------------

def _close(x, ref, tol):
    return abs(x - ref) <= tol * max(abs(ref), 1e-300) or (ref == 0 and abs(x) <= tol)


def _ranks(rs):
    rs = sorted(rs)
    if len(rs) == 1:
        return "rank %d" % rs[0]
    return "ranks %s" % ", ".join(str(r) for r in rs)


def tolerance(scn, model_tol=None):
    """Relative, normwise. float64: SP and non-SP differ in summation order only (≤ 1e-10).
    float32: the step's rounding, u = 2^-24 per operation, grows with the depth of the sums
    (at most the tokens of the global batch and the hidden sizes): 1e-3 relative covers
    log2-depth sums of 2^10 terms of 2^-24 each with a 60× margin; below it lies the float32
    rounding of a float64 reference, above it every mistake of a step (a token lost, a
    denominator off by one of 2^10 tokens still is 1e-3)."""
    if scn.dtype == "f64":
        # a model that computes parts in float32 inside (its factory measured it: hf_model's
        # model_tolerance) is held to its own noise floor
        return max(F64_TOLERANCE, model_tol or 0.0)
    return 1e-3


class StepOutcome(object):
    def __init__(self, kind, summary, details=""):
        self.kind, self.summary, self.details = kind, summary, details

    @property
    def ok(self):
        return self.kind == "pass"


def _tokens_of(scn):
    """tokens_of(L, s): the token indices SP rank s holds of a row of L tokens."""
    P = scn.sp
    zig = scn.layout == "zigzag" and P > 1

    def tokens_of(L, s):
        m = P * (2 if zig else 1)
        return shard_indices(-(-L // m) * m, P, s, zig)
    return tokens_of


def _values(v):
    """A loss candidate's values: a mistake may log one value, or one of a tuple of them."""
    return v if isinstance(v, tuple) else (v,)


STEP_MEANS = ("the mean of the accumulation steps' global means (each micro-step's loss divided "
              "by that micro-step's valid labels over every replica, micro-steps weighted "
              "equally though their valid labels differ)")


def loss_candidates(ref, scn):
    """{name: [value per world rank]}: the loss a step logs under each classic mistake, from the
    reference's per-token losses. A rank's tokens are those of ctx.shard_indices."""
    D, P = scn.dp, scn.sp
    zig = scn.layout == "zigzag" and P > 1
    tokens_of = _tokens_of(scn)
    S, N = ref.sums()
    per = {}
    for d in range(D):
        per[d] = ref.sums(d=d)
        for s in range(P):
            per[(d, s)] = ref.sums(d=d, sp=s, tokens_of=tokens_of)
    c = {}

    def each(fn):
        return [fn(*divmod(r, P)) for r in range(D * P)]

    def div(a, b):  # a mean over no label: 0/0, or 0 where the step guards it
        return a / b if b else (float("nan"), 0.0)

    def mean(parts):  # parts: (sum, count); empties as 0/0, as 0, or left out
        full = [a / b for a, b in parts if b]
        return (float("nan") if len(full) < len(parts) else sum(full) / len(parts),
                sum(full) / len(parts), sum(full) / len(full) if full else float("nan"))

    c["the loss averaged over the rank's own valid labels (a local denominator: each SP rank's "
      "mean, never reduced)"] = each(lambda d, s: div(*per[(d, s)]))
    c["the SP group's summed loss divided by the rank's own valid labels (the denominator local "
      "where the numerator is global)"] = each(lambda d, s: div(per[d][0], per[(d, s)][1]))
    c["the mean of the SP ranks' means (each rank weighted equally though their valid labels "
      "differ)"] = each(lambda d, s: mean([per[(d, t)] for t in range(P)]))
    c["the DP replica's own mean (the loss never reduced over the DP group)"] = each(
        lambda d, s: div(*per[d]))
    c["the mean of the DP replicas' means (replicas weighted equally though their valid labels "
      "differ)"] = each(lambda d, s: mean([per[e] for e in range(D)]))
    c["the summed token losses, never divided by the valid-label count"] = each(lambda d, s: S)
    if scn.accumulation > 1:
        mbs = [ref.sums(d=d, m=m) for d in range(D) for m in range(scn.accumulation)]
        own = {d: [ref.sums(d=d, m=m) for m in range(scn.accumulation)] for d in range(D)}
        c["the mean of the micro-batches' means (gradient accumulation weighting micro-batches "
          "equally though their valid labels differ)"] = each(lambda d, s: mean(mbs))
        if D > 1:
            steps = [tuple(map(sum, zip(*[ref.sums(d=d, m=m) for d in range(D)])))
                     for m in range(scn.accumulation)]
            c[STEP_MEANS] = each(lambda d, s: mean(steps))
            c["the mean of the DP replica's own micro-batches' means (gradient accumulation "
              "weighting micro-batches equally, the loss not reduced over the DP group)"] = each(
                lambda d, s: mean(own[d]))

    # labels shifted after sharding: each rank shifts its own rows' labels within its shard
    def shifted_after(d, m, b):
        B, L = ref.targets[(d, m)].shape
        src = [-1] * L
        for s in range(P):
            toks = [t for t in tokens_of(L, s)]
            for i in range(len(toks) - 1):
                if toks[i] < L:
                    src[toks[i]] = toks[i + 1] if toks[i + 1] < L else -1
        return src
    # labels shifted twice: before the cut and again by the loss (each token given the target
    # two positions ahead in its row)
    def shifted_twice(d, m, b):
        L = ref.batches[d][m]["labels"].shape[1]
        return [t + 2 if t + 2 < L else -1 for t in range(L)]
    s3, n3 = ref.sums(sources_of=shifted_twice)
    c["the labels shifted twice (each token given the target two positions ahead: shifted "
      "before the cut and again by the loss)"] = each(
        lambda d, s: div(s3, n3) if n3 else (0.0, float("nan")))
    if scn.weights:   # per-token loss weights: ignored, not shifted, not sharded with the labels
        def weight(d, m, b, j):
            return float(ref.batches[d][m]["loss_weights"][b, j])
        s4, _ = ref.sums(weight_of=lambda d, m, b, t, j: 1.0)
        c["the per-token loss weights ignored"] = each(lambda d, s: div(s4, N))
        s5, _ = ref.sums(weight_of=lambda d, m, b, t, j: weight(d, m, b, t))
        c["the per-token loss weights not shifted with the labels (each target weighted by its "
          "input token's weight, one position early)"] = each(lambda d, s: div(s5, N))
        if P > 1:
            def first_weights(sp):   # the rank's i-th token weighted by the row's i-th target's
                def w(d, m, b, t, j):
                    L = ref.batches[d][m]["labels"].shape[1]
                    i = [x for x in tokens_of(L, sp)].index(t)
                    return weight(d, m, b, i + 1) if i + 1 < L else 0.0
                return w
            s6 = sum(ref.sums(sp=x, tokens_of=tokens_of, weight_of=first_weights(x))[0]
                     for x in range(P))
            c["the per-token loss weights not sharded with the labels (each SP rank weighting "
              "its i-th token by the row's first weights, not those of its own tokens)"] = each(
                lambda d, s: div(s6, N))
    # a denominator counting tokens instead of valid labels
    real = sum(n for mbs in scn.rows for mb in mbs for row in mb for n, _ in row)
    every = sum(b["labels"].numel() for mbs in ref.batches for b in mbs)
    c["the summed token losses divided by the batch's tokens (padding excluded; prompt tokens "
      "and every document's first token counted: a token or attention-mask count where the "
      "valid labels belong)"] = each(lambda d, s: div(S, real))
    c["the summed token losses divided by every position of the padded batch (padding counted "
      "as valid)"] = each(lambda d, s: div(S, every))
    if P > 1:
        s2, n2 = ref.sums(sources_of=shifted_after)
        # every valid label lost: nothing to average, a step logs 0 or 0/0
        c["the labels shifted after sharding (each shard's last token loses its target%s)" % (
            "; zigzag: the first chunk's last token is given the second chunk's first token" if
            zig else "")] = each(lambda d, s: div(s2, n2) if n2 else (0.0, float("nan")))
    return c


def diagnose(results, ref, scn, tol):
    """(summary, details) of a step whose losses or gradients differ from the reference."""
    W, P = scn.world, scn.sp
    lines = []
    forward = forward_departure([results[r] for r in range(W)], ref, scn, tol)
    forward_agrees = bool(forward) and "agrees at every layer" in forward[0]
    bad_loss = [r for r in range(W) if not _close(results[r]["loss"], ref.loss, tol)]
    summary = []
    if bad_loss:
        vals = sorted({round(results[r]["loss"], 12) for r in bad_loss})
        summary.append("the loss differs on %s" % _ranks(bad_loss))
        lines.append("loss: reference %.12g (the mean over %d valid shifted labels of the "
                     "global batch); %s" % (ref.loss, ref.count, "; ".join(
                         "rank %d logged %.12g" % (r, results[r]["loss"]) for r in bad_loss[:8])))
        named = []

        def same(x, y):  # y: a value, or a tuple of the values a step may log
            return any((math.isnan(x) and math.isnan(v)) or _close(x, v, max(tol, 1e-12))
                       for v in _values(y))
        nan = [r for r in bad_loss if math.isnan(results[r]["loss"])]
        if len(nan) < len(bad_loss):  # a NaN matches every mistake that divides 0 by 0
            def differs(v):  # the values a mistake may log that are not the reference's
                return tuple(x for x in _values(v) if not same(ref.loss, x))
            for name, vals in loss_candidates(ref, scn).items():
                if all(same(results[r]["loss"], differs(vals[r])) for r in bad_loss):
                    named.append(name)
        if nan:
            empty = [d for d in range(scn.dp) if ref.sums(d=d)[1] == 0]
            tokens_of = _tokens_of(scn)
            shards = sorted({(d, m, s) for d in range(scn.dp) for m in range(scn.accumulation)
                             for s in range(P) if P > 1 and ref.sums(
                                 d=d, m=m, sp=s, tokens_of=tokens_of)[1] == 0})
            why = ""
            if empty:
                why = (": DP replica%s %s ha%s no valid label in this step, so a denominator "
                       "of its own (not the global count) is 0" % (
                           "s" if len(empty) > 1 else "", ", ".join(map(str, empty)),
                           "ve" if len(empty) > 1 else "s"))
            elif shards:
                why = (": SP rank%s %s hold%s no valid shifted label of %s, so a mean over "
                       "the rank's own labels is 0/0 = NaN there, and weighting that mean by "
                       "its 0 labels keeps it NaN (NaN · 0 = NaN): leave such ranks out of the "
                       "sum, or sum token losses instead of weighting means" % (
                           "s" if len({x[2] for x in shards}) > 1 else "",
                           ", ".join(sorted({str(x[2]) for x in shards})),
                           "" if len({x[2] for x in shards}) > 1 else "s",
                           ", ".join("DP replica %d's micro-batch %d" % (d, m)
                                     for d, m in sorted({(x[0], x[1]) for x in shards}))))
            lines.append("  %s logged NaN%s" % (_ranks(nan), why))
        # every bad rank's loss one multiple of the reference's: that factor's names
        k = _common_factor([results[r]["loss"] for r in bad_loss], ref.loss, tol)
        factors = _factor_names(scn, k) if k is not None else ([], [])
        if named:
            lines.append("  the logged loss is exactly %s" % named[0])
            for n in named[1:]:
                lines.append("  (on this example it also equals %s)" % n)
        elif len(nan) == len(bad_loss):
            also = [name for name, vals in loss_candidates(ref, scn).items()
                    if all(any(math.isnan(v) for v in _values(vals[r])) for r in nan)]
            if also:
                lines.append("  (0/0 on this example under %s too)" % "; ".join(also))
        elif (up := factors[0]):
            lines.append("  every rank logged %.6g × the reference's loss = %s: a sum over %g "
                         "ranks (or steps) of values that each already are the global mean, or "
                         "a scale meant for the gradient left in the logged loss" % (
                             k, " = ".join(up), k))
        elif (down := factors[1]):
            lines.append("  every rank logged %.6g × the reference's loss = 1/%s: averaged "
                         "over %g ranks (or steps) where the parts must be summed" % (
                             k, " = 1/".join(down), 1 / k))
        elif (scaled := _scaled_loss(results, bad_loss, loss_candidates(ref, scn), scn, tol)):
            k, up, down, name = scaled
            lines.append("  the logged loss is exactly %.6g × %s (%s)" % (
                k, name, " = ".join(up) if up else "1/" + " = 1/".join(down)))
        elif forward_agrees:
            lines.append("  none of the searched loss mistakes reproduces it (local or global "
                         "denominators, per-rank or per-replica means, labels shifted after "
                         "sharding, an undivided sum), and the forward agrees at every layer: "
                         "the loss computed from it differs — its targets, weights or "
                         "reduction, or the head and final norm after the last layer")
        else:
            lines.append("  none of the searched loss mistakes reproduces it (local or global "
                         "denominators, per-rank or per-replica means, labels shifted after "
                         "sharding, an undivided sum): the token losses themselves likely "
                         "differ, i.e. the forward under SP (positions, masks, the attention: "
                         "seqpar.testing.check puts the attention alone under the property)")
    lines += forward
    names = list(ref.grads)
    missing = [n for n in names if any(results[r]["grads"].get(n) is None for r in range(W))]
    if missing:
        summary.append("no gradient reached %s" % ", ".join(missing[:4]))
        for n in missing[:4]:
            rs = [r for r in range(W) if results[r]["grads"].get(n) is None]
            lines.append("%s: no gradient on %s (requires_grad off, detached, or the parameter "
                         "not used by the SP path)" % (n, _ranks(rs)))
    bad = []
    for n in names:
        g_ref = ref.grads[n]
        scale = ref.grad_scale(n)
        for r in range(W):
            g = results[r]["grads"].get(n)
            if g is None:
                continue
            err = float((g - g_ref).abs().max()) if g.numel() else 0.0
            if err > tol * max(scale, 1e-300) and not (scale == 0 and err <= tol):
                bad.append((n, r, err, float(g_ref.abs().max()) if g_ref.numel() else 0.0))
    if bad:
        params = []
        for n, *_ in bad:
            if n not in params:
                params.append(n)
        summary.append("the gradient of %s%s differs on %s" % (
            ", ".join(params[:3]), " and %d more" % (len(params) - 3) if len(params) > 3 else "",
            _ranks({r for _, r, _, _ in bad})))
        for n in params[:6]:
            rows = [(r, e, s) for m, r, e, s in bad if m == n]
            lines.append("%s: max |Δ| %s on %s (reference's largest entry %.3g)" % (
                n, "%.3g" % max(e for _, e, _ in rows), _ranks([r for r, _, _ in rows]),
                rows[0][2]))
        lines += grad_causes(results, ref, scn, tol, params)
    return "; ".join(summary), "\n".join(lines)


def _factor_names(scn, k):
    """([names], [names]) of the step's degrees equal to k and to 1/k: the SP degree, the DP
    degree, the world size, the accumulation steps (those above 1)."""
    known = [(scn.sp, "the SP degree"), (scn.dp, "the DP degree"), (scn.world, "the world size"),
             (scn.accumulation, "the accumulation steps")]
    return ([w for f, w in known if f > 1 and abs(k - f) < 1e-6 * f],
            [w for f, w in known if f > 1 and abs(k - 1.0 / f) < 1e-6])


def _scaled_loss(results, bad, cands, scn, tol):
    """(k, up, down, name) when every bad rank logged k × what the weighting `name` logs (a
    mean: of ranks', replicas', micro-batches' or steps' means), k one of the step's degrees or
    its inverse (two mistakes at once: a weighting and a factor), else None. Counts' ratios
    (tokens against labels) times a degree are left out: on a small batch they coincide with
    any factor too easily."""
    for name, vals in cands.items():
        if "mean" not in name:   # weightings only: a count ratio times a degree is a coincidence
            continue
        for v0 in _values(vals[bad[0]]):
            if not v0 or math.isnan(v0):
                continue
            k = results[bad[0]]["loss"] / v0
            up, down = _factor_names(scn, k)
            if not (up or down):
                continue
            if all(any(_close(results[r]["loss"], k * v, max(tol, 1e-12))
                       for v in _values(vals[r]) if not math.isnan(v)) for r in bad):
                return k, up, down, name
    return None


def _common_factor(values, reference, tol):
    """k when every value is k × reference (within tol, k the same for all), else None."""
    if not reference or not values or any(math.isnan(v) for v in values):
        return None
    k = values[0] / reference
    if all(abs(v - k * reference) <= max(tol, 1e-12) * abs(k * reference) for v in values):
        return k
    return None


def grad_causes(results, ref, scn, tol, params):
    """Names what the gradients' pattern shows: ranks of one SP group (or of one DP group) that
    hold different gradients of a replicated parameter, or every rank's gradient a constant
    multiple of the reference's."""
    W, P, D = scn.world, scn.sp, scn.dp
    out = []

    def same(a, b, n):
        ga, gb = results[a]["grads"][n], results[b]["grads"][n]
        scale = max(float(ref.grads[n].abs().max()), 1e-300)
        return float((ga - gb).abs().max()) <= tol * scale

    n = params[0]
    if any(results[r]["grads"].get(n) is None for r in range(W)):
        return out
    split_sp = [d for d in range(D) if P > 1 and not all(
        same(d * P, d * P + s, n) for s in range(1, P))]
    split_dp = [s for s in range(P) if D > 1 and not all(
        same(s, d * P + s, n) for d in range(1, D))]
    if split_sp:
        out.append("  the ranks of one SP group hold different gradients of the replicated "
                   "parameter %s (SP group of %s): the gradient is not reduced over the SP "
                   "group (each rank keeps the part of its own tokens)" % (
                       n, _ranks([split_sp[0] * P + s for s in range(P)])))
    if split_dp:
        out.append("  the ranks of one DP group hold different gradients of %s (DP group of "
                   "%s): the gradient is not reduced over the DP group" % (
                       n, _ranks([d * P + split_dp[0] for d in range(D)])))
    if not split_sp and not split_dp:
        g, g_ref = results[0]["grads"][n], ref.grads[n]
        k = float((g * g_ref).sum() / max(float((g_ref * g_ref).sum()), 1e-300))
        if k and all(float((results[r]["grads"][m] - k * ref.grads[m]).abs().max()) <=
                     tol * max(float(ref.grads[m].abs().max()), 1e-300) * max(1, abs(k))
                     for r in range(W) for m in params):
            up, down = _factor_names(scn, k)
            why = ""
            if up:
                why = (" = %s: summed over %g ranks (or steps) where each already holds the "
                       "gradient of the global mean, or the loss not divided by it" % (
                           " = ".join(up), k))
            elif down:
                why = (" = 1/%s: averaged over %g ranks (or steps) where the parts must be "
                       "summed (torch.distributed's AVG, or DDP's mean over a group whose ranks "
                       "hold parts of one gradient)" % (" = 1/".join(down), 1 / k))
            out.append("  every rank's gradient is %.6g × the reference's%s" % (k, why))
        else:
            out += weighting_causes(results, ref, scn, tol, params)
    return out


def weighting_causes(results, ref, scn, tol, params):
    """The weightings of the micro-batches' token losses a step may use instead of the global
    mean (replicas' or micro-batches' means averaged, a replica's own mean never reduced over
    DP), each from the reference's per-micro-batch gradients: the ones every rank's gradient
    equals."""
    W, P, D, A = scn.world, scn.sp, scn.dp, scn.accumulation
    n_d = {d: sum(ref.grad_sums[(d, m)][1] for m in range(A)) for d in range(D)}
    cands = []
    if D > 1:
        mean = ref.weighted(lambda d, m, n: 1.0 / (D * n_d[d]) if n_d[d] else 0.0)
        cands.append(("the mean of the DP replicas' means (replicas weighted equally though "
                      "their valid labels differ)", lambda r: mean))
        own = {d: ref.weighted(lambda e, m, n, d=d: 1.0 / n_d[d] if e == d and n_d[d] else 0.0)
               for d in range(D)}
        cands.append(("each DP replica's own mean (the gradient not reduced over the DP group)",
                      lambda r: own[r // P]))
    if A > 1:
        mbs = ref.weighted(lambda d, m, n: 1.0 / (D * A * n) if n else 0.0)
        cands.append(("the mean of the micro-batches' means (gradient accumulation weighting "
                      "micro-batches equally though their valid labels differ)", lambda r: mbs))
        if D > 1:
            n_m = {m: sum(ref.grad_sums[(d, m)][1] for d in range(D)) for m in range(A)}
            steps = ref.weighted(lambda d, m, n: 1.0 / (A * n_m[m]) if n_m[m] else 0.0)
            cands.append((STEP_MEANS, lambda r: steps))

    def equal(a, b, n):
        return float((a - b).abs().max()) <= tol * max(ref.grad_scale(n), 1e-300)
    out = []
    for name, grads_of in cands:
        if all(equal(grads_of(r)[n], ref.grads[n], n) for r in range(W) for n in params):
            continue  # the same as the reference on this example
        if all(equal(results[r]["grads"][n], grads_of(r)[n], n)
               for r in range(W) for n in params):
            out.append("  every rank's gradient is exactly that of %s" % name)
            continue
        # two mistakes at once: the weighting, and a factor of the step's degrees
        n0 = params[0]
        g, c = results[0]["grads"][n0], grads_of(0)[n0]
        k = float((g * c).sum() / max(float((c * c).sum()), 1e-300))
        up, down = _factor_names(scn, k)
        if (up or down) and all(equal(results[r]["grads"][n], k * grads_of(r)[n], n)
                                for r in range(W) for n in params):
            out.append("  every rank's gradient is exactly %.6g × that of %s (%s)" % (
                k, name, " = ".join(up) if up else "1/" + " = 1/".join(down)))
    return out


def judge(results, ref, scn, stacks=None, deadline=None):
    """A StepOutcome from the ranks' replies (None: did not return)."""
    from .runner import judge_ranks
    W = scn.world
    found = judge_ranks(results, stacks or {}, deadline or 0, phase=lambda x: (
        "the step" if x["phase"] == "step" else "the model factory"))
    if found is not None:
        return StepOutcome(*found)
    odd = [r for r in range(W) if results[r]["digest"] != ref.digest and not all(
        _close(a, b, 1e-5) for a, b in zip(results[r]["digest"], ref.digest))]
    if odd:
        return StepOutcome("bad_model", "the model factory gave %s other weights than the "
                           "reference's copy: it must build the same weights from torch's RNG "
                           "(seeded by seqpar before each call) on every rank" % _ranks(odd))
    tol = tolerance(scn, getattr(ref, "model_tolerance", None))
    summary, details = diagnose(results, ref, scn, tol)
    if not summary:
        return StepOutcome("pass", "consistent")
    why = ("float64: SP and non-SP differ only in summation order" if tol == F64_TOLERANCE
           else "float32's rounding" if scn.dtype == "f32" else
           "the model rounds to float32 inside its float64 forward (measured: hf_model's "
           "model_tolerance)")
    return StepOutcome("mismatch", summary, details + "\ntolerance: %.1e relative, normwise "
                       "(%s)" % (tol, why))


# -- running examples ------------------------------------------------------------------------

class StepRunner(object):
    """Runs examples of one step on pools of gloo ranks (one pool per world size)."""

    def __init__(self, step, model, deadline=60.0, start_method="fork", name=None,
                 forward=None, step_ref=None, model_ref=None, attn="seqpar_reference"):
        from .impl_ref import reference_of, resolve
        self.step_ref = step_ref or (step if isinstance(step, str) else reference_of(step))
        self.model_flag = "--model"
        self.attn = attn
        if is_hf_config(model):  # a transformers config: small models of its architecture
            from .hf import hf_model
            if isinstance(model, (str, os.PathLike)):
                self.model_ref, self.model_flag = model_ref or os.fspath(model), "--hf-config"
            else:
                self.model_ref = model_ref
            model = hf_model(model, attn_implementation=attn)
        else:
            self.model_ref = model_ref or (model if isinstance(model, str) else
                                           reference_of(model))
        self.step = resolve(step) if isinstance(step, str) else step
        self.model = resolve(model) if isinstance(model, str) else model
        self.forward = forward
        self.name = name or getattr(self.step, "__name__", "step")
        self.deadline = float(deadline)
        self.start_method = start_method
        self.pools = {}
        self.count = 0
        self.failures = 0
        self.first_failure = None  # the example count at the first failure (1-based)
        self.seconds = {"reference": 0.0, "ranks": 0.0}
        self.t_start = time.monotonic()
        self._last_progress = time.monotonic()
        self.progress = None

    def elapsed(self):
        return time.monotonic() - self.t_start

    def run(self, scn):
        from .pool import RankPool
        t0 = time.perf_counter()
        ref = Reference(self.model, scn, self.forward)
        t1 = time.perf_counter()
        self.seconds["reference"] += t1 - t0
        self.count += 1
        pool = self.pools.get(scn.world)
        if pool is None:
            pool = self.pools[scn.world] = RankPool(scn.world, StepSpec(self.step, self.model),
                                                    self.start_method)
        results, stacks = pool.run({"kind": "step", "scenario": scn.to_json()}, self.deadline)
        self.seconds["ranks"] += time.perf_counter() - t1
        out = judge(results, ref, scn, stacks, self.deadline)
        if not out.ok:
            self.failures += 1
            if self.first_failure is None:
                self.first_failure = self.count
        self._tick()
        return out

    def _tick(self):
        from .runner import tick
        tick(self, "steps")

    def rerun_command(self, scn):
        import shlex
        import sys
        from .runner import pythonpath_env
        if not self.step_ref or not self.model_ref:
            return None
        attn = (["--attn", self.attn] if self.model_flag == "--hf-config" and
                self.attn != "seqpar_reference" else [])
        return " ".join(pythonpath_env() + [
            shlex.quote(sys.executable), "-m", "seqpar.testing", "run-step",
            shlex.quote(self.step_ref), self.model_flag, shlex.quote(self.model_ref)] + attn +
            ["--scenario", shlex.quote(scn.to_json())])

    def report(self, scn, out):
        from .runner import _indent
        lines = ["%s: %s" % (self.name, out.summary), "  scenario: %s" % scn.describe()]
        if out.details:
            lines.append(_indent(out.details, "  "))
        cmd = self.rerun_command(scn)
        lines.append("  re-run:   %s" % (cmd or "(give the step and the model as "
                                               "'file.py:NAME' to get a command that re-runs "
                                               "this case)"))
        return "\n".join(lines)

    def close(self):
        for p in self.pools.values():
            p.close()
        self.pools = {}


def step_scenarios(max_world=4, max_tokens=24, dtypes=("f64",), accumulation=True,
                   max_rows=2, max_dp=None, max_ring=None, ulysses_degrees=None, weights=False):
    """Hypothesis strategy of StepScenario: DP × Ulysses × ring (world ≤ max_world; DP ≤ max_dp
    and ring ≤ max_ring where given: a trainer without DP or without ring attention; Ulysses
    degrees among ulysses_degrees where given: those that divide the model's heads), zigzag or
    contiguous, 1–max_rows rows per micro-batch, 1–2 micro-batches, documents of 1+ tokens
    with prompt spans and all-masked documents, rows of unequal length (padding), lengths
    that need SP padding, a data seed. DP ranks get their own rows (unequal valid labels)."""
    from hypothesis import strategies as st

    layouts = [(D, U, R) for D in range(1, max_world + 1) for U in range(1, max_world + 1)
               for R in range(1, max_world + 1) if D * U * R <= max_world and
               D <= (max_dp or max_world) and R <= (max_ring or max_world) and
               (ulysses_degrees is None or U in ulysses_degrees)]
    if not layouts:
        raise ValueError("step scenarios: no DP × Ulysses × ring layout within max_world=%d, "
                         "max_dp=%s, max_ring=%s, ulysses_degrees=%s" % (
                             max_world, max_dp, max_ring, ulysses_degrees))
    # the simplest first: Hypothesis shrinks towards the list's start
    layouts.sort(key=lambda x: (x[0] * x[1] * x[2], x))

    @st.composite
    def draw(d):
        D, U, R = d(st.sampled_from(layouts))
        layout = d(st.sampled_from(["zigzag", "contiguous"])) if R > 1 or U > 1 else \
            "contiguous"
        acc = d(st.integers(1, 2)) if accumulation else 1
        dtype = d(st.sampled_from(list(dtypes)))
        doc = st.tuples(st.integers(1, max(1, max_tokens // 2)), st.integers(0, 4)).map(list)
        row = st.lists(doc, min_size=1, max_size=4).filter(
            lambda r: sum(x[0] for x in r) <= max_tokens)
        rows = [[d(st.lists(row, min_size=1, max_size=max_rows)) for _ in range(acc)]
                for _ in range(D)]
        # at least one valid shifted label in the global batch
        if not any(x[0] > max(x[1], 1) for mbs in rows for mb in mbs for r in mb for x in r):
            rows[0][0][0][0] = [max(2, rows[0][0][0][0][0]), 0]
        seed = d(st.integers(0, 2 ** 16))
        return StepScenario(dp=D, ulysses=U, ring=R, layout=layout, dtype=dtype, rows=rows,
                            seed=seed, weights=weights)
    return draw()

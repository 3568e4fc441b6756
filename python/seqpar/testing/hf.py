"""Small models of a Hugging Face architecture for check_step: a transformers config (a
config.json path or its directory, a dict with "model_type", or a PretrainedConfig) drawn down
to a few thousand parameters, keeping what matters to SP — the architecture, the layer types
(sliding / full / chunked / linear attention: one layer of each kind, in their order), the
ratio of query to KV heads (GQA), an even head_dim, sliding windows and chunks (shortened so
that the drawn documents cross them), sinks, soft-capping, tied embeddings — and a factory
that builds it with transformers' from_config."""
import copy
import json
import os

# sizes of the drawn-down model
VOCAB = 64
HEAD_DIM = 8
HIDDEN = 32
FFN = 32
WINDOW = 4       # sliding windows and attention chunks, in tokens


def load_config(config):
    """A transformers PretrainedConfig from a path, a dict or a config."""
    from transformers import AutoConfig, PretrainedConfig
    if isinstance(config, PretrainedConfig):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError("hf config %s: no such file (give config.json or its directory)"
                             % path)
        try:
            with open(path) as f:
                config = json.load(f)
        except ValueError as e:
            raise ValueError("hf config %s: not JSON (%s)" % (path, e))
    if not isinstance(config, dict):
        raise TypeError("hf config: a config.json path, a dict or a PretrainedConfig, not %s" %
                        type(config).__name__)
    d = dict(config)
    mt = d.pop("model_type", None)
    if not mt:
        raise ValueError("hf config: no model_type (transformers needs it to pick the "
                         "architecture; e.g. \"qwen3\", \"llama\", \"gpt_oss\", \"gemma3_text\")")
    try:
        return AutoConfig.for_model(mt, **d)
    except ValueError as e:
        raise ValueError("hf config: model_type %r: %s" % (mt, str(e).splitlines()[0]))


def _text_config(cfg):
    """The text model's config of a multimodal one (Llama 4, Gemma 3): what a causal LM is."""
    sub = getattr(cfg, "text_config", None)
    return sub if sub is not None and getattr(cfg, "model_type", "") not in (
        getattr(sub, "model_type", None),) else cfg


def scale_down(config):
    """A small copy of the config (see the module's docstring); returns (config, notes): notes
    says what was kept and changed."""
    cfg = _text_config(load_config(config))
    d = cfg.to_dict()
    notes = []
    H = d.get("num_attention_heads")
    if not H:
        raise ValueError("hf config %s: no num_attention_heads" % d.get("model_type"))
    Hkv = d.get("num_key_value_heads") or H
    if H % Hkv:
        raise ValueError("hf config: num_attention_heads %d is not a multiple of "
                         "num_key_value_heads %d" % (H, Hkv))
    g = H // Hkv
    kv = min(Hkv, 2)
    rep = min(g, 8)
    d["num_key_value_heads"], d["num_attention_heads"] = kv, kv * rep
    notes.append("heads %d/%d kv → %d/%d (GQA ratio %d%s)" % (
        H, Hkv, kv * rep, kv, g, "" if rep == g else ", drawn down to %d" % rep))
    hd = d.get("head_dim") or (d["hidden_size"] // H)
    d["head_dim"] = HEAD_DIM if hd % 2 == 0 else HEAD_DIM + 1
    d["hidden_size"] = HIDDEN
    for k in ("intermediate_size", "intermediate_size_mlp", "moe_intermediate_size",
              "shared_expert_intermediate_size"):
        if d.get(k):
            d[k] = FFN
    for k, n in (("num_local_experts", 4), ("num_experts", 4), ("num_experts_per_tok", 2),
                 ("n_routed_experts", 4)):
        if d.get(k):
            d[k] = min(d[k], n)
    d["vocab_size"] = VOCAB
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(d.get(k), int) and d[k] >= VOCAB:
            d[k] = 0
        elif isinstance(d.get(k), list):
            d[k] = [x if x < VOCAB else 0 for x in d[k]]
    types = d.get("layer_types")
    L = d.get("num_hidden_layers") or 1
    if types:
        keep = []
        for i, t in enumerate(types):
            if t not in [types[j] for j in keep]:
                keep.append(i)
        while len(keep) < 2 and len(keep) < L:
            keep.append(keep[-1] + 1)
        d["layer_types"] = [types[i] for i in sorted(keep)]
        d["num_hidden_layers"] = len(d["layer_types"])
        for k in ("no_rope_layers",):  # Llama 4's per-layer lists follow the kept layers
            if isinstance(d.get(k), list) and len(d[k]) == L:
                d[k] = [d[k][i] for i in sorted(keep)]
        notes.append("layers %d → %d (%s)" % (L, d["num_hidden_layers"],
                                              ", ".join(d["layer_types"])))
    else:
        d["num_hidden_layers"] = min(L, 2)
        notes.append("layers %d → %d" % (L, d["num_hidden_layers"]))
    for k in ("sliding_window", "attention_chunk_size"):
        if d.get(k):
            notes.append("%s %d → %d" % (k, d[k], WINDOW))
            d[k] = WINDOW
    for k in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(k):
            notes.append("%s %g kept" % (k, d[k]))
    if "tie_word_embeddings" in d:
        notes.append("tie_word_embeddings %s kept" % d["tie_word_embeddings"])
    d["use_cache"] = False
    mt = d.pop("model_type")
    d.pop("transformers_version", None)
    d.pop("architectures", None)
    from transformers import AutoConfig
    small = AutoConfig.for_model(mt, **d)
    return small, notes


def _attend(query, key, value, hidden, scaling, softcap, s_aux):
    """softmax(scaling·q·k, capped, the hidden (query, key) pairs out, the head's sink as one
    more column)·v over [B, H, s, D] queries and [B, H_kv, S, D] keys and values, in their
    dtype; `hidden` broadcasts to [B, H, s, S] (None: every key seen)."""
    import torch
    B, H, s, D = query.shape
    rep = H // key.shape[1]
    k = key.repeat_interleave(rep, dim=1)
    v = value.repeat_interleave(rep, dim=1)
    scores = torch.matmul(query, k.transpose(2, 3)) * (D ** -0.5 if scaling is None else scaling)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    if s_aux is not None:
        sink = s_aux.reshape(1, H, 1, 1).expand(B, H, s, 1).to(scores.dtype)
        p = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        p = scores.softmax(-1)
    return torch.matmul(p.to(v.dtype), v).transpose(1, 2).contiguous()


def reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        softcap=None, s_aux=None, **kwargs):
    """The reference's attention for transformers models (registered as "seqpar_reference"):
    transformers' eager attention computes its softmax in float32 even for a float64 model, so
    the float64 reference runs this instead — the mask transformers built for the layer
    (documents from position_ids, causal, sliding windows, chunks; boolean or additive), the
    layer's scaling, soft-capping and sinks, every operation in the model's dtype."""
    import torch
    hidden = None
    if attention_mask is not None:
        m = attention_mask[:, :, :, :key.shape[2]]
        hidden = ~m if m.dtype == torch.bool else m < torch.finfo(m.dtype).min / 2
    return _attend(query, key, value, hidden, scaling, softcap, s_aux), None


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     softcap=None, sliding_window=None, s_aux=None, position_ids=None,
                     **kwargs):
    """flash_attention_2's contract on the CPU, in the model's dtype (registered as
    "seqpar_varlen"): no mask tensor — transformers builds none for it, and DeepSpeed's ALST
    drops any — the packed documents read from `position_ids` (a new one wherever they restart
    at 0, as transformers' varlen path reads them), causal within each, the layer's
    `sliding_window` (a query sees that many keys, its own included), soft-capping and sinks.
    Chunked attention (Llama 4) is refused: flash-attention has no chunks either."""
    import torch
    if getattr(module, "attention_chunk_size", None) or getattr(
            getattr(module, "config", None), "attention_chunk_size", None):
        raise ValueError("seqpar_varlen: chunked attention (attention_chunk_size) has no "
                         "varlen form; use seqpar_reference (transformers' mask)")
    L = query.shape[2]
    i = torch.arange(L, device=query.device)
    seen = i[:, None] >= i[None, :]
    if sliding_window:
        seen = seen & (i[:, None] - i[None, :] < sliding_window)
    if position_ids is not None:
        doc = torch.cumsum((position_ids.reshape(-1, L) == 0).long(), dim=-1)  # [B or 1, L]
        seen = seen[None] & (doc[:, :, None] == doc[:, None, :])
    hidden = ~seen.reshape(-1, 1, L, L)
    return _attend(query, key, value, hidden, scaling, softcap, s_aux), None


def flash_forward(query, key, value, attention_mask=None, query_length=None, is_causal=True,
                  dropout=0.0, softmax_scale=None, sliding_window=None, softcap=None,
                  cu_seq_lens_q=None, position_ids=None, s_aux=None, **kwargs):
    """transformers' `_flash_attention_forward` contract on the CPU, in the inputs' dtype: what
    a framework's SP attention calls after its all-to-all (VeOmni's flash path, for one) when no
    flash-attn kernel exists. q [B, S, H, D], k, v [B, S, H_kv, D] → [B, S, H, D]. Documents as
    flash-attn's varlen kernel reads them: from `cu_seq_lens_q` (the packed row's boundaries —
    the full sequence's, which is what a gathered query spans), else from `position_ids`
    restarting at 0; causal within each (unless is_causal is False), the `sliding_window` (W
    keys, the query's own counted), soft-capping and sinks. A padding `attention_mask` is
    refused (a varlen caller passes none)."""
    import torch
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("flash_forward: a padding attention_mask is not supported; pass packed "
                         "documents (cu_seq_lens_q or position_ids) instead")
    B, S = query.shape[0], query.shape[1]
    i = torch.arange(S, device=query.device)
    seen = i[:, None] >= i[None, :] if is_causal else torch.ones(S, S, dtype=torch.bool)
    if sliding_window:
        seen = seen & ((i[:, None] - i[None, :]).abs() < sliding_window)
    if cu_seq_lens_q is not None:
        if B != 1:
            raise ValueError("flash_forward: cu_seq_lens_q describes one packed row; got a "
                             "batch of %d" % B)
        bounds = torch.zeros(S, dtype=torch.long)
        bounds[cu_seq_lens_q[1:-1].long()] = 1
        doc = torch.cumsum(bounds, 0)[None]
    elif position_ids is not None:
        doc = torch.cumsum((position_ids.reshape(-1, S) == 0).long(), dim=-1)
    else:
        doc = None
    if doc is not None:
        seen = seen[None] & (doc[:, :, None] == doc[:, None, :])
    hidden = ~seen.reshape(-1, 1, S, S)
    out = _attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), hidden,
                  softmax_scale, softcap, s_aux)
    return out


def _register_attentions():
    """seqpar_reference and seqpar_varlen in transformers' attention registry."""
    from transformers import AttentionInterface
    AttentionInterface.register("seqpar_reference", reference_attention)
    AttentionInterface.register("seqpar_varlen", varlen_attention)
    try:  # the mask it reads: transformers' eager (additive) one
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
        ALL_MASK_ATTENTION_FUNCTIONS.register("seqpar_reference", eager_mask)
    except ImportError:
        pass


def model_tolerance(factory, vocab=VOCAB):
    """(tolerance, noise) of a float64 model. SP moves a value by an ulp of float64 where it
    sums in another order; a model computing in float64 throughout turns that into ~1e-16 of
    its gradients, one that rounds to float32 inside (Gemma's RMSNorm, Llama 4's router
    sigmoid) into ~1e-8, wherever a float32 rounding flips. Measured: the gradients of a
    2×12-token batch at the embedding's output x, x(1 + δr) and x(1 − δr), δ = 1e-9: the
    second difference g₊ + g₋ − 2g is ~δ² (nothing) for a smooth float64 model and the size of
    the flips otherwise. Tolerance: 100× that noise, at least 1e-10, at most 1e-4 (every step
    mistake moves the loss and the gradients by more)."""
    import torch
    torch.manual_seed(0xD0E)
    m = factory().double()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, vocab, (2, 12), generator=g)
    pos = torch.arange(12).repeat(2, 1)
    r = torch.randn(2, 12, m.config.hidden_size, generator=g, dtype=torch.float64)

    def grads(delta):
        m.zero_grad()
        h = m.get_input_embeddings().register_forward_hook(
            lambda mod, inp, out: out * (1 + delta * r))
        try:
            out = m(input_ids=ids, position_ids=pos, use_cache=False).logits.double()
        finally:
            h.remove()
        out.pow(2).mean(-1).sum().backward()
        return torch.cat([x.grad.flatten() for x in m.parameters() if x.grad is not None])
    g0, gp, gm = grads(0.0), grads(1e-9), grads(-1e-9)
    noise = float((gp + gm - 2 * g0).abs().max() / g0.abs().max().clamp_min(1e-300))
    return max(1e-10, min(1e-4, 100 * noise)), noise


def hf_model(config, attn_implementation="seqpar_reference", experts_implementation="eager"):
    """A model factory for check_step: the config drawn down (scale_down) and built with
    transformers' AutoModelForCausalLM.from_config (weights from torch's RNG, which seqpar seeds
    the same way for every rank and the reference). Mixtures of experts run transformers'
    "eager" experts (its grouped_mm takes no float64). The factory's `.config` and `.notes`
    say what was built."""
    small, notes = scale_down(config)
    if attn_implementation in ("seqpar_reference", "seqpar_varlen"):
        _register_attentions()

    def factory():
        from transformers import AutoModelForCausalLM
        kw = {"attn_implementation": attn_implementation}
        if any(getattr(small, k, None) for k in ("num_local_experts", "num_experts",
                                                 "n_routed_experts")):
            kw["experts_implementation"] = experts_implementation
        return AutoModelForCausalLM.from_config(copy.deepcopy(small), **kw)
    factory.config = small
    factory.notes = notes
    factory.tolerance, noise = model_tolerance(factory)
    if factory.tolerance > 1e-10:
        notes.append("float64 tolerance %.1e: the model's own rounding noise is %.1e (it "
                     "computes parts in float32 inside a float64 forward)" % (
                         factory.tolerance, noise))
    factory.__name__ = "hf_model(%s)" % small.model_type
    return factory

#!/usr/bin/env python3
r"""One training step of seqpar's decoder in PyTorch (float64, autograd), written the way the
Hugging Face Llama / Qwen2 / Qwen3 modelling code structures it (nn.Linear projections, with
Qwen2's q/k/v biases and an o_proj bias when the scenario asks, an RMSNorm module, rotate_half
RoPE, repeat_kv for GQA, masked scaled-dot-product attention, a SwiGLU MLP, cross-entropy with
ignore_index=-100 summed and divided by the number of valid labels).
It is the external witness for seqpar's own reference (src/sim/reference.hpp).

Input: the JSON that `torch_crosscheck dump DIR` writes per scenario (tests/equivalence/
torch_crosscheck.cpp): sizes, the unpadded row (input_ids, position_ids, labels already aligned
to tokens) and every parameter as base64 little-endian float64 with seqpar's [in, out] layout.
Output (--out-dir, one NAME.json per input): loss, valid_tokens and, as base64 float64 tensors,
"logits" [L, vocab], "embedding.output.grad" [L, hidden] and "grad.NAME" for every parameter
(in seqpar's layout).

    build/tests/equivalence/torch_crosscheck dump /tmp/torch-in
    /usr/bin/python3 tests/jobs/torch_reference.py /tmp/torch-in/*.input.json \
        --out-dir tests/equivalence/data/torch
    build/tests/equivalence/torch_crosscheck compare tests/equivalence/data/torch
"""
import argparse
import base64
import json
import math
import os
import sys

import torch
from torch import nn
import torch.nn.functional as F

f64 = torch.float64


def decode(t):
    raw = base64.b64decode(t["f64le"])
    flat = torch.frombuffer(bytearray(raw), dtype=f64).clone()
    return flat.reshape(t["shape"])


def encode(name, x):
    x = x.detach().to(f64).contiguous()
    data = x.numpy().astype("<f8").tobytes()
    return {"name": name, "shape": list(x.shape), "f64le": base64.b64encode(data).decode("ascii")}


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps), then scaled by a learned weight."""

    def __init__(self, width, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=f64))
        self.eps = eps

    def forward(self, x):
        mean_square = x.pow(2).mean(dim=-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(mean_square + self.eps))


def rotate_half(x):
    front, back = x.chunk(2, dim=-1)
    return torch.cat((-back, front), dim=-1)


class Rotary:
    """Rotary embedding over the even prefix of each head (an odd head_dim passes its last
    dimension through, partial rotary as GPT-NeoX does)."""

    def __init__(self, head_dim, theta):
        self.width = head_dim - head_dim % 2
        steps = torch.arange(0, self.width, 2, dtype=f64) / self.width
        self.inv_freq = 1.0 / (theta ** steps)

    def cos_sin(self, position_ids):
        angles = position_ids.to(f64)[..., None] * self.inv_freq  # [batch, seq, width/2]
        both = torch.cat((angles, angles), dim=-1)
        return both.cos(), both.sin()

    def apply(self, x, cos, sin):
        # x [batch, heads, seq, head_dim]; cos/sin [batch, seq, width] broadcast over heads.
        cos, sin = cos[:, None], sin[:, None]
        turned, kept = x[..., : self.width], x[..., self.width :]
        return torch.cat((turned * cos + rotate_half(turned) * sin, kept), dim=-1)


def repeat_kv(x, times):
    """[batch, kv_heads, seq, d] -> [batch, kv_heads·times, seq, d], each head repeated in place
    (query head h reads KV head h // times)."""
    if times == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, times, s, d).reshape(b, h * times, s, d)


def layer_kind(cfg, l):
    """The softmax layer's letter: F full, W sliding window, C chunked (attention_pattern, or one
    letter from the options when it is absent)."""
    pattern = cfg.get("attention_pattern") or ("W" if cfg.get("window", 0) > 0 else
                                               "C" if cfg.get("chunk", 0) > 0 else "F")
    return pattern[l % len(pattern)]


def document_mask(position_ids, cfg, kind):
    """Additive mask [batch, 1, seq, seq]: token i may see token j of the same document (a document
    starts where position_id == 0) as transformers' masking_utils overlays say, with q and kv the
    positions in the document: causal kv <= q; sliding window (causal) kv > q - W; bidirectional
    window q - W <= kv <= q + W_right; chunked kv // C == q // C."""
    doc = torch.cumsum((position_ids == 0).to(torch.int64), dim=-1)
    q = position_ids[:, :, None]
    kv = position_ids[:, None, :]
    allowed = doc[:, :, None] == doc[:, None, :]
    causal = cfg.get("mask", "causal") == "causal"
    if causal:
        allowed &= kv <= q
    if kind == "W":
        window = cfg["window"]
        if causal:
            allowed &= kv > q - window
        else:
            right = cfg.get("window_right", -1)
            right = window if right < 0 else right
            allowed &= (kv >= q - window) & (kv <= q + right)
    elif kind == "C":
        allowed &= torch.div(kv, cfg["chunk"], rounding_mode="floor") == torch.div(
            q, cfg["chunk"], rounding_mode="floor")
    mask = torch.zeros(allowed.shape, dtype=f64)
    mask.masked_fill_(~allowed, torch.finfo(f64).min)
    return mask[:, None]


class Attention(nn.Module):
    def __init__(self, cfg, eps):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        hidden = cfg["hidden"]
        # Qwen2-style biases on q, k, v (qkv_bias), and one on the output projection (o_bias).
        qkv_bias, o_bias = cfg.get("qkv_bias", False), cfg.get("o_bias", False)
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=qkv_bias, dtype=f64)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=qkv_bias, dtype=f64)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=qkv_bias, dtype=f64)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=o_bias, dtype=f64)
        # Qwen3-style per-head RMSNorm of q and k over head_dim (before RoPE), or with
        # qk_norm_type "layernorm" a per-head nn.LayerNorm (weight and bias, biased variance,
        # the same eps), and Qwen3.5's sigmoid output gate (a projection of its own here;
        # Qwen3.5 packs it into q_proj).
        self.qk_norm = cfg.get("qk_norm", False)
        self.output_gate = cfg.get("output_gate", False)
        if self.qk_norm:
            norm_type = cfg.get("qk_norm_type", "rmsnorm")
            if norm_type == "layernorm":
                self.q_norm = nn.LayerNorm(self.head_dim, eps=eps, dtype=f64)
                self.k_norm = nn.LayerNorm(self.head_dim, eps=eps, dtype=f64)
            elif norm_type == "rmsnorm":
                self.q_norm = RMSNorm(self.head_dim, eps)
                self.k_norm = RMSNorm(self.head_dim, eps)
            else:
                sys.exit(f"{cfg['name']}: qk_norm_type {norm_type!r} is unknown")
        if self.output_gate:
            self.g_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False, dtype=f64)
        # gpt-oss: a learnable sink logit per query head; Gemma 2: logit soft-capping.
        self.sinks = nn.Parameter(torch.zeros(self.heads, dtype=f64)) if cfg.get("sinks") else None
        self.softcap = cfg.get("softcap", 0.0)

    def forward(self, x, rotary, cos, sin, mask):
        b, s, _ = x.shape
        heads = lambda t, n: t.view(b, s, n, self.head_dim)
        q, k = heads(self.q_proj(x), self.heads), heads(self.k_proj(x), self.kv_heads)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary.apply(q.transpose(1, 2), cos, sin)
        k = rotary.apply(k.transpose(1, 2), cos, sin)
        split = lambda t, n: t.view(b, s, n, self.head_dim).transpose(1, 2)
        v = split(self.v_proj(x), self.kv_heads)
        k = repeat_kv(k, self.heads // self.kv_heads)
        v = repeat_kv(v, self.heads // self.kv_heads)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        if self.softcap:  # Gemma 2's eager attention: cap·tanh(s/cap), before the mask
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores + mask
        if self.sinks is not None:
            # gpt-oss's eager attention: the sink as one more column of every row, softmax over
            # the row and the sink (its max subtracted), the sink's column dropped before V.
            sink = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, 1)
            joined = torch.cat([scores, sink], dim=-1)
            joined = joined - joined.max(dim=-1, keepdim=True).values
            probs = torch.softmax(joined, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        if self.output_gate:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)


class SwiGLU(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden, inter = cfg["hidden"], cfg["intermediate"]
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=f64)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=f64)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=f64)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def document_bounds(position_ids):
    """[(begin, end)] of the documents of one row (a document starts where position_id == 0)."""
    starts = [i for i, p in enumerate(position_ids.tolist()) if p == 0 or i == 0]
    return list(zip(starts, starts[1:] + [position_ids.numel()]))


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer as its Hugging Face module is laid out (in_proj_qkv,
    in_proj_z, in_proj_b, in_proj_a, a depthwise causal nn.Conv1d without bias, A_log, dt_bias,
    a gated RMSNorm over each value head, out_proj), with varlen documents: the convolution and
    the recurrent state restart at every document. The delta rule runs as its recurrence, one
    token at a time, all heads at once; autograd gives the backward."""

    def __init__(self, cfg, eps):
        super().__init__()
        hidden = cfg["hidden"]
        self.hk, self.hv = cfg["linear_k_heads"], cfg["linear_v_heads"]
        self.dk, self.dv = cfg["linear_k_dim"], cfg["linear_v_dim"]
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        channels = 2 * self.key_dim + self.value_dim
        kernel = cfg["conv_kernel"]
        self.in_proj_qkv = nn.Linear(hidden, channels, bias=False, dtype=f64)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False, dtype=f64)
        self.in_proj_b = nn.Linear(hidden, self.hv, bias=False, dtype=f64)
        self.in_proj_a = nn.Linear(hidden, self.hv, bias=False, dtype=f64)
        self.conv1d = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False,
                                padding=kernel - 1, dtype=f64)
        self.A_log = nn.Parameter(torch.zeros(self.hv, dtype=f64))
        self.dt_bias = nn.Parameter(torch.ones(self.hv, dtype=f64))
        self.norm_weight = nn.Parameter(torch.ones(self.dv, dtype=f64))
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False, dtype=f64)
        self.eps = eps

    @staticmethod
    def unit(x):
        return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)

    def forward(self, x, bounds):
        s = x.shape[1]
        mixed = self.in_proj_qkv(x)[0]  # [S, C]
        conv = []
        for a, e in bounds:  # Conv1d pads both sides by kernel−1; the first e−a outputs are causal
            y = self.conv1d(mixed[a:e].T[None])[0, :, : e - a]
            conv.append(F.silu(y).T)
        conv = torch.cat(conv)
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.hv // self.hk
        q = self.unit(q.reshape(s, self.hk, self.dk)).repeat_interleave(rep, dim=1) / math.sqrt(self.dk)
        k = self.unit(k.reshape(s, self.hk, self.dk)).repeat_interleave(rep, dim=1)
        v = v.reshape(s, self.hv, self.dv)
        beta = torch.sigmoid(self.in_proj_b(x)[0])
        g = -self.A_log.exp() * F.softplus(self.in_proj_a(x)[0] + self.dt_bias)
        outs = []
        for a, e in bounds:
            state = torch.zeros(self.hv, self.dk, self.dv, dtype=f64)
            for t in range(a, e):
                state = state * g[t].exp()[:, None, None]
                remembered = torch.einsum("hkv,hk->hv", state, k[t])
                delta = beta[t][:, None] * (v[t] - remembered)
                state = state + k[t][:, :, None] * delta[:, None, :]
                outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
        core = torch.stack(outs)  # [S, Hv, dv]
        z = self.in_proj_z(x)[0].reshape(s, self.hv, self.dv)
        normed = core * torch.rsqrt(core.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        gated = self.norm_weight * normed * F.silu(z)
        return self.out_proj(gated.reshape(1, s, self.value_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, eps, linear):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden"], eps)
        self.linear = linear
        if linear:
            self.linear_attn = GatedDeltaNet(cfg, eps)
        else:
            self.self_attn = Attention(cfg, eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden"], eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, rotary, cos, sin, mask, bounds):
        a = self.input_layernorm(x)
        mixer = self.linear_attn(a, bounds) if self.linear else self.self_attn(a, rotary, cos, sin, mask)
        x = x + mixer
        return x + self.mlp(self.post_attention_layernorm(x))


def is_linear(cfg, l):
    pattern = cfg.get("layer_pattern", "S")
    return pattern[l % len(pattern)] == "L"


class Decoder(nn.Module):
    def __init__(self, cfg, eps, theta):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab"], cfg["hidden"], dtype=f64)
        self.layers = nn.ModuleList(DecoderLayer(cfg, eps, is_linear(cfg, l)) for l in range(cfg["layers"]))
        self.norm = RMSNorm(cfg["hidden"], eps)
        self.lm_head = nn.Linear(cfg["hidden"], cfg["vocab"], bias=False, dtype=f64)
        self.rotary = Rotary(cfg["head_dim"], theta)
        self.cfg = cfg

    def forward(self, input_ids, position_ids):
        embedded = self.embed_tokens(input_ids)
        embedded.retain_grad()
        cos, sin = self.rotary.cos_sin(position_ids)
        masks = {kind: document_mask(position_ids, self.cfg, kind) for kind in "FWC"
                 if any(layer_kind(self.cfg, l) == kind for l in range(len(self.layers)))}
        bounds = document_bounds(position_ids[0])
        x = embedded
        for l, layer in enumerate(self.layers):
            x = layer(x, self.rotary, cos, sin, masks.get(layer_kind(self.cfg, l)), bounds)
        return self.lm_head(self.norm(x)), embedded


def seqpar_names(cfg):
    """seqpar's parameter name -> (torch parameter path, stored transposed?). seqpar keeps
    projections as [in, out] (y = x·W); nn.Linear keeps weight as [out, in] (y = x·Wᵀ)."""
    names = {"embed": ("embed_tokens.weight", False)}
    for l in range(cfg["layers"]):
        p = f"layers.{l}."
        names.update({
            f"L{l}.attn_norm": (p + "input_layernorm.weight", False),
            f"L{l}.mlp_norm": (p + "post_attention_layernorm.weight", False),
            f"L{l}.w_gate": (p + "mlp.gate_proj.weight", True),
            f"L{l}.w_up": (p + "mlp.up_proj.weight", True),
            f"L{l}.w_down": (p + "mlp.down_proj.weight", True),
        })
        if is_linear(cfg, l):
            g = p + "linear_attn."
            names.update({
                f"L{l}.in_qkv": (g + "in_proj_qkv.weight", True),
                f"L{l}.in_z": (g + "in_proj_z.weight", True),
                f"L{l}.in_b": (g + "in_proj_b.weight", True),
                f"L{l}.in_a": (g + "in_proj_a.weight", True),
                f"L{l}.conv": (g + "conv1d.weight", False),  # [C, 1, kernel] vs seqpar's [C, kernel]
                f"L{l}.A_log": (g + "A_log", False),
                f"L{l}.dt_bias": (g + "dt_bias", False),
                f"L{l}.gdn_norm": (g + "norm_weight", False),
                f"L{l}.out_proj": (g + "out_proj.weight", True),
            })
            continue
        names.update({
            f"L{l}.wq": (p + "self_attn.q_proj.weight", True),
            f"L{l}.wk": (p + "self_attn.k_proj.weight", True),
            f"L{l}.wv": (p + "self_attn.v_proj.weight", True),
            f"L{l}.wo": (p + "self_attn.o_proj.weight", True),
        })
        if cfg.get("qkv_bias", False):
            names[f"L{l}.bq"] = (p + "self_attn.q_proj.bias", False)
            names[f"L{l}.bk"] = (p + "self_attn.k_proj.bias", False)
            names[f"L{l}.bv"] = (p + "self_attn.v_proj.bias", False)
        if cfg.get("o_bias", False):
            names[f"L{l}.bo"] = (p + "self_attn.o_proj.bias", False)
        if cfg.get("qk_norm", False):
            names[f"L{l}.q_norm"] = (p + "self_attn.q_norm.weight", False)
            names[f"L{l}.k_norm"] = (p + "self_attn.k_norm.weight", False)
            if cfg.get("qk_norm_type", "rmsnorm") == "layernorm":
                names[f"L{l}.q_norm_bias"] = (p + "self_attn.q_norm.bias", False)
                names[f"L{l}.k_norm_bias"] = (p + "self_attn.k_norm.bias", False)
        if cfg.get("output_gate", False):
            names[f"L{l}.wg"] = (p + "self_attn.g_proj.weight", True)
        if cfg.get("sinks", False):
            names[f"L{l}.sinks"] = (p + "self_attn.sinks", False)
    names["final_norm"] = ("norm.weight", False)
    names["lm_head"] = ("lm_head.weight", True)
    return names


def run(case):
    cfg = case["scenario"]
    conv = case["conventions"]
    model = Decoder(cfg, conv["rms_norm_eps"], conv["rope_theta"])
    params = dict(model.named_parameters())
    names = seqpar_names(cfg)
    if sorted(names) != sorted(t["name"] for t in case["weights"]):
        sys.exit(f"{cfg['name']}: parameter names differ from the model's: "
                 f"{sorted(t['name'] for t in case['weights'])}")
    with torch.no_grad():
        for t in case["weights"]:
            path, transposed = names[t["name"]]
            value = decode(t)
            if transposed:
                value = value.T
            params[path].copy_(value.reshape(params[path].shape))

    batch = case["batch"]
    input_ids = torch.tensor([batch["input_ids"]], dtype=torch.int64)
    position_ids = torch.tensor([batch["position_ids"]], dtype=torch.int64)
    labels = torch.tensor(batch["labels"], dtype=torch.int64)
    logits, embedded = model(input_ids, position_ids)
    logits = logits[0]
    valid = int((labels != -100).sum())
    ce = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    loss = ce / max(valid, 1)
    loss.backward()

    tensors = [encode("logits", logits), encode("embedding.output.grad", embedded.grad[0])]
    for t in case["weights"]:
        path, transposed = names[t["name"]]
        g = params[path].grad
        g = g.T if transposed else g.reshape(t["shape"])
        tensors.append(encode("grad." + t["name"], g))
    return {
        "scenario": cfg["name"],
        "producer": f"tests/jobs/torch_reference.py, torch {torch.__version__}, float64",
        "loss": loss.item(),
        "valid_tokens": valid,
        "tensors": tensors,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="NAME.input.json files from torch_crosscheck dump")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out_dir, exist_ok=True)
    for path in args.inputs:
        with open(path) as f:
            case = json.load(f)
        out = run(case)
        target = os.path.join(args.out_dir, case["scenario"]["name"] + ".json")
        with open(target, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(f"{case['scenario']['name']}: loss {out['loss']!r} over {out['valid_tokens']} tokens -> {target}")


if __name__ == "__main__":
    main()

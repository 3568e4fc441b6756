#!/usr/bin/env python3
r"""Runs VeOmni's own PyTorch GatedDeltaNet functions on inputs written by seqpar, for
`torch_crosscheck gdn-compare` (tests/equivalence/torch_crosscheck.cpp).

VeOmni's Qwen3.5 modelling file (veomni/models/transformers/qwen3_5/generated/
patched_modeling_qwen3_5_gpu.py) defines, in plain PyTorch, `l2norm`,
`torch_chunk_gated_delta_rule` (the chunked WY form of FLA's chunk_gated_delta_rule),
`torch_recurrent_gated_delta_rule` and the module `Qwen3_5RMSNormGated`. The file as a whole
imports transformers and VeOmni; this script reads it with `ast`, takes only those four
definitions and runs them with torch (nothing of VeOmni is copied into seqpar: give the path of
a VeOmni checkout). Their functions have no varlen argument, so each document runs as its own
batch (what cu_seqlens means: the state starts at 0 in every document). They compute in
float32 internally (`.to(torch.float32)`), so the comparison tolerance is float32's.

    build/tests/equivalence/torch_crosscheck gdn-dump /tmp/gdn-in.json
    /usr/bin/python3 tests/jobs/gdn_veomni.py --veomni PATH/TO/patched_modeling_qwen3_5_gpu.py \
        /tmp/gdn-in.json tests/equivalence/data/torch/gdn-veomni.json
    build/tests/equivalence/torch_crosscheck gdn-compare tests/equivalence/data/torch/gdn-veomni.json
"""
import argparse
import ast
import base64
import hashlib
import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

f64 = torch.float64
WANTED = ["l2norm", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
          "Qwen3_5RMSNormGated"]


def load_veomni(path):
    with open(path, encoding="utf-8") as f:
        source = f.read()
    tree = ast.parse(source)
    found = [n for n in tree.body
             if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in WANTED]
    missing = sorted(set(WANTED) - {n.name for n in found})
    if missing:
        sys.exit(f"{path}: no definition of {', '.join(missing)} (is it VeOmni's Qwen3.5 file?)")
    module = ast.Module(body=found, type_ignores=[])
    namespace = {"torch": torch, "F": F, "nn": nn}
    exec(compile(module, path, "exec"), namespace)
    return namespace, hashlib.sha256(source.encode()).hexdigest()


def decode(t):
    raw = base64.b64decode(t["f64le"])
    return torch.frombuffer(bytearray(raw), dtype=f64).clone().reshape(t["shape"])


def encode(name, x):
    x = x.detach().to(f64).contiguous()
    data = x.numpy().astype("<f8").tobytes()
    return {"name": name, "shape": list(x.shape), "f64le": base64.b64encode(data).decode("ascii")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--veomni", required=True, help="VeOmni's patched_modeling_qwen3_5_gpu.py")
    ap.add_argument("input", help="the JSON of torch_crosscheck gdn-dump")
    ap.add_argument("output")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ns, digest = load_veomni(args.veomni)
    with open(args.input) as f:
        case = json.load(f)
    t = {x["name"]: decode(x) for x in case["tensors"]}
    hk, hv, dk, dv = case["k_heads"], case["v_heads"], case["k_dim"], case["v_dim"]
    seq = t["q"].shape[0]
    rep = hv // hk
    # [T, H, d] with the query/key heads repeated to the value heads, as Qwen3_5GatedDeltaNet
    # does (repeat_interleave) before it calls the delta rule.
    q = t["q"].reshape(seq, hk, dk).repeat_interleave(rep, dim=1)
    k = t["k"].reshape(seq, hk, dk).repeat_interleave(rep, dim=1)
    v = t["v"].reshape(seq, hv, dv)
    g, beta = t["g"], t["beta"]
    chunk, recurrent = [], []
    bounds = case["cu_seqlens"]
    for a, e in zip(bounds, bounds[1:]):
        doc = [x[None, a:e] for x in (q, k, v, g, beta)]  # batch 1: [1, len, H, d]
        out, _ = ns["torch_chunk_gated_delta_rule"](*doc, use_qk_l2norm_in_kernel=True)
        chunk.append(out[0])
        out, _ = ns["torch_recurrent_gated_delta_rule"](*doc, initial_state=None,
                                                         output_final_state=False,
                                                         use_qk_l2norm_in_kernel=True)
        recurrent.append(out[0])
    chunk = torch.cat(chunk).reshape(seq, hv * dv)
    recurrent = torch.cat(recurrent).reshape(seq, hv * dv)
    norm = ns["Qwen3_5RMSNormGated"](dv, eps=case["rms_norm_eps"])
    with torch.no_grad():
        norm.weight.copy_(t["norm_weight"].reshape(dv).to(norm.weight.dtype))
        gated = norm(t["x"].reshape(-1, dv), t["z"].reshape(-1, dv)).reshape(seq, hv * dv)
        unit_q = ns["l2norm"](t["q"].reshape(seq, hk, dk), dim=-1, eps=1e-6).reshape(seq, hk * dk)
    out = {
        "producer": f"tests/jobs/gdn_veomni.py, torch {torch.__version__}; VeOmni "
                    f"{args.veomni.split('/')[-1]} sha256 {digest[:16]}",
        "inputs": case,
        "outputs": [encode("veomni.chunk_gated_delta_rule", chunk),
                    encode("veomni.recurrent_gated_delta_rule", recurrent),
                    encode("veomni.rms_norm_gated", gated), encode("veomni.l2norm.q", unit_q)],
    }
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {args.output}: {len(bounds) - 1} documents, {seq} tokens, Hk {hk} Hv {hv}")


if __name__ == "__main__":
    main()

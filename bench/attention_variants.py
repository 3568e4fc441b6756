#!/usr/bin/env python3
"""Where seqpar's cuDNN attention loses to torch's SDPA: each pass timed alone, per graph choice.

For one causal document of S tokens (Hq query heads, Hkv key/value heads, bf16, d 64 and 128) it
times torch's scaled_dot_product_attention forward alone and forward+backward (the backward is
the difference) under its cuDNN and flash backends, then runs bench/gpu_attention_bench with
--phase fwd and --phase bwd for each of seqpar's graph choices: the ragged graph (with and
without dynamic shapes) and the dense one-document graph, each with cuDNN's forward
implementations (auto, composite, unified), the backward deterministic and not. One table of
TFLOP/s per pass, and each against SDPA's best backend for that pass.

  attention_variants.py --seqpar build/bench/gpu_attention_bench [--tokens 8192] [--out F.json]
Exit status: 0, 2 on a usage or run error (a variant cuDNN refuses is reported, not fatal).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

# SDPA timed as bench/attention_vs_sdpa.py times it (this directory is on sys.path when run).
from attention_vs_sdpa import sdpa_pass_times  # noqa: E402

VARIANTS = [  # name, gpu_attention_bench flags
    ("ragged", ["--dense", "0", "--dynamic", "0", "--forward-impl", "auto"]),
    ("ragged+dynamic", ["--dense", "0", "--dynamic", "1", "--forward-impl", "auto"]),
    ("ragged composite", ["--dense", "0", "--dynamic", "0", "--forward-impl", "composite"]),
    ("dense", ["--dense", "1", "--forward-impl", "auto"]),
    ("dense composite", ["--dense", "1", "--forward-impl", "composite"]),
    ("dense unified", ["--dense", "1", "--forward-impl", "unified"]),
]


def seqpar_rates(exe, flags, phase, det, S, hq, hkv):
    with tempfile.TemporaryDirectory() as tmp:
        js = os.path.join(tmp, "r.json")
        size = S * hq * 128
        cmd = [exe, "--engine", "cudnn", "--heads", str(hq), "--kv-heads", str(hkv), "--phase", phase,
               "--deterministic", str(det), "-b", str(size), "-e", str(size), "-n", "10", "-w", "2",
               "-J", js] + flags
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode not in (0, 1) or not os.path.exists(js):
            tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or ["?"]
            return None, f"exit {r.returncode}: {tail[0][:160]}"
        rows = json.load(open(js))["rows"]
        return {(row["type"], int(row["case"].split("=")[1])): row["rate"] for row in rows}, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqpar", required=True, help="path of gpu_attention_bench")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out")
    a = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend
    except ImportError as e:
        print(f"attention_variants: torch is needed: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("attention_variants: no CUDA device", file=sys.stderr)
        return 2
    import warnings
    warnings.filterwarnings("ignore")
    S, hq, hkv = a.tokens, a.heads, a.kv_heads
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "S": S,
              "heads": hq, "kv_heads": hkv, "sdpa": {}, "seqpar": {}}
    fwd_flop = {d: 4.0 * S * S * hq * d / 2 for d in (64, 128)}
    for d in (64, 128):
        for bname, b in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                tf, tb = sdpa_pass_times(torch, F, b, S, hq, hkv, d, torch.bfloat16, a.iters)
            except Exception as e:
                result["sdpa"][f"{bname} d={d}"] = f"n/a ({type(e).__name__})"
                continue
            result["sdpa"][f"{bname} d={d}"] = {
                "fwd": fwd_flop[d] / tf / 1e12, "bwd": 2.5 * fwd_flop[d] / (tb - tf) / 1e12,
                "both": 3.5 * fwd_flop[d] / tb / 1e12}
    for name, flags in VARIANTS:
        entry = {}
        for phase, det in (("fwd", 1), ("bwd", 0), ("bwd", 1)):
            rates, err = seqpar_rates(a.seqpar, flags, phase, det, S, hq, hkv)
            key = phase if phase == "fwd" else f"bwd det={det}"
            entry[key] = err if err else {f"d={d}": rates.get(("bfloat16", d)) for d in (64, 128)}
        result["seqpar"][name] = entry
    best = {}
    for d in (64, 128):
        for p in ("fwd", "bwd", "both"):
            vals = [v[p] for k, v in result["sdpa"].items() if k.endswith(f"d={d}") and isinstance(v, dict)]
            best[(d, p)] = max(vals) if vals else float("nan")
    print(f"# {result['device']}, torch {result['torch']}, S={S}, Hq={hq}, Hkv={hkv}, bf16, causal; TFLOP/s")
    for k, v in result["sdpa"].items():
        print(f"SDPA {k:16}", v if isinstance(v, str) else
              f"fwd {v['fwd']:6.1f}  bwd {v['bwd']:6.1f}  fwd+bwd {v['both']:6.1f}")
    print(f"{'seqpar variant':18} {'d':>4} {'fwd':>7} {'/SDPA':>6} {'bwd':>7} {'/SDPA':>6} {'bwd det':>8} {'/SDPA':>6}")
    for name, entry in result["seqpar"].items():
        for d in (64, 128):
            cells = []
            for key, p in (("fwd", "fwd"), ("bwd det=0", "bwd"), ("bwd det=1", "bwd")):
                e = entry[key]
                if isinstance(e, str):
                    cells.append(f"{'refused':>7} {'':>6}")
                    continue
                r = e.get(f"d={d}") or float("nan")
                cells.append(f"{r:7.1f} {r / best[(d, p)]:6.2f}")
            print(f"{name:18} {d:>4} " + " ".join(cells))
        for key, e in entry.items():
            if isinstance(e, str):
                print(f"  {name} {key}: {e}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

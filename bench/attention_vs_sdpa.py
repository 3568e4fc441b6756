#!/usr/bin/env python3
"""seqpar's GPU attention beside torch's scaled_dot_product_attention, same GPU, same run.

For each point (dtype bf16/f16, head dim 64/128, S tokens, one causal document, Hq query heads
and Hkv key/value heads) it times torch's SDPA forward+backward with every fused backend torch
offers on this GPU (flash, cuDNN, memory-efficient; the best one is the baseline) and runs
bench/gpu_attention_bench (--engine cudnn) on the same shapes, then prints one table:
seqpar TFLOP/s, SDPA TFLOP/s, their ratio. FLOPs as gpu_attention_bench: causal
fwd = 4*S^2*Hq*d/2, fwd+bwd = 3.5*fwd, for both, so the ratio is a ratio of times.

SDPA is timed with CUDA events around N iterations after warm-up (median of 5 such groups),
on [1, S, H, d] tensors viewed as [1, H, S, d] (the packed row layout seqpar uses), with
enable_gqa when Hkv < Hq.

  attention_vs_sdpa.py --seqpar build/bench/gpu_attention_bench [--out FILE.json]
      [--tokens 4096,8192,16384] [--heads 32] [--kv-heads 8] [--modes 0,1]
--modes: seqpar's cuDNN backward non-deterministic (0: cuDNN's choice, like SDPA's own
backends) and deterministic (1: no atomics, seqpar's default); the ratio column is mode 0's.
Exit status: 0, 1 when a seqpar point reports #wrong > 0, 2 on a usage or run error.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile


def sdpa_pass_times(torch, F, backend, S, hq, hkv, d, dtype, iters, forward=True):
    """SDPA's (forward seconds or None, forward+backward seconds) on one causal document, each a
    median of 5 groups of `iters` timed with CUDA events after 2 warm-up calls
    (bench/attention_variants.py times the forward too)."""
    from torch.nn.attention import sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(S * d)

    def t(h):
        return torch.randn(1, S, h, d, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)

    q, k, v = t(hq).requires_grad_(), t(hkv).requires_grad_(), t(hkv).requires_grad_()
    do = t(hq)
    kw = {"is_causal": True}
    if hkv != hq:
        kw["enable_gqa"] = True

    def timed(fn):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(iters):
                fn()
            e1.record()
            e1.synchronize()
            out.append(e0.elapsed_time(e1) / iters * 1e-3)
        return statistics.median(out)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, **kw)

    def both():
        F.scaled_dot_product_attention(q, k, v, **kw).backward(do)

    with sdpa_kernel([backend]):
        return (timed(fwd) if forward else None), timed(both)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqpar", required=True, help="path of gpu_attention_bench")
    ap.add_argument("--out", help="write the table as JSON here")
    ap.add_argument("--tokens", default="4096,8192,16384")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--modes", default="0,1")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend
    except ImportError as e:
        print(f"attention_vs_sdpa: torch is needed: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("attention_vs_sdpa: no CUDA device; nothing to compare", file=sys.stderr)
        return 2
    import warnings
    warnings.filterwarnings("ignore", message=".*same num_heads.*")
    tokens = [int(x) for x in a.tokens.split(",")]
    hq, hkv = a.heads, a.kv_heads
    # seqpar: one gpu_attention_bench run per mode over the sizes (size = S*Hq*128 bytes).
    modes = [int(m) for m in a.modes.split(",")]
    sizes = [s * hq * 128 for s in tokens]
    ours_by_mode = {}
    for mode in modes:
        with tempfile.TemporaryDirectory() as tmp:
            js = os.path.join(tmp, "seqpar.json")
            cmd = [a.seqpar, "--engine", "cudnn", "--heads", str(hq), "--kv-heads", str(hkv),
                   "--deterministic", str(mode), "-b", str(min(sizes)), "-e", str(max(sizes)),
                   "-f", "2", "-n", str(a.iters), "-w", "2", "-J", js]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode not in (0, 1):
                print(f"attention_vs_sdpa: {' '.join(cmd)} exited {r.returncode}:\n{r.stdout}{r.stderr}",
                      file=sys.stderr)
                return 2
            ours_by_mode[mode] = json.load(open(js))
    ours = ours_by_mode[modes[0]]
    wrong = sum(o.get("wrong") or 0 for o in ours_by_mode.values())
    name = torch.cuda.get_device_name(0)
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    rows = []
    for i, row in enumerate(ours["rows"]):
        S = row["count"]
        d = int(row["case"].split("=")[1])
        dtype = {"bfloat16": torch.bfloat16, "half": torch.float16}[row["type"]]
        flop = 3.5 * 4.0 * S * S * hq * d / 2
        best = None
        per = {}
        for bname, b in backends:
            try:
                sec = sdpa_pass_times(torch, F, b, S, hq, hkv, d, dtype, a.iters, forward=False)[1]
            except Exception as e:  # this backend does not take the shape here
                per[bname] = f"n/a ({type(e).__name__})"
                continue
            per[bname] = flop / sec / 1e12
            if best is None or sec < best[1]:
                best = (bname, sec)
        sdpa_tf = flop / best[1] / 1e12 if best else float("nan")
        seq = {m: ours_by_mode[m]["rows"][i]["rate"] for m in modes}
        rows.append({"S": S, "d": d, "dtype": row["type"], "seqpar_tflops": seq,
                     "sdpa_tflops": sdpa_tf, "sdpa_backend": best[0] if best else None,
                     "ratio": {m: seq[m] / sdpa_tf if best else None for m in modes},
                     "sdpa_backends": per,
                     "seqpar_wrong": {m: ours_by_mode[m]["rows"][i]["wrong"] for m in modes}})
    names = {0: "non-det", 1: "det"}
    print(f"# seqpar (cuDNN fused attention; backward {', '.join(names[m] for m in modes)}) vs torch "
          f"{torch.__version__} SDPA (best fused backend), {name}, same run")
    print(f"# one causal document, Hq={hq} Hkv={hkv}; FLOPs fwd+bwd = 3.5*4*S^2*Hq*d/2 for both; TFLOP/s")
    head = "".join(f" {'seqpar ' + names[m]:>15}" for m in modes)
    ratio_head = "".join(f" {'ratio ' + names[m]:>13}" for m in modes)
    print(f"{'S':>7} {'d':>4} {'dtype':>9}{head} {'SDPA':>8} {'backend':>10}{ratio_head}  per SDPA backend")
    for r in rows:
        per = ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in r["sdpa_backends"].items())
        vals = "".join(f" {r['seqpar_tflops'][m]:>15.1f}" for m in modes)
        ratios = "".join(f" {r['ratio'][m] if r['ratio'][m] is not None else float('nan'):>13.2f}" for m in modes)
        print(f"{r['S']:>7} {r['d']:>4} {r['dtype']:>9}{vals} {r['sdpa_tflops']:>8.1f} "
              f"{str(r['sdpa_backend']):>10}{ratios}  {per}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "heads": hq, "kv_heads": hkv,
                       "modes": modes, "rows": rows}, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

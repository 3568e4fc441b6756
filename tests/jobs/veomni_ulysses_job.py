#!/usr/bin/env python3
r"""A Ulysses attention step through VeOmni's own all-to-all functions, dumped with the seqpar
hook (tools/seqpar_dump.py) the way a VeOmni user would, for `seqpar validate --dump DIR`.

VeOmni's fused-attention backends (veomni/ops/kernels/attention/ulysses.py) wrap the attention
kernel in `prepare_ulysses_qkv` (the KV heads repeat_interleave'd U/Hkv times when U > Hkv, then
`gather_seq_scatter_heads` on q, k, v) and `restore_ulysses_output` (`gather_heads_scatter_seq`);
both call veomni/distributed/sequence_parallel/ulysses.py (`_SeqAllToAll`, `all_to_all_tensor`,
`_all_to_all_single` / `_all_to_all`) and utils.py (`pad_tensor`, `unpad_tensor`). This script
reads those definitions from a VeOmni checkout with `ast` (async_ulysses_veomni.load_veomni:
nothing else of VeOmni is imported or copied into seqpar) and runs them on U gloo processes, f32,
in VeOmni's layout [batch 1, tokens, heads, head_dim] (batch 1, so VeOmni takes its
squeeze path: seq_dim 0, head_dim 1, all_to_all_single). The attention in between is
sp_jobs.py's masked varlen causal attention; inputs, shards, loss and the healthy twin's
configuration are sp_jobs.py's Ulysses job (S 32, H 4, Hkv 2, D 8, documents [12, 20], seed 0).
The hook taps q/k/v.local, q/k/v.gathered, out.attn, lse and out.local (layout bshd, lse hs)
and records their gradients.

Control `--variant swapped_dims`: the user calls VeOmni's gather_seq_scatter_heads /
gather_heads_scatter_seq directly with seq_dim and head_dim swapped (seq_dim=1, head_dim=0 on the
squeezed [s, H, D] tensors): the sequence is scattered and the heads gathered, q.gathered is
[s/U, U*H, D]; the job still runs (the reverse call undoes the exchange).

    python3 veomni_ulysses_job.py --veomni PATH --out DIR [--ulysses U] [--kv-heads N]
                                  [--variant healthy|swapped_dims] [--veomni-commit SHA]
    python3 veomni_ulysses_job.py --all --veomni PATH OUTROOT
        # OUTROOT/veomni-ulysses-u2-f32, veomni-ulysses-u4-f32 (healthy), and the control
        # veomni-ulysses-swapped_dims-f32, each checked as sp_jobs.py --selfcheck does (healthy)
        # or compared with its healthy twin (control); their entries (job "veomni") are merged
        # into OUTROOT/expected.json, other entries kept.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import async_ulysses_veomni  # noqa: E402
import sp_jobs  # noqa: E402  (puts tools/ on sys.path)
import seqpar_dump  # noqa: E402

FILES = {
    "veomni/distributed/sequence_parallel/utils.py": ["pad_tensor", "unpad_tensor"],
    "veomni/distributed/sequence_parallel/ulysses.py":
        ["_all_to_all", "_all_to_all_single", "all_to_all_tensor", "_SeqAllToAll",
         "gather_heads_scatter_seq", "gather_seq_scatter_heads"],
    "veomni/ops/kernels/attention/ulysses.py": ["prepare_ulysses_qkv", "restore_ulysses_output"],
}

CAUSES = {
    "healthy": "",
    "swapped_dims": "VeOmni's gather_seq_scatter_heads/gather_heads_scatter_seq called with "
                    "seq_dim and head_dim swapped: scatters the sequence, gathers the heads",
}


def veomni_commit(root):
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        return out or None
    except (OSError, subprocess.CalledProcessError):
        return None


def make_cfg(U, Hkv, variant):
    cfg = sp_jobs.make_cfg("ulysses", "healthy_u2", "f32", 0)
    cfg.update(U=U, Hkv=Hkv, variant=variant)
    if cfg["H"] % U or (U > Hkv and U % Hkv) or (U <= Hkv and Hkv % U):
        raise SystemExit("VeOmni needs H %% U == 0 and U %% Hkv == 0 or Hkv %% U == 0 "
                         "(H %d, U %d, Hkv %d)" % (cfg["H"], U, Hkv))
    return cfg


def job_string(cfg, commit, digest):
    return ("veomni_ulysses_job.py --ulysses %d --kv-heads %d --variant %s: VeOmni %s "
            "(sources sha256 %s) prepare_ulysses_qkv/restore_ulysses_output -> "
            "gather_seq_scatter_heads/gather_heads_scatter_seq, gloo %d processes, f32" % (
                cfg["U"], cfg["Hkv"], cfg["variant"], commit or "commit unknown", digest[:16],
                cfg["U"]))


def _worker(rank, cfg, root, commit, out_dir, port):
    torch.set_num_threads(1)
    U = cfg["U"]
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=U)
    group = dist.group.WORLD
    ns, digest = async_ulysses_veomni.load_veomni(root, group, files=FILES, world_size=U)
    H, Hkv, D = cfg["H"], cfg["Hkv"], cfg["D"]

    Q, K, V, W = sp_jobs.global_inputs(cfg)
    idx = sp_jobs.shard_tokens(cfg, 0, rank)
    gpos = sp_jobs.global_positions(cfg["cu"], cfg["S"])
    pos = [gpos[t] for t in idx]
    it = torch.tensor(idx, dtype=torch.long)
    # VeOmni's layout: [batch 1, local tokens, heads, head_dim].
    q = Q[it].unsqueeze(0).clone().requires_grad_(True)
    k = K[it].unsqueeze(0).clone().requires_grad_(True)
    v = V[it].unsqueeze(0).clone().requires_grad_(True)
    w = W[it].unsqueeze(0).clone()
    scale = 1.0 / math.sqrt(D)

    d = seqpar_dump.Dumper(
        out_dir, ulysses=U, ring=1, ulysses_rank=rank, ring_rank=0, heads=H, kv_heads=Hkv,
        head_dim=D, scale=scale, causal=True, cu_seqlens=cfg["cu"], position_ids=pos,
        ring_layout="contiguous", dtype=torch.float32, job=job_string(cfg, commit, digest))
    with d.call(name="L0.attn"):
        d.tap("q.local", q, layout="bshd")
        d.tap("k.local", k, layout="bshd")
        d.tap("v.local", v, layout="bshd")
        if cfg["variant"] == "healthy":
            qg, kg, vg, _ = ns["prepare_ulysses_qkv"](q, k, v, group=group, ulysses_size=U)
        else:  # swapped_dims: the user's own call of VeOmni's function, dims swapped
            kr, vr = k, v
            if U > Hkv:
                kr = torch.repeat_interleave(k, dim=2, repeats=U // Hkv)
                vr = torch.repeat_interleave(v, dim=2, repeats=U // Hkv)
            qg, kg, vg = (ns["gather_seq_scatter_heads"](x.squeeze(0), seq_dim=1, head_dim=0,
                                                         group=group).unsqueeze(0)
                          for x in (q, kr, vr))
        d.tap("q.gathered", qg, layout="bshd")
        d.tap("k.gathered", kg, layout="bshd")
        d.tap("v.gathered", vg, layout="bshd")
        n = qg.shape[1]
        mask = sp_jobs.section_mask("diag", cfg["cu"], n)
        o, lse = sp_jobs.attend(qg.squeeze(0), kg.squeeze(0), vg.squeeze(0), mask, scale)
        o = o.unsqueeze(0)
        d.tap("out.attn", o, layout="bshd")
        d.tap("lse", lse, layout="hs")
        if cfg["variant"] == "healthy":
            out = ns["restore_ulysses_output"](o, group=group)
        else:
            out = ns["gather_heads_scatter_seq"](o.squeeze(0), seq_dim=1, head_dim=0,
                                                 group=group).unsqueeze(0)
        d.tap("out.local", out, layout="bshd")
    (out * w).sum().backward()
    d.close()
    dist.barrier()
    dist.destroy_process_group()


def run_job(cfg, root, commit, out):
    os.makedirs(out, exist_ok=True)
    sp_jobs._clear_dump_dir(out)
    mp.spawn(_worker, args=(cfg, root, commit, out, sp_jobs._free_port()), nprocs=cfg["U"],
             join=True)


ALL = [  # (directory, U, Hkv, variant)
    ("veomni-ulysses-u2-f32", 2, 2, "healthy"),
    ("veomni-ulysses-u4-f32", 4, 2, "healthy"),
    ("veomni-ulysses-swapped_dims-f32", 2, 2, "swapped_dims"),
]


def cmd_all(root, commit, outroot):
    os.makedirs(outroot, exist_ok=True)
    expected = {}
    ok = True
    healthy = {}
    for name, U, Hkv, variant in ALL:
        cfg = make_cfg(U, Hkv, variant)
        out = os.path.join(outroot, name)
        run_job(cfg, root, commit, out)
        entry = {"job": "veomni", "variant": "healthy_u%d" % U if variant == "healthy" else variant,
                 "dtype": "f32", "healthy": variant == "healthy"}
        if variant == "healthy":
            healthy[(U, Hkv)] = out
            entry.update(first_stage=None, ranks=[], cause="")
            errs = sp_jobs.selfcheck_dump(out, cfg)
            good = all(e <= 1e-5 for e in errs.values())
            ok = ok and good
            print("%-34s healthy; vs float64 reference: %s  %s" % (
                name, "ok" if good else "FAIL",
                "  ".join("%s=%.2e" % kv for kv in sorted(errs.items()))))
        else:
            twin = healthy.get((U, Hkv))
            with tempfile.TemporaryDirectory(prefix="veomni-twin-") as tmp:
                if twin is None:
                    twin = os.path.join(tmp, "twin")
                    run_job(dict(cfg, variant="healthy"), root, commit, twin)
                c = sp_jobs.compare_dumps(out, twin)
            entry.update(first_stage=c["first_stage"], ranks=c["ranks"],
                         first_mandatory_stage=c["first_mandatory_stage"],
                         first_mandatory_ranks=c["first_mandatory_ranks"],
                         cause=CAUSES[variant], crashed=False, differing=c["differing"])
            print("%-34s first_stage=%s ranks=%s" % (name, c["first_stage"], c["ranks"]))
        expected[name] = entry
    # Merged into OUTROOT/expected.json (sp_jobs.py --all's file and format), other entries kept.
    path = os.path.join(outroot, "expected.json")
    if os.path.exists(path):
        with open(path) as f:
            expected = dict(json.load(f), **expected)
    with open(path, "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--veomni", required=True, help="a VeOmni checkout (its root directory)")
    ap.add_argument("--veomni-commit", help="recorded in the meta's job (default: git rev-parse)")
    ap.add_argument("--out")
    ap.add_argument("--ulysses", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--variant", choices=sorted(CAUSES), default="healthy")
    ap.add_argument("--all", action="store_true",
                    help="the standard set into OUTROOT (and its entries into OUTROOT/expected.json)")
    ap.add_argument("outroot", nargs="?", metavar="OUTROOT")
    a = ap.parse_args(argv)
    commit = a.veomni_commit or veomni_commit(a.veomni)
    if a.all:
        if not a.outroot:
            ap.error("--all needs OUTROOT")
        return 0 if cmd_all(a.veomni, commit, a.outroot) else 1
    if a.outroot or not a.out:
        ap.error("--out DIR (or --all OUTROOT) is needed")
    run_job(make_cfg(a.ulysses, a.kv_heads, a.variant), a.veomni, commit, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

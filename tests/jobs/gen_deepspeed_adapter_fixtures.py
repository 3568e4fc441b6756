#!/usr/bin/python3
"""Generate golden fixtures for `seqpar collate --profile deepspeed` by running DeepSpeed's real
UlyssesSPDataLoaderAdapter on the CPU: P processes, gloo, one DataLoader per rank.

Our own driver (stdlib + torch only). It loads `deepspeed/runtime/sequence_parallel/ulysses_sp.py`
from a DeepSpeed work tree as a single module; the imports it makes at load time and the adapter
does not use are stand-ins in sys.modules (listed in STUBBED below and in the fixtures' README).
`deepspeed.comm` is mapped to `torch.distributed` (the adapter calls all_gather and
all_gather_object on the default group). The adapter itself runs unmodified.

    git --git-dir=<DeepSpeed mirror> show HEAD:deepspeed/runtime/sequence_parallel/ulysses_sp.py \
        > /tmp/ulysses_sp.py
    /usr/bin/python3 tests/jobs/gen_deepspeed_adapter_fixtures.py \
        --ulysses-sp /tmp/ulysses_sp.py --out tests/equivalence/data/deepspeed

Each case writes <name>.json: {"ulysses", "input": {"rows": [...]}, "outcome": "ok" | "error",
"micro_steps": [{"source_rank", "ranks": [{"cp_rank", key: values, ...}]}] (ok),
"error": {"rank", "type", "message"} (error: the first rank that raised, the others' fate)}.
"""

import argparse
import datetime
import importlib.util
import json
import logging
import os
import random
import sys
import tempfile
import traceback
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

IGNORE = -100
SEED = 20261123

# What the adapter module imports at load time but the adapter does not use.
STUBBED = {
    "deepspeed.runtime.utils.see_memory_usage": "no-op (memory report)",
    "deepspeed.sequence.layer._DimZeroAllToAll": "placeholder class (attention only)",
    "deepspeed.utils.logging.logger": "logging.getLogger('deepspeed')",
    "deepspeed.comm": "torch.distributed (all_gather, all_gather_object, get_rank, get_world_size); "
                      "all_gather views a 0-d input as [1], as NCCL does (the adapter gathers its "
                      "0-d seqlen into [1]-shaped outputs; gloo refuses that: 'ProcessGroupGloo::"
                      "allgather: invalid tensor size at index 0 (expected (), got (1))'); outputs "
                      "of different sizes (samples of different lengths) are filled by one "
                      "broadcast per rank, as ProcessGroupNCCL::allgather does for uneven sizes "
                      "(gloo refuses: 'invalid tensor size at index 1')",
    "einops.rearrange": "placeholder (attention only; einops is not in Debian's python3 set here)",
    "packaging.version": "placeholder (UlyssesSPAttentionHF's transformers version check only)",
}


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__path__ = []
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def nccl_like_all_gather(tensor_list, tensor, group=None, async_op=False):
    """all_gather as NCCL does it, over gloo: NCCL checks only element counts (a 0-d input into
    [1]-shaped outputs), gloo also checks shapes; outputs of different sizes are filled by one
    broadcast per rank, as ProcessGroupNCCL::allgather does. DeepSpeed targets NCCL."""
    if tensor.dim() == 0 and tensor_list and tensor_list[0].dim() == 1:
        tensor = tensor.reshape(1)
    if all(t.shape == tensor.shape for t in tensor_list):
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    me = dist.get_rank(group)
    for src, out in enumerate(tensor_list):
        if src == me:
            out.copy_(tensor)
        dist.broadcast(out, src=src, group=group)


def load_adapter_package():
    """The adapter of the installed deepspeed package, imported as users import it, over the
    gloo world (deepspeed.comm initialised on it; its all_gather given NCCL's semantics)."""
    import deepspeed
    import deepspeed.comm
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    deepspeed.comm.all_gather = nccl_like_all_gather
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    return UlyssesSPDataLoaderAdapter


def load_adapter(path):
    class _Unused:
        def __init__(self, *a, **k):
            raise RuntimeError("stand-in: not used by UlyssesSPDataLoaderAdapter")

    _module("deepspeed")
    _module("deepspeed.runtime")
    _module("deepspeed.runtime.utils", see_memory_usage=lambda *a, **k: None)
    _module("deepspeed.sequence")
    _module("deepspeed.sequence.layer", _DimZeroAllToAll=_Unused)
    _module("deepspeed.utils")
    _module("deepspeed.utils.logging", logger=logging.getLogger("deepspeed"))
    comm = _module("deepspeed.comm", all_gather=nccl_like_all_gather, all_gather_object=dist.all_gather_object,
                   get_rank=dist.get_rank, get_world_size=dist.get_world_size,
                   ProcessGroup=dist.ProcessGroup)
    sys.modules["deepspeed"].comm = comm
    _module("einops", rearrange=_Unused)
    if importlib.util.find_spec("packaging") is None:
        _module("packaging")
        _module("packaging.version", parse=_Unused)
        sys.modules["packaging"].version = sys.modules["packaging.version"]
    spec = importlib.util.spec_from_file_location("ulysses_sp", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m.UlyssesSPDataLoaderAdapter


# --------------------------------------------------------------------------------------------------
# Cases: the sample each SP rank's dataloader yields
# --------------------------------------------------------------------------------------------------

def packed_row(rng, docs, vocab=50, extra=()):
    ids, labels, pos = [], [], []
    for d in docs:
        for i in range(d):
            t = rng.randrange(1, vocab)
            ids.append(t)
            # HF-style packed labels: the input ids, -100 on the first token of every document
            # after the first (DataCollatorWithFlattening) and on random prompt runs.
            labels.append(IGNORE if (i == 0 and pos) else t)
            pos.append(i)
    for i in range(len(labels)):
        if rng.random() < 0.12:
            labels[i] = IGNORE
    row = {"input_ids": ids, "labels": labels, "position_ids": pos}
    for key in extra:
        if key == "attention_mask":
            row[key] = [1] * len(ids)
        elif key == "token_type_ids":
            row[key] = [rng.randrange(0, 2) for _ in ids]
        elif key == "loss_mask":
            row[key] = [int(l != IGNORE) for l in labels]
        elif key == "source":
            row[key] = "doc-%d" % rng.randrange(1000)
    return row


def docs_summing_to(rng, total, max_docs=4):
    cuts = sorted(rng.sample(range(1, total), min(max_docs - 1, total - 1))) if total > 1 else []
    edges = [0] + cuts + [total]
    return [b - a for a, b in zip(edges, edges[1:]) if b > a]


def cases():
    rng = random.Random(SEED)
    out = []
    for U in (1, 2, 3, 4):
        for variant in range(3):
            rows = []
            for r in range(U):
                L = U * rng.randrange(2, 9)  # per-rank lengths differ, each divisible by U
                extra = [("attention_mask",), ("token_type_ids", "loss_mask"), ("source",)][variant]
                rows.append(packed_row(rng, docs_summing_to(rng, L), extra=extra))
            out.append(("ok_u%d_v%d" % (U, variant), U, rows))
    # The same row on every rank (a dataloader without a distributed sampler).
    same = packed_row(rng, [5, 3, 4])
    out.append(("ok_same_row_u4", 4, [same] * 4))
    # Errors, in the order the adapter checks them.
    bad = [packed_row(rng, [4, 2]) for _ in range(2)]
    bad[1] = packed_row(rng, [4, 3])  # 7 tokens, U = 2
    out.append(("error_seqlen_not_divisible_u2", 2, bad))
    rows = [packed_row(rng, [6, 6]) for _ in range(3)]
    rows[2] = packed_row(rng, [5, 5])  # 10 tokens, U = 3
    out.append(("error_seqlen_not_divisible_u3", 3, rows))
    rows = [packed_row(rng, [4, 4]) for _ in range(2)]
    for r in rows:
        del r["position_ids"]
    out.append(("error_no_position_ids_u2", 2, rows))
    rows = [packed_row(rng, [4, 4], extra=("attention_mask",)) for _ in range(2)]
    rows[0]["attention_mask"] = rows[0]["attention_mask"][:-1]
    out.append(("error_mask_length_u2", 2, rows))
    rows = [packed_row(rng, [4, 4]) for _ in range(2)]
    for r in rows:
        del r["labels"]
    out.append(("error_no_labels_u2", 2, rows))
    return out


# --------------------------------------------------------------------------------------------------
# Running the adapter
# --------------------------------------------------------------------------------------------------

def as_batch(row):
    return {k: (torch.tensor([v], dtype=torch.int64) if isinstance(v, list) else v)
            for k, v in row.items()}


def plain(batch):
    return {k: (v[0].tolist() if torch.is_tensor(v) else v) for k, v in batch.items()}


def worker(rank, world, init_file, ulysses_sp, rows, result_dir):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=5))
    Adapter = load_adapter_package() if ulysses_sp == "package" else load_adapter(ulysses_sp)
    dl = torch.utils.data.DataLoader([as_batch(rows[rank])], batch_size=None)
    result = {"rank": rank}
    try:
        adapter = Adapter(dl, sp_rank=rank, sp_group=None, sp_world_size=world, device="cpu")
        result["micro_steps"] = [plain(next(adapter)) for _ in range(world)]
    except Exception as e:  # what the user sees on this rank
        result["error"] = {"type": type(e).__name__, "message": str(e).splitlines()[0]}
    with open(os.path.join(result_dir, "rank%d.json" % rank), "w") as f:
        json.dump(result, f)
    os._exit(0)  # a rank that raised may leave peers blocked in a collective


def run_case(name, U, rows, ulysses_sp, out_dir):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=worker, args=(r, U, init_file, ulysses_sp, rows, tmp))
                 for r in range(U)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        results = []
        for r in range(U):
            path = os.path.join(tmp, "rank%d.json" % r)
            results.append(json.load(open(path)) if os.path.exists(path) else {"rank": r})
    fixture = {"ulysses": U, "input": {"rows": rows}}
    raised = [x for x in results if "error" in x and "timed out" not in x["error"]["message"].lower()
              and "connection" not in x["error"]["message"].lower()]
    if raised:
        fixture["outcome"] = "error"
        fixture["error"] = dict(rank=raised[0]["rank"], **raised[0]["error"])
    elif all("micro_steps" in x for x in results):
        fixture["outcome"] = "ok"
        fixture["micro_steps"] = [
            {"source_rank": i,
             "ranks": [dict(cp_rank=r, **results[r]["micro_steps"][i]) for r in range(U)]}
            for i in range(U)]
    else:
        raise SystemExit("%s: no rank finished and none raised: %s" % (name, results))
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
        f.write("\n")
    return fixture["outcome"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ulysses-sp", required=True,
                    help="DeepSpeed's ulysses_sp.py, or 'package': the installed deepspeed")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    for name, U, rows in cases():
        print("%-34s U=%d  %s" % (name, U, run_case(name, U, rows, args.ulysses_sp, args.out)),
              flush=True)
    print("stubbed:", json.dumps(STUBBED, indent=1))


if __name__ == "__main__":
    main()

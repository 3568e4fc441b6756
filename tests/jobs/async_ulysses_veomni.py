#!/usr/bin/env python3
r"""Runs VeOmni's own async Ulysses QKV projection (AsyncUlyssesQKVProjection, forward and its
hand-written backward) on 2 gloo processes, on inputs written by seqpar, for
`torch_crosscheck async-compare` (tests/equivalence/torch_crosscheck.cpp).

VeOmni's veomni/distributed/sequence_parallel/async_ulysses.py imports the rest of VeOmni; this
script reads it and its two helpers (ulysses.py: all_to_all_tensor and the two all-to-all
functions it calls; utils.py: the SP padding helpers) with `ast`, takes only those definitions
and runs them with torch, with the Ulysses group getters answered by the test's gloo group.
Nothing of VeOmni is copied into seqpar: give the path of a VeOmni checkout. Gloo has no list
all_to_all (VeOmni's `_all_to_all`, used for a 3-D tensor's head dim): the script gives the
functions a `dist` whose all_to_all is all_to_all_single over the concatenated blocks, with the
same asynchronous Work semantics. float64 throughout; norm_type None (VeOmni's q/k norm needs
apex or torch_npu kernels).

    build/tests/equivalence/torch_crosscheck async-dump /tmp/async-in.json
    /usr/bin/python3 tests/jobs/async_ulysses_veomni.py --veomni PATH/TO/VeOmni \
        /tmp/async-in.json tests/equivalence/data/torch/async-ulysses-veomni.json
    build/tests/equivalence/torch_crosscheck async-compare tests/equivalence/data/torch/async-ulysses-veomni.json
"""
import argparse
import ast
import base64
import hashlib
import importlib
import json
import numbers
import os
import sys
import types
from typing import Any, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

f64 = torch.float64
U = 2
FILES = {
    "veomni/distributed/sequence_parallel/utils.py":
        ["pad_tensor", "unpad_tensor", "unpadding_tensor_for_seqeunce_parallel",
         "padding_tensor_for_seqeunce_parallel"],
    "veomni/distributed/sequence_parallel/ulysses.py":
        ["_all_to_all", "_all_to_all_single", "all_to_all_tensor"],
    "veomni/distributed/sequence_parallel/async_ulysses.py":
        ["AsyncUlyssesQKVProjection", "async_ulysses_qkv_projection"],
}


class _Work:
    """dist.all_to_all's Work, over all_to_all_single (equal blocks)."""

    def __init__(self, work, flat, outputs):
        self.work, self.flat, self.outputs = work, flat, outputs

    def wait(self):
        self.work.wait()
        for out, part in zip(self.outputs, self.flat.split([t.numel() for t in self.outputs])):
            out.copy_(part.reshape(out.shape))
        return True


def _all_to_all_lists(output_list, input_list, group=None, async_op=False):
    flat_in = torch.cat([t.reshape(-1) for t in input_list])
    flat_out = torch.empty(sum(t.numel() for t in output_list), dtype=flat_in.dtype)
    work = dist.all_to_all_single(flat_out, flat_in,
                                  output_split_sizes=[t.numel() for t in output_list],
                                  input_split_sizes=[t.numel() for t in input_list],
                                  group=group, async_op=True)
    w = _Work(work, flat_out, output_list)
    if async_op:
        return w
    w.wait()
    return None


def import_veomni(group):
    """The installed veomni package, imported as users import it: the Ulysses group set through
    its own seam (set_ulysses_sequence_parallel_group), and gloo's missing list all_to_all
    emulated over all_to_all_single (_all_to_all_lists). Returns (namespace, sha256 of the
    module files)."""
    import importlib
    mod = importlib.import_module("veomni.distributed.sequence_parallel.async_ulysses")
    comm = importlib.import_module("veomni.distributed.sequence_parallel.comm")
    comm.set_ulysses_sequence_parallel_group(group)
    dist.all_to_all = _all_to_all_lists
    digest = hashlib.sha256()
    for name in ("async_ulysses", "ulysses", "backward", "utils", "comm"):
        m = importlib.import_module("veomni.distributed.sequence_parallel." + name)
        with open(m.__file__, "rb") as f:
            digest.update(f.read())
    return {"async_ulysses_qkv_projection": mod.async_ulysses_qkv_projection}, digest.hexdigest()


def load_veomni(root, group, files=None, world_size=None):
    """Executes the wanted definitions of each file ({path in the checkout: [names]}, default
    FILES) in one namespace, with the Ulysses group getters answering `group` and `world_size`
    (default U); returns the namespace and the sha256 of the files read."""
    files = FILES if files is None else files
    world_size = U if world_size is None else world_size
    dist_shim = types.SimpleNamespace(**{k: getattr(dist, k) for k in dir(dist) if not k.startswith("__")})
    dist_shim.all_to_all = _all_to_all_lists
    ns = {"torch": torch, "dist": dist_shim, "F": F, "Tensor": Tensor, "ProcessGroup": ProcessGroup,
          "Any": Any, "Optional": Optional, "Tuple": Tuple, "Union": Union, "numbers": numbers,
          "importlib": importlib, "IS_CUDA_AVAILABLE": False, "IS_NPU_AVAILABLE": False,
          "get_device_id": lambda: "cpu",
          "get_ulysses_sequence_parallel_group": lambda: group,
          "get_ulysses_sequence_parallel_world_size": lambda group=None: world_size}
    digest = hashlib.sha256()
    for rel, wanted in files.items():
        path = os.path.join(root, rel)
        with open(path, encoding="utf-8") as f:
            source = f.read()
        digest.update(source.encode())
        tree = ast.parse(source)
        found = [n for n in tree.body
                 if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted]
        missing = sorted(set(wanted) - {n.name for n in found})
        if missing:
            sys.exit(f"{path}: no definition of {', '.join(missing)}")
        exec(compile(ast.Module(body=found, type_ignores=[]), path, "exec"), ns)
    return ns, digest.hexdigest()


def decode(t):
    raw = base64.b64decode(t["f64le"])
    return torch.frombuffer(bytearray(raw), dtype=f64).clone().reshape(t["shape"])


def encode(name, x):
    x = x.detach().to(f64).contiguous()
    if x.dim() == 1:
        x = x.reshape(1, -1)
    data = x.numpy().astype("<f8").tobytes()
    return {"name": name, "shape": list(x.shape), "f64le": base64.b64encode(data).decode("ascii")}


def rank_main(rank, root, case, port, results):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=U)
    torch.set_num_threads(1)
    # A checkout is read definition by definition (load_veomni); the installed package is
    # imported (its modules changed shape across versions: 0.1.12's backward helpers live in
    # backward.py and op_wrappers.py).
    if root == "package":
        ns, digest = import_veomni(dist.group.WORLD)
    else:
        ns, digest = load_veomni(root, dist.group.WORLD)
    out = []
    for sub in case["cases"]:
        t = {x["name"]: decode(x) for x in sub["tensors"]}
        S, D = sub["tokens"], sub["head_dim"]
        local = (S + U - 1) // U
        # VeOmni's layout: [batch 1, local tokens, hidden]; seq_dimension 1, head_dimension 2.
        h = t["h"][rank * local:(rank + 1) * local].unsqueeze(0).clone().requires_grad_(True)
        params = {k: t[k].clone().reshape(-1 if k.startswith("b") else t[k].shape).requires_grad_(True)
                  for k in ("wq", "bq", "wk", "bk", "wv", "bv")}
        q, k, v = ns["async_ulysses_qkv_projection"](
            hidden_states=h, seq_dimension=1, head_dimension=2,
            q_weight=params["wq"], q_bias=params["bq"], k_weight=params["wk"], k_bias=params["bk"],
            v_weight=params["wv"], v_bias=params["bv"], norm_type=None, unpadded_dim_size=S,
            head_dim=D, group=dist.group.WORLD)
        gq, gk, gv = (t[f"{n}.r{rank}"].reshape(1, S, -1, D) for n in ("gq", "gk", "gv"))
        torch.autograd.backward([q, k, v], [gq, gk, gv])
        p = f"{sub['name']}.r{rank}."
        out += [encode(p + "q", q.reshape(S, -1)), encode(p + "k", k.reshape(S, -1)),
                encode(p + "v", v.reshape(S, -1)), encode(p + "grad_h", h.grad.reshape(local, -1))]
        out += [encode(p + "grad_" + n, x.grad) for n, x in params.items()]
    results[rank] = (out, digest)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--veomni", required=True,
                    help="a VeOmni checkout (its root directory), or 'package': the installed "
                         "veomni package")
    ap.add_argument("input", help="the JSON of torch_crosscheck async-dump")
    ap.add_argument("output")
    args = ap.parse_args()
    with open(args.input) as f:
        case = json.load(f)
    manager = mp.Manager()
    results = manager.dict()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sp_jobs import _free_port  # noqa: E402 (beside this script)
    mp.spawn(rank_main, args=(args.veomni, case, _free_port(), results), nprocs=U)
    outputs = results[0][0] + results[1][0]
    producer = (f"VeOmni async_ulysses.py + helpers sha256 {results[0][1][:16]}, torch "
                f"{torch.__version__}, gloo {U} processes")
    with open(args.output, "w") as f:
        json.dump({"producer": producer, "inputs": case, "outputs": outputs}, f)
        f.write("\n")
    print(f"{args.output}: {len(outputs)} tensors from {U} ranks ({producer})")


if __name__ == "__main__":
    main()

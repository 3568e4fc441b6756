"""One rank of the pool: runs the user's attention on its shard, forward and backward, dumps it
through the hook, and says how it went. Runs in a worker process (never in the test's own)."""
import datetime
import faulthandler
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
# Imported here, in the process that forks the ranks, so that every rank inherits it: autograd
# imports it (and sympy with it) on a process's first backward, which cost each forked rank
# ~0.4 s of CPU, half of a property's CPU time at 40 examples.
import torch.fx.experimental.symbolic_shapes  # noqa: F401

from .. import dump as sp_dump
from .context import AttentionContext, global_inputs, global_sinks
from .impl_ref import resolve
from .scenario import Layout, Scenario

_HERE = os.path.dirname(os.path.abspath(__file__))


def _user_traceback(exc):
    """The traceback without the harness's own frames (they say nothing about the user's code)."""
    tb = traceback.extract_tb(exc.__traceback__)
    keep = [f for f in tb if not os.path.abspath(f.filename).startswith(_HERE)]
    lines = traceback.format_list(keep or tb)
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines).rstrip()


def _describe_output(out):
    if isinstance(out, torch.Tensor):
        return "a %s tensor of shape %s on %s" % (str(out.dtype).replace("torch.", ""),
                                                   list(out.shape), out.device)
    return "%s" % type(out).__name__


def _output_problem(out, q, want_shape):
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return ("returned a %s of %d items; the contract is attention(q, k, v, ctx) -> out, one "
                "tensor [s_local, H, D] (tap lse with ctx.tap('lse', lse) instead)" %
                (type(out).__name__, len(out)))
    if not isinstance(out, torch.Tensor):
        return "returned %s, not a tensor [s_local, H, D]" % _describe_output(out)
    if list(out.shape) != list(want_shape):
        return ("returned %s; the rank's output must have q's shape %s [s_local, H, D]" %
                (_describe_output(out), list(want_shape)))
    if out.dtype != q.dtype:
        return ("returned %s; the output must have q's dtype %s" %
                (_describe_output(out), str(q.dtype).replace("torch.", "")))
    if out.device != q.device:
        return "returned %s; the output must be on q's device %s" % (_describe_output(out),
                                                                      q.device)
    if not out.requires_grad:
        return ("returned an output that does not require grad: it is cut from q, k and v "
                "(detach(), torch.no_grad() or a non-differentiable op), so no gradient reaches "
                "them")
    return None


class _Rank(object):
    def __init__(self, rank, world, fn):
        self.rank = rank
        self.world = world
        self.fn = fn
        self.groups = {}

    def groups_for(self, U, R):
        """(ulysses, ring, cp) groups of this rank; every rank creates every group of the layout
        in the same order (torch.distributed.new_group is collective over the world)."""
        key = (U, R)
        if key not in self.groups:
            ug = [dist.new_group([r * U + u for u in range(U)]) for r in range(R)]
            rg = [dist.new_group([u + U * j for j in range(R)]) for u in range(U)]
            self.groups[key] = (ug, rg)
        ug, rg = self.groups[key]
        return ug[self.rank // U], rg[self.rank % U], dist.group.WORLD

    def run(self, task):
        if task.get("kind") == "step":  # a whole training step (step.py)
            from .step import run_on_rank
            return run_on_rank(self, task, self.fn)
        scn = Scenario.from_json(task["scenario"])
        lay = Layout(**task["layout"])
        t0 = time.perf_counter()
        groups = self.groups_for(scn.ulysses, scn.ring)
        Q, K, V, W = global_inputs(scn, lay.padded_length)
        idx = torch.tensor(lay.rank_tokens[self.rank], dtype=torch.long)
        q = Q[idx].clone().requires_grad_(True)
        k = K[idx].clone().requires_grad_(True)
        v = V[idx].clone().requires_grad_(True)
        w = W[idx].clone()
        originals = {n: (t.detach().clone(), t._version) for n, t in (("q", q), ("k", k),
                                                                        ("v", v))}
        ctx = AttentionContext(scn, lay, self.rank, groups, None)
        ctx_dumper = sp_dump.Dumper(
            task["dir"], ulysses=scn.ulysses, ring=scn.ring, ulysses_rank=ctx.ulysses_rank,
            ring_rank=ctx.ring_rank, heads=scn.heads, kv_heads=scn.kv_heads,
            head_dim=scn.head_dim, scale=ctx.scale, causal=scn.causal,
            cu_seqlens=ctx.cu_seqlens, position_ids=ctx.position_ids,
            ring_layout=scn.layout if scn.ring > 1 else "contiguous", rank=self.rank,
            world_size=self.world, dtype=q.dtype, job=task.get("job", ""), durable=False,
            window_back=scn.window_back, window_ahead=scn.window_ahead, chunk=scn.chunk,
            softcap=scn.softcap)
        ctx._dumper = ctx_dumper
        if scn.sinks:  # every rank's own leaf: its gradient is this rank's share
            ctx.sinks = global_sinks(scn).requires_grad_(True)
        phase = "forward"
        try:
            with ctx_dumper.call(name="attention"):
                ctx_dumper.tap("q.local", q)
                ctx_dumper.tap("k.local", k)
                ctx_dumper.tap("v.local", v)
                if ctx.sinks is not None:
                    ctx_dumper.tap("sinks", ctx.sinks)  # and grad.sinks, by its hook
                out = self.fn(q, k, v, ctx)
                problem = _output_problem(out, q, q.shape)
                if problem:
                    return {"status": "bad_output", "message": problem}
                ctx_dumper.tap("out.local", out)
            if task.get("backward", True):  # Supports(backward=False): forward only
                phase = "backward"
                out.backward(w)
        except Exception as e:  # the user's code raised: report it, keep the worker alive
            return {"status": "raised", "phase": phase, "error": _user_traceback(e),
                    "exception": type(e).__name__}
        finally:
            ctx_dumper.close()
        for n, (orig, version) in originals.items():
            t = {"q": q, "k": k, "v": v}[n]
            changed = int((t.detach() != orig).sum().item()) if t.shape == orig.shape else -1
            if changed or t._version != version:
                return {"status": "mutated_input", "message": (
                    "wrote into its input %s (%s; version counter %d -> %d): the caller's %s is "
                    "the projection's output, which autograd and the model use again; write "
                    "into a copy" % (n, "%d of %d elements changed" % (changed, orig.numel())
                                     if changed else "values unchanged", version, t._version, n))}
        missing = [n for n, t in (("q", q), ("k", k), ("v", v))
                   if t.grad is None and task.get("backward", True)]
        if missing:
            return {"status": "no_grad", "message": (
                "no gradient reached %s: the output does not depend on %s, or the graph was cut "
                "(detach(), torch.no_grad(), .data)" % ("/".join(missing), "/".join(missing)))}
        return {"status": "ok", "seconds": time.perf_counter() - t0}


def main(rank, world, port, conn, impl, stack_path):
    """The worker process: joins the gloo world once, then runs examples until told to stop."""
    torch.set_num_threads(1)
    stack_file = open(stack_path, "a")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        fn = resolve(impl) if isinstance(impl, str) else impl
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
    except BaseException as e:
        conn.send({"status": "init_failed", "error": _user_traceback(e)})
        return
    r = _Rank(rank, world, fn)
    conn.send({"status": "ready", "pid": os.getpid()})
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        try:
            res = r.run(task)
        except BaseException as e:  # a harness failure: report it rather than hang the parent
            res = {"status": "harness_error", "error": traceback.format_exc()}
            if not isinstance(e, Exception):
                conn.send(res)
                raise
        res["rank"] = rank
        conn.send(res)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    sys.exit(0)

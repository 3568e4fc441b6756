"""seqpar recorder: writes the seqpar-trace/1 trace (traces/README.md) of a PyTorch SP training
script, for ``seqpar replay``. Standard library + torch (1.13 and 2.x).

    import seqpar.recorder as spr
    with spr.recording("run.jsonl", config={...scenario...}):  # after init_process_group
        train_step()
    # or: rec = spr.Recorder("run.jsonl"); ...; rec.close()
    # or, without touching the step: SEQPAR_TRACE=run.jsonl and spr.recording() with no path

    python3 -m seqpar.recorder merge run.jsonl run.jsonl.rank*   # one trace for replay

Crash-safe: every rank streams to run.jsonl.rank<r>, one line per call written and flushed
*before* the call runs (state "started", start time), and a second line when it returns
("completed", end time) or raises ("failed" — the record stays "started", with the error).
A rank that gloo or NCCL aborts (SIGABRT) or that is killed loses at most the line of the call
it was inside; `merge` joins the lines, so that call replays as "started" on that rank.
With a single rank, close() writes run.jsonl itself.

While a Recorder is installed, torch.distributed's all_to_all_single, all_to_all (lists),
all_gather_into_tensor, _all_gather_base, all_gather (lists), reduce_scatter_tensor,
_reduce_scatter_base, reduce_scatter (lists), all_reduce, broadcast, barrier, send, recv, isend,
irecv and batch_isend_irecv record their call (group, per-(rank, group) seq, op, dtype, shapes,
splits in elements, peer, tag) and then run unchanged. Asynchronous calls (async_op=True,
isend/irecv) complete when their work's wait() returns.
"""
import contextlib
import json
import os
import sys
import tempfile
import time

SCHEMA = "seqpar-trace/1"


def _open_stream(path, rank):
    """This rank's stream, opened for writing and locked (fcntl.flock) for as long as the job
    runs: a second job recording to the same path is refused with the reason instead of
    interleaving with the first; a file left by a job that ended is simply replaced."""
    import fcntl
    try:
        f = open(path, "a")
    except OSError as e:
        raise OSError(e.errno, f"seqpar.recorder: rank {rank}: cannot create {path}: "
                      f"{e.strerror} (is the directory there and writable?)") from e
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        raise OSError(e.errno, f"seqpar.recorder: rank {rank}: {path} is being written by another "
                      f"running job (it holds the file's lock); record each job to a path of "
                      f"its own") from e
    f.seek(0)
    f.truncate()
    return f


def _reopen_truncated(f, path):
    """After a failed write: the stream cut back to its last complete line, kept open (and
    locked) so nothing else is written."""
    try:
        f.close()
    except OSError:
        pass
    with open(path, "rb") as r:
        data = r.read()
    end = data.rfind(b"\n") + 1
    g = open(path, "r+")
    g.truncate(end)
    return g


def write_atomic(path, text):
    """Writes text to path through a temp file in the same directory and a rename: a reader
    never sees a partial file, and a failure leaves none behind."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".seqpar-tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide the trace from its readers
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class Recorder:
    _WRAPPED = ("all_to_all_single", "all_to_all", "all_gather_into_tensor", "_all_gather_base",
                "all_gather", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter",
                "all_reduce", "broadcast", "barrier", "send", "recv", "isend", "irecv",
                "batch_isend_irecv")

    def __init__(self, path, config=None, install=True):
        import torch.distributed as dist
        self._dist = dist
        self.path = path
        self.config = config
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._names = {}      # id(pg) -> name
        self._groups = {}     # name -> global ranks
        self._seq = {}        # group name -> next seq
        self._tags = []
        self._orig = {}
        self._in_batch = False
        self.stream_path = f"{path}.rank{self.rank}"
        self._out = _open_stream(self.stream_path, self.rank)
        self.write_error = None  # the OSError that stopped this rank's recording, if any
        self._emit({"type": "meta", "schema": SCHEMA, "world_size": self.world_size,
                    "groups": {}, "source": "recorder",
                    **({"config": config} if config is not None else {})})
        if install:
            self.install()

    # ---- groups and tags ---------------------------------------------------------------
    def _group_ranks(self, pg):
        d = self._dist
        if pg is None or pg is d.group.WORLD:
            return list(range(self.world_size))
        if hasattr(d, "get_process_group_ranks"):
            return list(d.get_process_group_ranks(pg))
        from torch.distributed import distributed_c10d as c10d
        m = c10d._pg_group_ranks[pg]  # global rank -> group rank
        return [g for g, _ in sorted(m.items(), key=lambda kv: kv[1])]

    def name_group(self, pg, name):
        """Give a process group the trace name replay uses ("ulysses0", "ring1", "sp0")."""
        self._names[id(pg)] = name
        self._groups[name] = self._group_ranks(pg)
        self._emit({"type": "group", "name": name, "ranks": self._groups[name]})

    def _group_name(self, pg):
        d = self._dist
        key = id(pg if pg is not None else d.group.WORLD)
        if key not in self._names:
            if pg is None or pg is d.group.WORLD:
                name = "world"
            else:
                desc = getattr(pg, "group_desc", None)
                name = desc if desc and desc != "undefined" else f"pg{len(self._names)}"
            self._names[key] = name
            self._groups[name] = self._group_ranks(pg)
            self._emit({"type": "group", "name": name, "ranks": self._groups[name]})
        return self._names[key]

    @contextlib.contextmanager
    def tag(self, name):
        """Tag every call made inside (e.g. "L0.attn.q.fwd")."""
        self._tags.append(name)
        try:
            yield
        finally:
            self._tags.pop()

    # ---- records -----------------------------------------------------------------------
    @staticmethod
    def _dtype(t):
        return str(t.dtype).replace("torch.", "")

    def _base(self, kind, pg, op, dtype):
        g = self._group_name(pg)
        seq = self._seq.get(g, 0)
        self._seq[g] = seq + 1
        rec = {"type": kind, "rank": self.rank, "group": g, "seq": seq, "op": op}
        if dtype is not None:
            rec["dtype"] = dtype
        rec["tag"] = self._tags[-1] if self._tags else ""
        return rec

    def _emit(self, rec):
        """One line, flushed at once: what is written survives the process being killed. A
        write that fails (a full disk, a file size limit, the directory gone) never breaks the
        training step: the rank's recording stops there, said once on stderr, and its stream
        ends at its last whole line (merge says which ranks' streams stopped early)."""
        if self.write_error is not None:
            return
        line = json.dumps(rec, separators=(",", ":")) + "\n"
        try:
            self._out.write(line)
            self._out.flush()
        except OSError as e:
            self.write_error = e
            print(f"seqpar.recorder: rank {self.rank}: cannot write {self.stream_path}: "
                  f"{e.strerror or e} — recording stopped here; the training goes on, and this "
                  f"rank's trace ends at its last complete line", file=sys.stderr, flush=True)
            try:  # the line may be half written: cut it off
                self._out = _reopen_truncated(self._out, self.stream_path)
            except OSError:
                pass

    def _started(self, rec):
        rec["state"] = "started"
        rec["t_start"] = time.time()
        self._emit(rec)
        return rec

    def _finish(self, rec, state, error=None):
        done = {"type": "done", "rank": rec["rank"], "group": rec["group"], "seq": rec["seq"],
                "p2p": rec["type"] == "p2p", "state": state, "t_end": time.time()}
        if error is not None:
            done["error"] = error[:300]
        self._emit(done)

    def _run(self, recs, fn, *args, **kwargs):
        """Runs the real call after its records were written; marks them completed when it
        returns (or, for async work, when its wait() returns) and failed when it raises."""
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:
            for r in recs:
                self._finish(r, "failed", f"{type(e).__name__}: {e}")
            raise
        if result is None or not (kwargs.get("async_op") or fn.__name__ in ("isend", "irecv")
                                  or isinstance(result, list)):
            for r in recs:
                self._finish(r, "completed")
            return result
        if isinstance(result, list):  # batch_isend_irecv: one work per op
            return [_Work(w, self, [r]) for w, r in zip(result, recs)]
        return _Work(result, self, recs)

    def _collective(self, op, pg, inp, out, in_splits=None, out_splits=None):
        rec = self._base("collective", pg, op, self._dtype(inp) if inp is not None else None)
        if inp is not None:
            rec["in_shape"] = list(inp.shape)
        if out is not None:
            rec["out_shape"] = list(out.shape)
        # torch splits count rows of dim 0; the trace counts elements.
        if in_splits is not None and inp is not None:
            row = inp[0].numel() if inp.dim() > 0 and inp.shape[0] > 0 else 1
            rec["in_splits"] = [int(s) * row for s in in_splits]
        if out_splits is not None and out is not None:
            row = out[0].numel() if out.dim() > 0 and out.shape[0] > 0 else 1
            rec["out_splits"] = [int(s) * row for s in out_splits]
        return self._started(rec)

    def _p2p(self, op, tensor, peer, pg):
        rec = self._base("p2p", pg, op, self._dtype(tensor))
        rec["peer"] = int(peer)
        rec["shape"] = list(tensor.shape)
        return self._started(rec)

    @staticmethod
    def _cat_shape(tensors):
        """The shape of a list of tensors as one: [sum of dim 0, rest of the first]."""
        if not tensors:
            return [0]
        return [sum(int(t.shape[0]) if t.dim() else 1 for t in tensors)] + list(tensors[0].shape[1:])

    def _list_collective(self, op, pg, inputs, outputs):
        """The list forms: shapes of the concatenations, splits from each tensor's size."""
        ref = inputs[0] if inputs else (outputs[0] if outputs else None)
        rec = self._base("collective", pg, op, self._dtype(ref) if ref is not None else None)
        rec["in_shape"] = self._cat_shape(inputs)
        rec["out_shape"] = self._cat_shape(outputs)
        if op == "all_to_all":
            rec["in_splits"] = [int(t.numel()) for t in inputs]
            rec["out_splits"] = [int(t.numel()) for t in outputs]
        return self._started(rec)

    def record_layout(self, rank, batch, tag="collate"):
        """The collator output of one rank: a dict with input_ids, cu_seqlens (or
        cu_seq_lens_q), position_ids and optionally max_seqlen (tensors or lists)."""
        def flat(v):
            if v is None:
                return None
            if hasattr(v, "reshape"):
                v = v.reshape(-1).tolist()
            return [int(x) for x in v]
        cu = flat(batch.get("cu_seqlens", batch.get("cu_seq_lens_q")))
        ids = flat(batch.get("input_ids"))
        rec = {"type": "layout", "rank": int(rank), "tag": tag,
               "local_tokens": len(ids) if ids is not None else 0, "cu_seqlens": cu or []}
        ms = batch.get("max_seqlen", batch.get("max_length_q"))
        if ms is not None:
            rec["max_seqlen"] = int(ms)
        pos = flat(batch.get("position_ids"))
        if pos is not None:
            rec["position_ids"] = pos
        self._emit(rec)

    # ---- torch.distributed wrappers ----------------------------------------------------
    def install(self):
        d = self._dist
        # One bound method per name, kept: torch compares ops by identity (P2POp checks its op
        # against distributed_c10d's isend/irecv, and torch >= 2.4's batch_isend_irecv asks
        # `op.op is isend` to pick group_dst or group_src), and each attribute access of a
        # bound method makes a new object.
        self._wrappers = {n: getattr(self, "_w_" + n) for n in self._WRAPPED}
        for name in self._WRAPPED:
            if hasattr(d, name) and name not in self._orig:
                self._orig[name] = getattr(d, name)
                setattr(d, name, self._wrappers[name])
        from torch.distributed import distributed_c10d as c10d
        self._c10d_orig = {n: getattr(c10d, n) for n in ("isend", "irecv") if hasattr(c10d, n)}
        for n in self._c10d_orig:
            setattr(c10d, n, self._wrappers[n])

    def uninstall(self):
        for name, fn in self._orig.items():
            setattr(self._dist, name, fn)
        self._orig.clear()
        from torch.distributed import distributed_c10d as c10d
        for n, fn in getattr(self, "_c10d_orig", {}).items():
            setattr(c10d, n, fn)
        self._c10d_orig = {}

    def _w_all_to_all_single(self, output, input, output_split_sizes=None,
                             input_split_sizes=None, group=None, async_op=False):
        rec = self._collective("all_to_all", group, input, output, input_split_sizes,
                               output_split_sizes)
        return self._run([rec], self._orig["all_to_all_single"], output, input,
                         output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    def _w_all_to_all(self, output_tensor_list, input_tensor_list, group=None, async_op=False):
        rec = self._list_collective("all_to_all", group, input_tensor_list, output_tensor_list)
        return self._run([rec], self._orig["all_to_all"], output_tensor_list, input_tensor_list,
                         group=group, async_op=async_op)

    def _w_all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        rec = self._collective("all_gather", group, input_tensor, output_tensor)
        return self._run([rec], self._orig["all_gather_into_tensor"], output_tensor, input_tensor,
                         group=group, async_op=async_op)

    def _w__all_gather_base(self, output_tensor, input_tensor, group=None, async_op=False):
        rec = self._collective("all_gather", group, input_tensor, output_tensor)
        return self._run([rec], self._orig["_all_gather_base"], output_tensor, input_tensor,
                         group=group, async_op=async_op)

    def _w_all_gather(self, tensor_list, tensor, group=None, async_op=False):
        rec = self._list_collective("all_gather", group, [tensor], tensor_list)
        return self._run([rec], self._orig["all_gather"], tensor_list, tensor, group=group,
                         async_op=async_op)

    def _reduce_kw(self, op, group, async_op):
        kw = {"group": group, "async_op": async_op}
        if op is not None:
            kw["op"] = op
        return kw

    def _w_reduce_scatter_tensor(self, output, input, op=None, group=None, async_op=False):
        rec = self._collective("reduce_scatter", group, input, output)
        return self._run([rec], self._orig["reduce_scatter_tensor"], output, input,
                         **self._reduce_kw(op, group, async_op))

    def _w__reduce_scatter_base(self, output, input, op=None, group=None, async_op=False):
        rec = self._collective("reduce_scatter", group, input, output)
        return self._run([rec], self._orig["_reduce_scatter_base"], output, input,
                         **self._reduce_kw(op, group, async_op))

    def _w_reduce_scatter(self, output, input_list, op=None, group=None, async_op=False):
        rec = self._list_collective("reduce_scatter", group, input_list, [output])
        return self._run([rec], self._orig["reduce_scatter"], output, input_list,
                         **self._reduce_kw(op, group, async_op))

    def _w_all_reduce(self, tensor, op=None, group=None, async_op=False):
        rec = self._collective("all_reduce", group, tensor, tensor)
        return self._run([rec], self._orig["all_reduce"], tensor,
                         **self._reduce_kw(op, group, async_op))

    def _w_broadcast(self, tensor, src, group=None, async_op=False):
        rec = self._collective("broadcast", group, tensor, tensor)
        return self._run([rec], self._orig["broadcast"], tensor, src, group=group,
                         async_op=async_op)

    def _w_barrier(self, group=None, async_op=False, device_ids=None):
        rec = self._started(self._base("collective", group, "barrier", None))
        kw = {"group": group, "async_op": async_op}
        if device_ids is not None:
            kw["device_ids"] = device_ids
        return self._run([rec], self._orig["barrier"], **kw)

    @staticmethod
    def _global_peer(peer, group, group_peer):
        """torch >= 2.4 names a peer by its rank in the group too (group_dst / group_src)."""
        if peer is None and group_peer is not None:
            import torch.distributed as dist
            return dist.get_global_rank(group if group is not None else dist.group.WORLD,
                                        group_peer)
        return peer

    def _w_send(self, tensor, dst=None, group=None, tag=0, **kw):
        rec = self._p2p("send", tensor, self._global_peer(dst, group, kw.get("group_dst")), group)
        return self._run([rec], self._orig["send"], tensor, dst, group=group, tag=tag, **kw)

    def _w_recv(self, tensor, src=None, group=None, tag=0, **kw):
        rec = self._p2p("recv", tensor, self._global_peer(src, group, kw.get("group_src")), group)
        return self._run([rec], self._orig["recv"], tensor, src, group=group, tag=tag, **kw)

    def _w_isend(self, tensor, dst=None, group=None, tag=0, **kw):
        if self._in_batch:
            return self._orig["isend"](tensor, dst, group=group, tag=tag, **kw)
        rec = self._p2p("send", tensor, self._global_peer(dst, group, kw.get("group_dst")), group)
        return self._run([rec], self._orig["isend"], tensor, dst, group=group, tag=tag, **kw)

    def _w_irecv(self, tensor, src=None, group=None, tag=0, **kw):
        if self._in_batch:
            return self._orig["irecv"](tensor, src, group=group, tag=tag, **kw)
        rec = self._p2p("recv", tensor, self._global_peer(src, group, kw.get("group_src")), group)
        return self._run([rec], self._orig["irecv"], tensor, src, group=group, tag=tag, **kw)

    def _w_batch_isend_irecv(self, p2p_op_list):
        recs = []
        for p in p2p_op_list:
            fn = getattr(p.op, "__name__", str(p.op))
            op = "send" if "send" in fn else "recv"
            recs.append(self._p2p(op, p.tensor, p.peer, p.group))
        self._in_batch = True
        try:
            return self._run(recs, self._orig["batch_isend_irecv"], p2p_op_list)
        finally:
            self._in_batch = False

    # ---- output ------------------------------------------------------------------------
    def close(self):
        """Uninstalls the wrappers and closes this rank's stream; with one rank, also writes the
        merged trace to `path`. Returns the path replay reads (or the stream of this rank)."""
        self.uninstall()
        if not self._out.closed:
            try:
                self._out.close()
            except OSError as e:  # the last buffered bytes could not be written
                if self.write_error is None:
                    self.write_error = e
        if self.world_size == 1:
            merge(self.path, [self.stream_path])
            os.unlink(self.stream_path)
            return self.path
        return self.stream_path


class _Work:
    """An async work handle whose wait() also marks its calls completed (or failed)."""

    def __init__(self, work, recorder, recs):
        self._work, self._recorder, self._recs, self._done = work, recorder, recs, False

    def wait(self, *args, **kwargs):
        try:
            result = self._work.wait(*args, **kwargs)
        except BaseException as e:
            self._mark("failed", f"{type(e).__name__}: {e}")
            raise
        self._mark("completed")
        return result

    def _mark(self, state, error=None):
        if not self._done:
            self._done = True
            for r in self._recs:
                self._recorder._finish(r, state, error)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def recording(path=None, config=None):
    """Records every collective made inside; the path defaults to $SEQPAR_TRACE."""
    path = path or os.environ.get("SEQPAR_TRACE")
    if not path:
        raise ValueError("seqpar_recorder.recording: give a path or set SEQPAR_TRACE")
    rec = Recorder(path, config=config)
    try:
        yield rec
    finally:
        rec.close()


def merge(out, parts):
    """One trace from per-rank streams (or per-rank traces): the first meta with every group
    united, then each call with its completion joined ("started" when the rank never returned
    from it), then layouts."""
    meta, calls, done, torn = None, [], {}, []
    for p in parts:
        with open(p) as f:
            lines = f.read().split("\n")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError:
                # A line cut by the crash of its rank (or a full disk): never read as whole;
                # the calls before it are kept, and the trace says so.
                torn.append(f"{os.path.basename(p)}:{n}")
                continue
            kind = r.get("type")
            if kind == "meta":
                if meta is None:
                    meta = r
                else:
                    meta.setdefault("groups", {}).update(r.get("groups", {}))
            elif kind == "group":
                if meta is not None:
                    meta.setdefault("groups", {})[r["name"]] = r["ranks"]
            elif kind == "done":
                done[(r["rank"], r["group"], r["seq"], r["p2p"])] = r
            else:
                calls.append(r)
    if meta is None:
        raise SystemExit("seqpar_recorder merge: no meta record in the inputs")
    if torn:
        meta.setdefault("notes", []).append(
            f"recorder: {len(torn)} line(s) cut short (a rank killed or out of disk while "
            f"writing) were left out: {', '.join(torn[:8])}{' …' if len(torn) > 8 else ''}")
    lines = [json.dumps(meta, separators=(",", ":"))]
    for r in calls:
        if r.get("type") in ("collective", "p2p"):
            d = done.get((r["rank"], r["group"], r["seq"], r["type"] == "p2p"))
            if d is not None:
                r["t_end"] = d["t_end"]
                if d["state"] == "completed":
                    r["state"] = "completed"
                else:
                    r["error"] = d.get("error", "")
        lines.append(json.dumps(r, separators=(",", ":")))
    write_atomic(out, "".join(line + "\n" for line in lines))


def main(argv):
    """`python3 -m seqpar.recorder merge OUT.jsonl RANK_FILES...`"""
    if len(argv) >= 3 and argv[0] == "merge":
        merge(argv[1], argv[2:])
        return 0
    print("usage: python3 -m seqpar.recorder merge OUT.jsonl RANK_FILES...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

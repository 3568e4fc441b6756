"""seqpar recorder: writes the seqpar-trace/1 trace (traces/README.md) of a PyTorch SP training
script, for ``seqpar replay``. Standard library + torch only.

    import seqpar_recorder as spr
    rec = spr.Recorder("run.jsonl", config={...scenario...})   # after init_process_group
    rec.name_group(ulysses_pg, "ulysses0")                       # optional: readable names
    with rec.tag("L0.attn.q.fwd"):
        dist.all_to_all_single(out, inp, group=ulysses_pg)
    rec.record_layout(dist.get_rank(), batch)                    # the collator output
    rec.close()     # rank r writes run.jsonl.rank{r} (run.jsonl itself when world_size == 1)

    python3 tools/seqpar_recorder.py merge run.jsonl run.jsonl.rank*   # one trace for replay

While a Recorder is installed, torch.distributed's all_to_all_single, all_gather_into_tensor,
reduce_scatter_tensor, all_reduce, broadcast, barrier, send, recv, isend, irecv and
batch_isend_irecv record their call (group, per-(rank, group) seq, op, dtype, shapes, splits in
elements, peer, tag) and then run unchanged.
"""
import contextlib
import json
import os
import sys
import tempfile

SCHEMA = "seqpar-trace/1"


def write_atomic(path, text):
    """Writes text to path through a temp file in the same directory and a rename: a reader
    never sees a partial file, and a failure leaves none behind."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".seqpar-tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class Recorder:
    _WRAPPED = ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor",
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
        self._lines = []
        self._orig = {}
        self._in_batch = False
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
        self._lines.append(json.dumps(rec, separators=(",", ":")))

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
        rec["state"] = "completed"
        self._emit(rec)

    def _p2p(self, op, tensor, peer, pg):
        rec = self._base("p2p", pg, op, self._dtype(tensor))
        rec["peer"] = int(peer)
        rec["shape"] = list(tensor.shape)
        self._emit(rec)

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
        for name in self._WRAPPED:
            if hasattr(d, name) and name not in self._orig:
                self._orig[name] = getattr(d, name)
                setattr(d, name, getattr(self, "_w_" + name))

    def uninstall(self):
        for name, fn in self._orig.items():
            setattr(self._dist, name, fn)
        self._orig.clear()

    def _w_all_to_all_single(self, output, input, output_split_sizes=None,
                             input_split_sizes=None, group=None, async_op=False):
        self._collective("all_to_all", group, input, output, input_split_sizes,
                         output_split_sizes)
        return self._orig["all_to_all_single"](output, input, output_split_sizes,
                                               input_split_sizes, group=group, async_op=async_op)

    def _w_all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        self._collective("all_gather", group, input_tensor, output_tensor)
        return self._orig["all_gather_into_tensor"](output_tensor, input_tensor, group=group,
                                                    async_op=async_op)

    def _w_reduce_scatter_tensor(self, output, input, op=None, group=None, async_op=False):
        self._collective("reduce_scatter", group, input, output)
        kw = {"group": group, "async_op": async_op}
        if op is not None:
            kw["op"] = op
        return self._orig["reduce_scatter_tensor"](output, input, **kw)

    def _w_all_reduce(self, tensor, op=None, group=None, async_op=False):
        self._collective("all_reduce", group, tensor, tensor)
        kw = {"group": group, "async_op": async_op}
        if op is not None:
            kw["op"] = op
        return self._orig["all_reduce"](tensor, **kw)

    def _w_broadcast(self, tensor, src, group=None, async_op=False):
        self._collective("broadcast", group, tensor, tensor)
        return self._orig["broadcast"](tensor, src, group=group, async_op=async_op)

    def _w_barrier(self, group=None, async_op=False, device_ids=None):
        rec = self._base("collective", group, "barrier", None)
        rec["state"] = "completed"
        self._emit(rec)
        kw = {"group": group, "async_op": async_op}
        if device_ids is not None:
            kw["device_ids"] = device_ids
        return self._orig["barrier"](**kw)

    def _w_send(self, tensor, dst, group=None, tag=0):
        self._p2p("send", tensor, dst, group)
        return self._orig["send"](tensor, dst, group=group, tag=tag)

    def _w_recv(self, tensor, src=None, group=None, tag=0):
        self._p2p("recv", tensor, src, group)
        return self._orig["recv"](tensor, src, group=group, tag=tag)

    def _w_isend(self, tensor, dst, group=None, tag=0):
        if not self._in_batch:
            self._p2p("send", tensor, dst, group)
        return self._orig["isend"](tensor, dst, group=group, tag=tag)

    def _w_irecv(self, tensor, src=None, group=None, tag=0):
        if not self._in_batch:
            self._p2p("recv", tensor, src, group)
        return self._orig["irecv"](tensor, src, group=group, tag=tag)

    def _w_batch_isend_irecv(self, p2p_op_list):
        for p in p2p_op_list:
            fn = getattr(p.op, "__name__", str(p.op))
            op = "send" if "send" in fn else "recv"
            self._p2p(op, p.tensor, p.peer, p.group)
        self._in_batch = True
        try:
            return self._orig["batch_isend_irecv"](p2p_op_list)
        finally:
            self._in_batch = False

    # ---- output ------------------------------------------------------------------------
    def meta(self):
        m = {"type": "meta", "schema": SCHEMA, "world_size": self.world_size,
             "groups": self._groups, "source": "recorder"}
        if self.config is not None:
            m["config"] = self.config
        return m

    def close(self):
        """Uninstalls the wrappers and writes this rank's trace atomically; returns its path."""
        self.uninstall()
        path = self.path if self.world_size == 1 else f"{self.path}.rank{self.rank}"
        text = json.dumps(self.meta(), separators=(",", ":")) + "\n"
        text += "".join(line + "\n" for line in self._lines)
        write_atomic(path, text)
        return path


def merge(out, parts):
    """One trace from per-rank files: the first meta (groups united), then every record."""
    meta, records = None, []
    for p in parts:
        with open(p) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                r = json.loads(line)
                if r.get("type") == "meta":
                    if meta is None:
                        meta = r
                    else:
                        meta["groups"].update(r.get("groups", {}))
                else:
                    records.append(line if line.endswith("\n") else line + "\n")
    if meta is None:
        raise SystemExit("seqpar_recorder merge: no meta record in the inputs")
    write_atomic(out, json.dumps(meta, separators=(",", ":")) + "\n" + "".join(records))


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "merge":
        merge(sys.argv[2], sys.argv[3:])
    else:
        print("usage: seqpar_recorder.py merge OUT.jsonl RANK_FILES...", file=sys.stderr)
        sys.exit(2)

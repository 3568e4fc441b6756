"""seqpar dump hook: records a PyTorch SP job's attention, rank by rank, in the `seqpar-dump/1`
format (docs/dump_format.md) that `seqpar validate --dump DIR` checks. Standard library + torch
(1.13 and 2.x), CPU or GPU tensors. Example, a Ulysses attention layer:

    import seqpar.dump
    d = seqpar.dump.from_env(ulysses=U, ring=1, ulysses_rank=u, ring_rank=0, heads=H, kv_heads=Hkv,
                             head_dim=D, scale=D ** -0.5, causal=True, cu_seqlens=cu,
                             position_ids=pos)            # SEQPAR_DUMP=DIR enables it
    with d.call(name="L0.attn"):
        q, k, v = d.tap("q.local", q), d.tap("k.local", k), d.tap("v.local", v)
        qg, kg, vg = (d.wrap(a2a, "%s.gathered" % n)(t) for n, t in (("q", q), ("k", k), ("v", v)))
        o, lse = attn(qg, kg, vg)                          # o [S, H/U, D], lse [H/U, S]
        d.tap("out.attn", o); d.tap("lse", lse, layout="hs")
        out = d.tap("out.local", a2a_back(o))
    loss.backward(); d.close()                             # gradients are recorded by hooks

Every file is written to a temporary name in the same directory and renamed; `rank{R}.json` is
rewritten after every data file and lists only files that exist. A call's forward file is
written when its `call()` block exits (also by an exception); its backward file once every
gradient hook registered in the call fired, or at `close()` with what arrived.
"""
import contextlib
import json
import os
import struct
import sys
import tempfile
import threading

import torch

SCHEMA = "seqpar-dump/1"

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
}
_ST_FROM_NAME = {v: k for k, v in _ST_DTYPES.items()}

_TOKEN_LAYOUTS = ("shd", "bshd", "bhsd", "hsd")
_LSE_LAYOUTS = ("hs", "bhs", "sh")


# ----------------------------------------------------------------------------- safetensors I/O

def _file_mode():
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_FILE_MODE = _file_mode()


def _write_atomic_bytes(path, chunks, durable=True):
    """Writes the byte chunks to path via a temp file in the same directory and os.replace
    (fsync'ed first when durable: a job that dies leaves no torn file after a power loss
    either; the property tests' scratch dumps skip it)."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".seqpar-tmp-")
    try:
        try:
            os.fchmod(fd, _FILE_MODE)  # mkstemp makes 0600; give the file the usual mode
        except (AttributeError, OSError):
            pass
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _raw_bytes(t):
    """Little-endian raw bytes of a tensor (bf16 included, on torch 1.13 where numpy has no
    bfloat16: 2-byte types are reinterpreted as int16, which has the same size)."""
    t = t.detach().cpu().contiguous()
    if t.dtype not in _ST_DTYPES:
        raise TypeError("seqpar.dump: unsupported dtype %s" % t.dtype)
    try:
        arr = (t.view(torch.int16) if t.element_size() == 2 else t).numpy()
    except (ImportError, RuntimeError, TypeError):
        arr = None  # torch 2.x built without numpy
    if arr is not None:
        if sys.byteorder != "little":
            arr = arr.byteswap()
        return arr.tobytes()
    if sys.byteorder != "little":
        raise RuntimeError("seqpar.dump: big-endian host without numpy")
    return bytes(t.reshape(-1).view(torch.uint8).tolist())


def write_safetensors(path, tensors, metadata=None, durable=True):
    """Writes {name: tensor} (insertion order) as one safetensors file, atomically."""
    header = {}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        b = _raw_bytes(t)
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((-len(h)) % 8)
    _write_atomic_bytes(path, [struct.pack("<Q", len(h)), h] + blobs, durable)


def read_safetensors(path, with_metadata=False):
    """Reads a safetensors file into {name: CPU tensor} (and its __metadata__ if asked)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode("utf-8"))
    base = 8 + n
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, info in header.items():
        dt = _ST_FROM_NAME[info["dtype"]]
        b, e = info["data_offsets"]
        shape = info["shape"]
        if e == b:
            out[name] = torch.zeros(shape, dtype=dt)
            continue
        buf = bytearray(data[base + b:base + e])
        t = torch.frombuffer(buf, dtype=dt)
        if sys.byteorder != "little":
            t = torch.from_numpy(t.numpy().byteswap())
        out[name] = t.reshape(shape).clone()
    return (out, meta) if with_metadata else out


# ----------------------------------------------------------------------------- the hook

def _normalize(stage, t, layout):
    """Returns t as [s, h, d] (lse: [h, s]; sinks: [h]) per its declared layout."""
    if stage == "sinks":
        if t.dim() != 1:
            raise ValueError("seqpar.dump: sinks must be 1-d [heads], got %s" % (tuple(t.shape),))
        return t
    if stage == "lse" or stage.endswith(".lse"):
        layout = layout or "hs"
        if layout == "hs":
            r = t
        elif layout == "bhs":
            if t.dim() != 3 or t.shape[0] != 1:
                raise ValueError("seqpar.dump: lse layout bhs needs batch 1, got %s" % (tuple(t.shape),))
            r = t[0]
        elif layout == "sh":
            r = t.transpose(0, 1)
        else:
            raise ValueError("seqpar.dump: lse layout must be one of %s" % (_LSE_LAYOUTS,))
        if r.dim() != 2:
            raise ValueError("seqpar.dump: lse must be 2-d after layout %s" % layout)
        return r
    layout = layout or "shd"
    if layout == "shd":
        r = t
    elif layout == "bshd":
        if t.dim() != 4 or t.shape[0] != 1:
            raise ValueError("seqpar.dump: layout bshd needs batch 1, got %s" % (tuple(t.shape),))
        r = t[0]
    elif layout == "bhsd":
        if t.dim() != 4 or t.shape[0] != 1:
            raise ValueError("seqpar.dump: layout bhsd needs batch 1, got %s" % (tuple(t.shape),))
        r = t[0].transpose(0, 1)
    elif layout == "hsd":
        r = t.transpose(0, 1)
    else:
        raise ValueError("seqpar.dump: layout must be one of %s" % (_TOKEN_LAYOUTS,))
    if r.dim() != 3:
        raise ValueError("seqpar.dump: %s must be 3-d after layout %s" % (stage, layout))
    return r


def _cpu_copy(t):
    return t.detach().to("cpu", copy=True).contiguous()


def _as_list(x):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.detach().cpu().reshape(-1).tolist()]
    return [int(v) for v in x]


def _dtype_name(dt):
    if dt is None:
        return None
    if isinstance(dt, torch.dtype):
        return str(dt).replace("torch.", "")
    return str(dt)


class _Call(object):
    def __init__(self, index, name):
        self.index = index
        self.name = name
        self.fwd = {}
        self.grads = {}
        self.hooks_expected = 0
        self.hooks_fired = 0
        self.fwd_path = None
        self.bwd_path = None
        self.fwd_done = False
        self.bwd_done = False


def _lock_rank(directory, rank):
    """Holds `.rank<R>.lock` in the dump directory (fcntl.flock) while the Dumper lives: a
    second job dumping the same rank into the same directory is refused with the reason, instead
    of the two overwriting each other's calls. A lock left by a job that ended is free."""
    import fcntl
    path = os.path.join(directory, ".rank%d.lock" % rank)
    f = open(path, "a")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        raise OSError(e.errno, "seqpar.dump: rank %d: %s is being dumped into by another "
                      "running job (it holds %s); give each job a directory of its own"
                      % (rank, directory, path)) from e
    return f


def _padded_cu(cu_seqlens, padding_from, position_ids, ulysses, ring):
    """cu_seqlens as the meta holds them. With padding_from (the row is padded past the
    kernel's own cu_seqlens, which end there: xorl with a ring) and cu_seqlens that stop at it,
    the padding's placement blocks are appended the way xorl makes them (fake documents of up
    to 1024 tokens) up to the padded length, every rank's tokens times ulysses × ring."""
    cu = _as_list(cu_seqlens)
    if padding_from is None:
        return cu
    total = len(_as_list(position_ids)) * int(ulysses) * int(ring)
    if cu and cu[-1] == int(padding_from):
        while cu[-1] < total:
            cu.append(min(cu[-1] + 1024, total))
    return cu


class Dumper(object):
    """Records the attention of one rank into `directory` (see the module docstring)."""

    def __init__(self, directory, *, ulysses, ring, ulysses_rank, ring_rank, heads, kv_heads,
                 head_dim, scale, causal, cu_seqlens, position_ids, ring_layout="zigzag",
                 rank=None, world_size=None, dtype=None, job="", durable=True, window_back=-1,
                 window_ahead=-1, chunk=0, softcap=0.0, padding_from=None):
        if rank is None or world_size is None:
            drank, dworld = 0, 1
            try:
                import torch.distributed as dist
                if dist.is_available() and dist.is_initialized():
                    drank, dworld = dist.get_rank(), dist.get_world_size()
            except Exception:
                pass
            rank = drank if rank is None else rank
            world_size = dworld if world_size is None else world_size
        self.directory = str(directory)
        self.rank = int(rank)
        self._durable = bool(durable)
        self._lock = threading.RLock()
        self._calls = []
        self._current = None
        self._closed = False
        self._meta = {
            "schema": SCHEMA,
            "rank": self.rank,
            "world_size": int(world_size),
            "ulysses": int(ulysses),
            "ring": int(ring),
            "ulysses_rank": int(ulysses_rank),
            "ring_rank": int(ring_rank),
            "ring_layout": str(ring_layout),
            "heads": int(heads),
            "kv_heads": int(kv_heads),
            "head_dim": int(head_dim),
            "scale": float(scale),
            "causal": bool(causal),
            "cu_seqlens": _padded_cu(cu_seqlens, padding_from, position_ids, ulysses, ring),
            "position_ids": _as_list(position_ids),
            "dtype": _dtype_name(dtype),
            "torch": str(torch.__version__),
            "job": str(job),
        }
        if padding_from is not None:
            self._meta["padding_from"] = int(padding_from)
        # The attention options (docs/dump_format.md), written only when set.
        for key, value, off in (("window_back", int(window_back), -1),
                                ("window_ahead", int(window_ahead), -1), ("chunk", int(chunk), 0),
                                ("softcap", float(softcap), 0.0)):
            if value != off:
                self._meta[key] = value
        self.write_error = None  # the OSError that stopped this rank's dump, if any
        try:
            os.makedirs(os.path.join(self.directory, "rank%d" % self.rank), exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, "seqpar.dump: rank %d: cannot create %s: %s (is the place "
                          "writable?)" % (self.rank, os.path.join(self.directory, "rank%d" %
                                                               self.rank), e.strerror)) from e
        self._lock_file = _lock_rank(self.directory, self.rank)
        self._write_meta()

    # -- writes that never break the user's step
    def _safely(self, what, write):
        """Runs write(); an OSError (a full disk, a file size limit, the directory gone) stops
        the dump of this rank, said once on stderr: the files already written and the last
        rank meta stay whole (every file is renamed into place), so `validate --dump` checks
        the calls before this one."""
        if self.write_error is not None:
            return False
        try:
            write()
            return True
        except OSError as e:
            self.write_error = e
            self._closed = True
            sys.stderr.write(
                "seqpar.dump: rank %d: cannot write %s: %s — dumping stopped here; the training "
                "goes on, and the dump of this rank holds the calls written before it\n"
                % (self.rank, what, e.strerror or e))
            sys.stderr.flush()
            return False

    # -- meta
    def _write_meta(self):
        self._safely("rank%d.json" % self.rank, self._write_meta_now)

    def _write_meta_now(self):
        calls = []
        for c in self._calls:
            e = {"index": c.index, "name": c.name}
            if c.fwd_path:
                e["forward"] = c.fwd_path
            if c.bwd_path:
                e["backward"] = c.bwd_path
            if c.fwd_path or c.bwd_path:
                calls.append(e)
        meta = dict(self._meta)
        meta["calls"] = calls
        text = json.dumps(meta, indent=1) + "\n"
        _write_atomic_bytes(os.path.join(self.directory, "rank%d.json" % self.rank),
                            [text.encode("utf-8")], self._durable)

    def _rel(self, call, kind):
        return "rank%d/call%04d.%s.safetensors" % (self.rank, call.index, kind)

    def _file_meta(self, call, kind):
        return {"schema": SCHEMA, "rank": self.rank, "call": call.index, "name": call.name,
                "kind": kind}

    # -- calls
    @contextlib.contextmanager
    def call(self, name=""):
        """Groups the taps inside the block into the next call index."""
        with self._lock:
            self._finish_forward(self._current)
            c = _Call(len(self._calls), str(name))
            self._calls.append(c)
            self._current = c
        try:
            yield self
        finally:
            with self._lock:
                if self._current is c:
                    self._current = None
                self._finish_forward(c)

    def _active_call(self):
        if self._current is None:
            # A tap outside any call() block opens an implicit call that the next call()
            # or close() finishes.
            c = _Call(len(self._calls), "")
            self._calls.append(c)
            self._current = c
        return self._current

    def _finish_forward(self, c):
        if c is None or c.fwd_done:
            return
        c.fwd_done = True
        if c.fwd:
            if not self._safely(self._rel(c, "fwd"), lambda: write_safetensors(
                    os.path.join(self.directory, self._rel(c, "fwd")), c.fwd,
                    self._file_meta(c, "forward"), self._durable)):
                return
            c.fwd_path = self._rel(c, "fwd")
            self._write_meta()
        if c.hooks_expected and c.hooks_fired >= c.hooks_expected:
            self._finish_backward(c)

    def _finish_backward(self, c):
        if c.bwd_done or not c.fwd_done:
            return
        if not c.grads:
            return
        c.bwd_done = True
        if not self._safely(self._rel(c, "bwd"), lambda: write_safetensors(
                os.path.join(self.directory, self._rel(c, "bwd")), c.grads,
                self._file_meta(c, "backward"), self._durable)):
            return
        c.bwd_path = self._rel(c, "bwd")
        self._write_meta()

    # -- taps
    def tap(self, stage, x, layout=None):
        """Records a CPU copy of x as forward stage `stage`; returns x itself. If x requires
        grad, its gradient is recorded as "grad." + stage (the gradient is not modified)."""
        if self._closed or not isinstance(x, torch.Tensor):
            return x
        with self._lock:
            c = self._active_call()
            if self._meta["dtype"] is None and stage == "q.local":
                self._meta["dtype"] = _dtype_name(x.dtype)
            c.fwd[stage] = _cpu_copy(_normalize(stage, x, layout))
            is_lse = stage == "lse" or stage.endswith(".lse")
            if x.requires_grad and not is_lse:
                c.hooks_expected += 1
                x.register_hook(self._make_hook(c, stage, layout))
        return x

    def _make_hook(self, c, stage, layout):
        def hook(grad):
            try:
                with self._lock:
                    if not c.bwd_done:
                        c.grads["grad." + stage] = _cpu_copy(_normalize(stage, grad, layout))
                        c.hooks_fired += 1
                        if c.hooks_fired >= c.hooks_expected:
                            self._finish_backward(c)
            except Exception as e:  # never break the user's backward
                sys.stderr.write("seqpar.dump: gradient of %s not recorded: %s\n" % (stage, e))
            return None
        return hook

    def wrap(self, fn, stage, layout=None):
        """Returns a function that calls fn and taps its output as `stage`."""
        def wrapped(*args, **kwargs):
            return self.tap(stage, fn(*args, **kwargs), layout=layout)
        wrapped.__name__ = getattr(fn, "__name__", "wrapped")
        wrapped.__doc__ = getattr(fn, "__doc__", None)
        return wrapped

    def close(self):
        """Writes what is pending: forward files of open calls, backward files with the
        gradients that arrived; then lets another job use the directory's rank slot."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for c in self._calls:
                    self._finish_forward(c)
                for c in self._calls:
                    self._finish_backward(c)
                self._current = None
                self._write_meta()
            if self._lock_file is not None:
                self._lock_file.close()
                self._lock_file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class NullDumper(object):
    """The no-op stand-in from_env returns when SEQPAR_DUMP is not set."""

    directory = None

    @contextlib.contextmanager
    def call(self, name=""):
        yield self

    def tap(self, stage, x, layout=None):
        return x

    def wrap(self, fn, stage, layout=None):
        return fn

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def from_env(**meta):
    """A Dumper on $SEQPAR_DUMP when that names a directory, else a NullDumper."""
    d = os.environ.get("SEQPAR_DUMP", "")
    if not d:
        return NullDumper()
    return Dumper(d, **meta)

"""A persistent pool of rank processes per world size: the gloo world is made once and reused by
every example; a pool whose ranks raised, hung or returned a bad output is killed and made again
for the next example (its collectives may be out of step)."""
import linecache
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import socket
import tempfile
import time

from . import worker

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def parse_stack(text):
    """The last faulthandler traceback in text as [(file, line, func)], most recent first."""
    blocks = re.split(r"(?m)^.*\(most recent call first\):\s*$", text)
    if len(blocks) < 2:
        return []
    frames = []
    for line in blocks[-1].splitlines():
        m = _FRAME.match(line)
        if m:
            frames.append((m.group("file"), int(m.group("line")), m.group("func")))
    return frames


def _is_torch(path):
    p = path.replace("\\", "/")
    return "/torch/" in p


def _is_harness(path):
    return os.path.abspath(path).startswith(os.path.dirname(os.path.abspath(__file__)))


def describe_stack(frames):
    """('waiting' | 'busy' | 'unknown', text): whether the rank sits inside a torch.distributed
    call (waiting for peers) or in its own code (busy: the likely culprit)."""
    if not frames:
        return "unknown", "no Python stack could be read"
    user = [f for f in frames if not _is_torch(f[0]) and not _is_harness(f[0])]
    # torch's own decorators (c10d_logger's `wrapper`) are not the API the user called
    dist_frames = [f for f in frames if "/torch/distributed/" in f[0].replace("\\", "/") and
                   not f[0].endswith("c10d_logger.py") and f[2] != "wrapper"]
    where = ("%s:%d in %s" % (os.path.relpath(user[0][0]), user[0][1], user[0][2])
             if user else "%s:%d in %s" % frames[0])
    if dist_frames:
        # The outermost torch.distributed frame is the API the user called.
        api = dist_frames[-1][2]
        in_backward = any(f[2] in ("backward", "_engine_run_backward") and _is_torch(f[0])
                          for f in frames)
        return "waiting", "waiting in torch.distributed.%s%s, called at %s" % (
            api, " (during backward)" if in_backward else "", where)
    top = frames[0]
    if user and user[0] == top and re.search(r"\.wait\(|synchronize\(",
                                             linecache.getline(top[0], top[1])):
        # A Work.wait() of an async collective or isend/irecv: C++, no torch frame above it.
        return "waiting", "waiting on an asynchronous collective or send/recv (.wait()) at %s" % (
            where)
    if _is_torch(top[0]):
        return "busy", "busy in torch (%s:%d in %s), called at %s" % (
            os.path.basename(top[0]), top[1], top[2], where)
    return "busy", "busy at %s" % where


class RankPool(object):
    """`world` worker processes joined in one gloo world, running one example at a time."""

    def __init__(self, world, impl, start_method="fork", init_timeout=120.0):
        self.world = world
        self.impl = impl
        self.ctx = multiprocessing.get_context(start_method)
        self.init_timeout = init_timeout
        self.procs = []
        self.conns = []
        self.stack_dir = tempfile.mkdtemp(prefix="seqpar-stacks-")
        self.alive = False
        self.starts = 0

    def stack_path(self, rank):
        return os.path.join(self.stack_dir, "rank%d.txt" % rank)

    def start(self):
        last = None
        for attempt in range(3):  # the free port can be taken between probe and bind
            port = _free_port()
            self.procs, self.conns = [], []
            for r in range(self.world):
                parent, child = self.ctx.Pipe()
                open(self.stack_path(r), "w").close()
                p = self.ctx.Process(target=worker.main, name="seqpar-rank%d" % r,
                                     args=(r, self.world, port, child, self.impl,
                                           self.stack_path(r)), daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            deadline = time.monotonic() + self.init_timeout
            ready, problem = set(), None
            while len(ready) < self.world and problem is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    problem = "ranks %s did not join the gloo world within %.0f s" % (
                        sorted(set(range(self.world)) - ready), self.init_timeout)
                    break
                for c in multiprocessing.connection.wait(self.conns, timeout=min(left, 1.0)):
                    r = self.conns.index(c)
                    try:
                        msg = c.recv()
                    except EOFError:
                        problem = "rank %d died while starting (exit code %s)" % (
                            r, self.procs[r].exitcode)
                        break
                    if msg.get("status") == "ready":
                        ready.add(r)
                    else:
                        problem = "rank %d could not start: %s" % (r, msg.get("error", msg))
                        break
            if problem is None:
                self.alive = True
                self.starts += 1
                return
            last = problem
            self.kill()
            if "could not start" in problem:
                break
        raise RuntimeError("seqpar.testing: the pool of %d ranks did not start: %s" %
                           (self.world, last))

    def run(self, task, deadline, grace=2.0):
        """Sends task to every rank and collects their replies. Returns (results, stacks):
        results[r] is rank r's reply or None when it did not return; stacks[r] describes where
        a rank that did not return was (busy in user code or waiting in a collective). Kills the
        pool unless every rank replied "ok"."""
        if not self.alive:
            self.start()
        for c in self.conns:
            c.send(task)
        results = [None] * self.world
        end = time.monotonic() + deadline
        pending = set(range(self.world))
        failed_at = None
        while pending:
            now = time.monotonic()
            limit = end if failed_at is None else min(end, failed_at + grace)
            if now >= limit:
                break
            conns = [self.conns[r] for r in pending]
            for c in multiprocessing.connection.wait(conns, timeout=min(limit - now, 0.5)):
                r = self.conns.index(c)
                try:
                    results[r] = c.recv()
                except EOFError:
                    results[r] = {"status": "died", "rank": r,
                                  "message": "the rank's process died (exit code %s)" %
                                  self.procs[r].exitcode}
                pending.discard(r)
                if results[r].get("status") != "ok" and failed_at is None:
                    failed_at = time.monotonic()
        stacks = {}
        if pending:
            stacks = self._stacks(sorted(pending))
        if pending or any(x is None or x.get("status") != "ok" for x in results):
            self.kill()
        return results, stacks

    def _stacks(self, ranks):
        for r in ranks:
            path = self.stack_path(r)
            open(path, "w").close()
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(0.3)
        out = {}
        for r in ranks:
            try:
                with open(self.stack_path(r)) as f:
                    out[r] = describe_stack(parse_stack(f.read()))
            except OSError:
                out[r] = ("unknown", "no stack")
        return out

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []
        self.alive = False

    def close(self):
        if self.alive:
            for c in self.conns:
                try:
                    c.send(None)
                except (OSError, BrokenPipeError):
                    pass
            for p in self.procs:
                p.join(timeout=5)
        self.kill()
        for name in os.listdir(self.stack_dir):
            os.unlink(os.path.join(self.stack_dir, name))
        os.rmdir(self.stack_dir)

"""Test hosts on one machine: network namespaces joined by veth pairs on a bridge, so that an MPI
job's ranks on different "hosts" talk over real TCP stacks (tests/mpi/hosts-test.py,
bench/hosts_soak.py).

Each host is a network namespace with one interface (eth0, on the harness's own /24) and its own
UTS and IPC namespaces (its own host name, no shared memory with the others), so MPICH's UCX
treats the hosts as different machines and sends their traffic through TCP. mpiexec runs in the
machine's own namespace on the bridge and reaches each host through a launcher wrapper that
enters the host's namespaces (as ssh would log in). Every host is torn down on exit, also on
failure (atexit and SIGTERM).

Needs root (ip netns, veth, bridge); `TestHosts.available()` says why not where it cannot run.

    with TestHosts(4) as hosts:
        cmd = hosts.mpiexec(8, ["seqpar", "check", "--backend", "mpi", ...])
        hosts.cut(2)        # host 2's link down (ip link set … down)
        hosts.mend(2)
        hosts.slow(1, "2mbit"); hosts.slow(1, None)   # tc tbf
        hosts.netem(1, "loss 2%")   # where the kernel has sch_netem (netem_available)
        hosts.kill(3)       # SIGKILL every process on host 3 (its launcher proxy too)
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class TestHosts:
    """N hosts; ranks are placed one per host in turn (rank r on host r mod N), so that every
    group of consecutive ranks (a Ulysses group) and every ring crosses hosts."""

    def __init__(self, n: int, tag: str | None = None):
        if n < 2 or n > 16:
            raise ValueError(f"TestHosts: {n} hosts (want 2..16)")
        self.n = n
        uid = tag or f"{os.getpid() % 100000}"
        self.tag = uid
        self.bridge = f"sqb{uid}"[:15]
        self.subnet = f"10.{200 + (os.getpid() % 50)}.{(os.getpid() // 50) % 250}"
        self.names = [f"sq{uid}h{h}"[:15] for h in range(n)]  # namespace = host name
        self.links = [f"sqv{uid}h{h}"[:15] for h in range(n)]  # the bridge's end of each veth
        self.addrs = [f"{self.subnet}.{h + 1}" for h in range(n)]
        self.dir = tempfile.mkdtemp(prefix="seqpar-hosts-")
        self.hostfile = os.path.join(self.dir, "hosts")
        self.wrapper = os.path.join(self.dir, "enter-host")
        self._up = False

    @staticmethod
    def available() -> str | None:
        """None when test hosts can be made here, else why not."""
        if os.geteuid() != 0:
            return "test hosts need root (ip netns, veth pairs, a bridge)"
        for tool in ("ip", "unshare", "mpiexec"):
            if not shutil.which(tool):
                return f"test hosts need {tool}"
        probe = f"sqprobe{os.getpid() % 100000}"
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"ip netns add fails here: {r.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    # ---- lifetime ----
    def __enter__(self) -> "TestHosts":
        atexit.register(self.down)
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(sig, frame):
            self.down()
            if callable(previous):
                previous(sig, frame)
            raise SystemExit(128 + sig)

        signal.signal(signal.SIGTERM, on_term)
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        self._up = True
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in range(self.n):
            ns, link = self.names[h], self.links[h]
            _ip("netns", "add", ns)
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", link, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.addrs[h]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        self._wait_ready()
        with open(self.hostfile, "w") as f:
            for a in self.addrs:
                f.write(f"{a}:1\n")
        # The launcher: "enter-host ADDRESS COMMAND…" (hydra's rsh convention; the command
        # arrives as words for a remote shell).
        cases = "\n".join(f"  {a}) ns={ns} ;;" for a, ns in zip(self.addrs, self.names))
        with open(self.wrapper, "w") as f:
            f.write(
                "#!/bin/sh\n"
                "host=$1; shift\n"
                f'case "$host" in\n{cases}\n  *) echo "enter-host: unknown host $host" >&2; exit 255 ;;\n'
                "esac\n"
                'exec ip netns exec "$ns" unshare --uts --ipc sh -c "hostname $ns; exec $*"\n'
            )
        os.chmod(self.wrapper, 0o755)

    def _wait_ready(self) -> None:
        """Until every bridge port forwards and every host's eth0 has its carrier (a host used
        at once may find no route to the bridge yet)."""

        def ready() -> bool:
            for h in range(self.n):
                try:
                    with open(f"/sys/class/net/{self.links[h]}/brport/state") as f:
                        if f.read().strip() != "3":
                            return False
                except OSError:
                    return False
                if "LOWER_UP" not in _ip("-n", self.names[h], "link", "show", "eth0").stdout:
                    return False
            return True

        end = time.monotonic() + 10
        while not ready():
            if time.monotonic() > end:
                raise RuntimeError(f"test hosts: the links of {self.names} never came up")
            time.sleep(0.05)

    def down(self) -> None:
        if not self._up:
            return
        self._up = False
        for h in range(self.n):
            self.kill(h)
            _ip("netns", "del", self.names[h], check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- use ----
    def mpiexec(self, np: int, argv: list[str], auto_cleanup: bool = True) -> list[str]:
        """The mpiexec command line that runs `argv` as `np` ranks over the hosts
        (auto_cleanup False: -disable-auto-cleanup, Hydra does not kill the job when a process
        dies)."""
        return ["mpiexec", "-f", self.hostfile, "-launcher", "rsh", "-launcher-exec",
                self.wrapper, "-iface", self.bridge,
                *([] if auto_cleanup else ["-disable-auto-cleanup"]), "-n", str(np), *argv]

    def host_of_rank(self, rank: int) -> int:
        return rank % self.n

    def ranks_on(self, h: int, np: int) -> list[int]:
        return [r for r in range(np) if r % self.n == h]

    def pids(self, h: int) -> list[int]:
        r = _ip("netns", "pids", self.names[h], check=False)
        return [int(p) for p in r.stdout.split()]

    def procs(self, h: int, name: str, exact: bool = False) -> list[int]:
        """The pids on host h whose command name starts with `name` (exact: is `name`)."""
        out = []
        for p in self.pids(h):
            try:
                with open(f"/proc/{p}/comm") as f:
                    comm = f.read().strip()
                if comm == name[:15] if exact else comm.startswith(name[:15]):
                    out.append(p)
            except OSError:
                pass
        return out

    def cut(self, h: int) -> None:
        _ip("link", "set", self.links[h], "down")

    def mend(self, h: int) -> None:
        """Host h's link up again, ready for the next job: its port forwarding and the failed
        neighbour entries of the outage forgotten on both sides (else "no route to host")."""
        _ip("link", "set", self.links[h], "up")
        self._wait_ready()
        _ip("-n", self.names[h], "neigh", "flush", "all", check=False)
        _ip("neigh", "flush", "dev", self.bridge, check=False)

    def _qdisc(self, h: int, spec: list[str] | None) -> None:
        """Replaces the root qdisc of host h's link, both directions (its eth0 and the bridge's
        end), with `spec` (tc words after "root"), or removes it (None)."""
        for inside in (True, False):
            base = ["tc", *(["-n", self.names[h]] if inside else []), "qdisc"]
            dev = "eth0" if inside else self.links[h]
            subprocess.run([*base, "del", "dev", dev, "root"], capture_output=True)
            if spec:
                subprocess.run([*base, "add", "dev", dev, "root", *spec], check=True,
                               capture_output=True, text=True)

    def slow(self, h: int, rate: str | None) -> None:
        """Host h's link limited to `rate` each way (tc tbf: "2mbit", "8kbit"), or unlimited."""
        self._qdisc(h, ["tbf", "rate", rate, "burst", "16kb", "latency", "100ms"] if rate else None)

    def netem(self, h: int, spec: str | None) -> None:
        """tc netem on host h's link ("delay 50ms", "loss 2%"), or none (None); needs the
        kernel's sch_netem (netem_available)."""
        self._qdisc(h, ["netem", *spec.split()] if spec else None)

    def netem_available(self) -> str | None:
        """None when tc netem works here, else why not (tried on host 0's link)."""
        if not shutil.which("tc"):
            return "tc is not installed"
        try:
            self.netem(0, "delay 1ms")
        except subprocess.CalledProcessError as e:
            return (f"tc netem fails here ({(e.stderr or '').strip()}): this kernel has no "
                    f"sch_netem, so delay and loss cannot be emulated")
        self.netem(0, None)
        return None

    def kill(self, h: int) -> None:
        for p in self.pids(h):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def tx_bytes(self, h: int) -> int:
        with open(f"/sys/class/net/{self.links[h]}/statistics/rx_bytes") as f:
            return int(f.read())  # what host h sent (the bridge's end receives it)

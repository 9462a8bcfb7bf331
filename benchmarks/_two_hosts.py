"""Two "machines" on one host: network namespaces joined by a veth pair, rate-limited with ``tc tbf``.

Loopback hides every cost of talking between nodes; a veth pair between two namespaces is a real TCP link
whose rate ``tbf`` caps in each direction. Each run makes its own namespaces and interfaces under names unique
to it (process id and random letters), so two runs never collide, and removes them on exit, after a failure,
Ctrl-C or SIGTERM (removing a namespace removes its veth end and ends the processes left in it). Traffic goes
only between the two addresses of the pair, inside the namespaces this module made.

Used by ``benchmarks/two_nodes.py`` and the tests across namespaces (``tests/test_two_namespaces.py``). Needs root
and iproute2; :func:`unavailable` says in one line why a host cannot do it.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from types import FrameType, TracebackType

ADDRESSES = ("10.213.0.1", "10.213.0.2")  # the two veth ends, inside the namespaces made here only
# Fixed for every rate, so rates compare: a 64 KiB bucket (>= one GSO burst at 1 Gbit/s) and 256 KiB of queue.
TBF_BURST, TBF_LIMIT = "64kb", "256kb"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


class TwoHosts:
    """Namespaces ``names[0]`` and ``names[1]``, veth ends ``interfaces[i]`` at ``ADDRESSES[i]``."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.names = (f"dl{tag}a", f"dl{tag}b")
        self.interfaces = self.names  # each namespace's veth end has its namespace's name (<= 15 characters)
        self.rate_mbit: float | None = None
        self._made = False
        self._previous: dict[int, object] = {}

    # ------------------------------------------------------------------ lifetime

    def __enter__(self) -> TwoHosts:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if threading.current_thread() is threading.main_thread():
                self._previous[sig] = signal.signal(sig, self._on_signal)
        self._made = True
        a, b = self.names
        steps = [("netns", "add", a), ("netns", "add", b),
                 ("link", "add", a, "type", "veth", "peer", "name", b),
                 ("link", "set", a, "netns", a), ("link", "set", b, "netns", b)]
        for ns, addr in zip(self.names, ADDRESSES):
            steps += [("-n", ns, "addr", "add", f"{addr}/30", "dev", ns), ("-n", ns, "link", "set", ns, "up"),
                      ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode:
                self.close()
                raise RuntimeError(f"ip {' '.join(step)} failed: {done.stderr.strip()}")
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        raise SystemExit(f"signal {signum}: namespaces {', '.join(self.names)} removed")

    def close(self) -> None:
        """End every process left in the namespaces and remove them (their veth ends go with them)."""
        if not self._made:
            return
        for ns in self.names:
            pids = _ip("netns", "pids", ns).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns)
        self._made = False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    # ------------------------------------------------------------------ the link

    def shape(self, rate_mbit: float | None) -> None:
        """Cap each direction at ``rate_mbit`` Mbit/s (tbf, fixed burst and queue); None: unshaped."""
        for ns in self.names:
            if rate_mbit is None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", ns, "root"], capture_output=True)
                continue
            cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", ns, "root", "tbf", "rate",
                   f"{rate_mbit}mbit", "burst", TBF_BURST, "limit", TBF_LIMIT]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
        self.rate_mbit = rate_mbit

    def set_link(self, up: bool) -> None:
        """Take the link down (both ends) or up again: what a failed cable or switch port does."""
        for ns in self.names:
            _ip("-n", ns, "link", "set", ns, "up" if up else "down")

    def command(self, node: int, argv: Sequence[str], env: dict[str, str] | None = None) -> list[str]:
        """``argv`` run inside node ``node``'s namespace, gloo bound to its veth end."""
        extra = {"GLOO_SOCKET_IFNAME": self.interfaces[node], **(env or {})}
        return ["ip", "netns", "exec", self.names[node], "env", *[f"{k}={v}" for k, v in extra.items()], *argv]

    def measure_mbit(self, seconds: float = 1.5, port: int = 5201) -> float:
        """A bulk TCP transfer from node 1 to node 0 for about ``seconds``: the rate the link really carries."""
        expected = (self.rate_mbit or 10_000) * 1e6 / 8 * seconds
        server = ("import socket,time\n"
                  f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('{ADDRESSES[0]}',{port}));s.listen(1)\n"
                  "c,_=s.accept();n=0;t=None\n"
                  "while True:\n b=c.recv(1<<20)\n if not b: break\n t=t or time.perf_counter();n+=len(b)\n"
                  "print(n*8/(time.perf_counter()-t)/1e6)\n")
        client = ("import socket,sys\n"
                  f"c=socket.create_connection(('{ADDRESSES[0]}',{port}));b=b'x'*(1<<16);n=0\n"
                  f"while n<{int(expected)}:\n c.sendall(b);n+=len(b)\n"
                  "c.close()\n")
        import sys

        srv = subprocess.Popen(self.command(0, [sys.executable, "-c", server]), stdout=subprocess.PIPE, text=True)
        for _ in range(50):  # the server listens within a moment; the client retries until it does
            done = subprocess.run(self.command(1, [sys.executable, "-c", client]), capture_output=True, text=True)
            if done.returncode == 0:
                break
            time.sleep(0.1)
        out, _ = srv.communicate(timeout=120)
        return float(out.strip())


def unavailable() -> str | None:
    """None when this host can make two namespaces with a veth and tbf; else why not, in one line."""
    if os.geteuid() != 0:
        return "two namespaces need root (ip netns add)"
    try:
        with TwoHosts() as hosts:
            hosts.shape(100)
    except (OSError, RuntimeError) as error:
        return f"no namespace with a veth and tbf here: {str(error).splitlines()[0]}"
    return None


def free_port_in(hosts: TwoHosts) -> int:
    """A port for the rendezvous: the namespaces are new, so any unprivileged port is free; vary it per run."""
    del hosts
    with socket.socket() as s:  # a port free on this host too, in case the caller runs one agent outside
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def elastic_torchrun(hosts: TwoHosts, node: int, per_node: int, port: int, max_restarts: int = 3,
                     rdzv_node: int = 0) -> list[str]:
    """The ``torchrun`` of node ``node`` as a user starts it on each machine for a run that restarts itself:
    ``--max-restarts`` with a c10d rendezvous hosted by node ``rdzv_node``'s agent, so a node's agent and workers
    can come and go and the agents meet again. ``--local-addr``: the namespaces share one host name, which resolves
    to neither veth end, so each agent names its own address (on real machines the host name serves);
    ``is_host``: node ``rdzv_node`` serves the rendezvous, which torchrun otherwise decides by that host name
    (``rdzv_node=1``: the node that does not hold rank 0)."""
    return ["torchrun", "--nnodes=2", f"--nproc-per-node={per_node}", f"--max-restarts={max_restarts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={ADDRESSES[rdzv_node]}:{port}",
            f"--rdzv-conf=is_host={int(node == rdzv_node)}", f"--local-addr={ADDRESSES[node]}"]

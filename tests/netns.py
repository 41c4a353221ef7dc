"""Two "hosts" on one machine: this test's own network namespace as host A and a new
namespace as host B, joined by a veth pair with their own /24.

Host A is the namespace the tests already run in, so they reach `noria serve` on loopback
as usual; only the worker link crosses the veth. Nothing leaves the machine: the /24 exists
only on the pair, and both ends are removed when the context exits.
"""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from noria.bench.hosts import ip_command
from noria.bench.hosts import unavailable as hosts_unavailable

_ip = ip_command


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    why = hosts_unavailable()
    if why is not None:
        return why
    probe = f"noria-probe-{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class TwoHosts:
    ns_b: str
    veth_a: str
    addr_a: str  # host A's address on the pair (bind the worker link here)
    addr_b: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def popen_on_b(self, cmd: list[str], **kw: object) -> subprocess.Popen[bytes]:
        """Start a process on host B (it sees only B's loopback and the veth)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns_b, *cmd], **kw)  # type: ignore[call-overload]
        self.procs.append(p)
        return p

    def cut(self) -> None:
        """A network partition: the link goes down with no packet to say so."""
        _ip("link", "set", self.veth_a, "down")

    def mend(self) -> None:
        _ip("link", "set", self.veth_a, "up")


@contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    net = random.randrange(1, 250)
    ns_b, veth_a, veth_b = f"noria-b-{tag}", f"nra{tag}", f"nrb{tag}"
    hosts = TwoHosts(ns_b, veth_a, f"10.77.{net}.1", f"10.77.{net}.2")
    _ip("netns", "add", ns_b)
    try:
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_b, "netns", ns_b)
        _ip("addr", "add", f"{hosts.addr_a}/24", "dev", veth_a)
        _ip("link", "set", veth_a, "up")
        _ip("netns", "exec", ns_b, "ip", "addr", "add", f"{hosts.addr_b}/24", "dev", veth_b)
        _ip("netns", "exec", ns_b, "ip", "link", "set", veth_b, "up")
        _ip("netns", "exec", ns_b, "ip", "link", "set", "lo", "up")
        yield hosts
    finally:
        for p in hosts.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        _ip("link", "del", veth_a, check=False)  # also removes the peer inside B
        _ip("netns", "del", ns_b, check=False)

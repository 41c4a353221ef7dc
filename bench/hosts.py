"""Engines on separate "hosts" of one machine, for the benchmarks that put a router in front of them.

Each host is a network namespace joined to this one by a veth pair on a /24 of its own
(10.79.x.1 here, 10.79.x.2 there): a server in it is reached over that link only, as an engine
on another machine is, while the router runs here. Nothing leaves the machine; the namespaces
and links go when the context exits. Making them needs root and `ip` (iproute2).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

from noria.frontend.local_server import stop_child

PORT = 8000  # every host is a fresh namespace: the same ports are free in each
ZMQ_PORT = 5555


def ip_command(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    return None


class NamespacedServer:
    """`noria serve FLAGS` inside a host's namespace, listening on its address there."""

    def __init__(self, ns: str, addr: str, flags: list[str]) -> None:
        self.http = f"http://{addr}:{PORT}"
        argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "noria.frontend.cli", "serve", "--host", "0.0.0.0",
                "--port", str(PORT), "--zmq-port", str(ZMQ_PORT), *flags]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)

    def wait(self, timeout: float = 300.0, http: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server at {self.http} exited with {self.proc.returncode}")
            with suppress(OSError), urllib.request.urlopen(f"{self.http}/health", timeout=5) as r:
                if r.status == 200:
                    return
            if time.monotonic() > deadline:
                raise SystemExit(f"the server at {self.http} did not come up in {timeout:g} s")
            time.sleep(0.2)  # poll interval while it starts

    def stop(self) -> None:
        stop_child(self.proc, signal.SIGINT, 60)  # Ctrl-C: it drains and stops its children


@dataclass
class Hosts:
    namespaces: list[str]
    addrs: list[str]  # each host's address, as this namespace reaches it
    servers: list[NamespacedServer] = field(default_factory=list)

    def serve(self, i: int, flags: list[str]) -> NamespacedServer:
        server = NamespacedServer(self.namespaces[i], self.addrs[i], flags)
        self.servers.append(server)
        return server


@contextmanager
def separate_hosts(n: int) -> Iterator[Hosts]:
    why = unavailable()
    if why is not None:
        raise SystemExit(f"cannot make separate hosts: {why}")
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    base = random.randrange(1, 250 - n)
    hosts = Hosts([f"noria-h{i}-{tag}" for i in range(n)], [f"10.79.{base + i}.2" for i in range(n)])
    links = [f"nrh{i}{tag}" for i in range(n)]
    try:
        for i, (ns, here) in enumerate(zip(hosts.namespaces, links, strict=True)):
            there = f"{here}b"
            ip_command("netns", "add", ns)
            ip_command("link", "add", here, "type", "veth", "peer", "name", there)
            ip_command("link", "set", there, "netns", ns)
            ip_command("addr", "add", f"10.79.{base + i}.1/24", "dev", here)
            ip_command("link", "set", here, "up")
            ip_command("netns", "exec", ns, "ip", "addr", "add", f"{hosts.addrs[i]}/24", "dev", there)
            ip_command("netns", "exec", ns, "ip", "link", "set", there, "up")
            ip_command("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield hosts
    finally:
        for server in hosts.servers:
            if server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait()
        for here in links:
            ip_command("link", "del", here, check=False)  # also removes the peer inside its namespace
        for ns in hosts.namespaces:
            ip_command("netns", "del", ns, check=False)

"""Resident memory of a server's processes, by role, read from /proc (Linux; no psutil).

`noria bench throughput` (noria-serve) and `noria bench serving` print each server's RSS per
process at idle after start-up and at the end of the run; `noria bench overload` and `soak`
follow it over time under the same names. Roles: "frontend" (the server's own process: `noria
serve`'s tokenizer, ZMQ API and engine watcher), "scheduler", "worker" (rank 0; "worker rank R"
for the others), "bridge"; any other process under the server by its name (`comm`), numbered
when repeated (a vLLM server's engine core, say).

RSS counts a page shared by two processes (libpython, libc, ...) in both, so the sum is a
little more than the memory the server takes; it is what `ps` and llama.cpp's reports show.
"""

from __future__ import annotations

import os
from pathlib import Path

MiB = 2**20


def rss_bytes(pid: int) -> int:
    """The resident set of `pid` in bytes (VmRSS); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0  # gone, or a zombie (no VmRSS line)


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone while we looked
    return out


def descendants(pid: int, depth: int | None = None) -> list[int]:
    """The processes under `pid` (children first, then theirs; `depth` 1: children only)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out, level, d = [], [pid], 0
    while level and (depth is None or d < depth):
        level = sorted(c for p in level for c in children.get(p, []))
        out += level
        d += 1
    return out


def role(pid: int) -> str | None:
    """What a process under a noria server is, from its command line (see the module docstring);
    None once it is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    if module == "noria.scheduler":
        return "scheduler"
    if module == "noria.worker":
        rank = argv[argv.index("--rank") + 1] if "--rank" in argv[:-1] else "0"
        return "worker" if rank == "0" else f"worker rank {rank}"
    if "bridge" in argv[1:] and (module == "noria.frontend.cli" or "noria" in Path(argv[0]).name):
        return "bridge"
    return comm or f"pid {pid}"


def server_processes(pid: int, depth: int | None = None, root: str = "frontend") -> dict[str, int]:
    """{role: pid} of the server `pid` (named `root`: noria's frontend, or another program such as
    llama-server) and the processes under it (`depth`: as `descendants`)."""
    out = {root: pid}
    for child in descendants(pid, depth):
        name = base = role(child)
        if base is None:
            continue  # gone while we looked
        n = 1
        while name in out:
            n += 1
            name = f"{base} #{n}"
        out[name] = child
    return out


def server_rss(pid: int, root: str = "frontend") -> dict[str, int]:
    """{role: RSS bytes} of the server `pid` (named `root`) and every process under it, read now."""
    return {name: rss_bytes(p) for name, p in server_processes(pid, root=root).items()}


def format_rss(rss: dict[str, int]) -> str:
    """One line: each process's RSS and the sum, in MiB."""
    parts = " + ".join(f"{name} {b / MiB:,.0f}" for name, b in rss.items())
    return f"{parts} = {sum(rss.values()) / MiB:,.0f} MiB"

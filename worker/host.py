"""What this host's CPU and memory offer: the facts `--dtype auto` (worker/device.py), the
scheduler's registration log (worker/registration.py) and `noria doctor` read.

No torch here: registration reads the memory before the worker imports torch.
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

# The CPU features the native kernels and the dtype choice care about, in the order doctor prints them.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "f16c", "avx512_fp16", "avx512_vnni", "avx_vnni")
# Either gives bf16 dot products in hardware (vdpbf16ps, AMX tiles); without them bf16 is widened in software.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")

_CGROUP = Path("/sys/fs/cgroup")


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first CPU in a /proc/cpuinfo text (x86 "flags", Arm "Features")."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags; empty where /proc/cpuinfo cannot be read (not Linux)."""
    try:
        return parse_cpu_flags(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return frozenset()


def f16_in_hardware(flags: frozenset[str]) -> tuple[str, ...]:
    """The flags among `flags` that widen float16 to float32 in hardware (vcvtph2ps)."""
    return tuple(f for f in ("f16c", "avx512f") if f in flags)


def native_bf16(flags: frozenset[str]) -> tuple[str, ...]:
    """The flags among `flags` that compute bf16 in hardware (none: bf16 is emulated)."""
    return tuple(f for f in NATIVE_BF16_FLAGS if f in flags)


@cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2) and unreadable files: no limit


def _cgroup_room(root: Path) -> int | None:
    """Bytes this process's cgroup may still take: its limit less what it holds, page cache that
    can be dropped (inactive_file) not counted as held. None where no limit is set."""
    for limit_file, usage_file in (("memory.max", "memory.current"),  # v2
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # v1
        limit, usage = _read_int(root / limit_file), _read_int(root / usage_file)
        # v1 says "no limit" with a huge number (the page-rounded max of a signed 64-bit int).
        if limit is None or usage is None or limit >= 1 << 60:
            continue
        stat = root / Path(limit_file).parent / "memory.stat"
        inactive = 0
        try:
            for line in stat.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file") and value.strip().isdigit():
                    inactive = int(value)
                    break
        except OSError:
            pass
        return max(0, limit - max(0, usage - inactive))
    return None


def memory_available(root: Path = _CGROUP) -> int:
    """Bytes a new allocation can take without swapping or being killed: the smaller of the
    kernel's MemAvailable and the room left under this container's cgroup limit (a container sees
    the host's /proc/meminfo, not its own limit). 0 where neither can be read."""
    found = [n for n in (_meminfo_available(), _cgroup_room(root)) if n is not None]
    return min(found) if found else 0


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

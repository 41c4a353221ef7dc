"""Keeps the generated tables in kernels/README.md (between marker comments) up to date."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from noria.kernels.nvrtc_check import KernelUsage

README = Path(__file__).resolve().parent / "README.md"


def resource_table(usage: Sequence[KernelUsage]) -> str:
    archs = sorted({u.arch for u in usage})
    rows: dict[str, dict[str, KernelUsage]] = {}
    for u in usage:
        rows.setdefault(u.name, {})[u.arch] = u
    head = (
        "| kernel instance | "
        + " | ".join(f"sm_{a} regs | sm_{a} smem (B) | sm_{a} spills (B)" for a in archs)
        + " |"
    )
    sep = "|---|" + "---:|---:|---:|" * len(archs)
    lines = [head, sep]
    for name in sorted(rows, key=_sort_key):
        cells = []
        for a in archs:
            u = rows[name].get(a)
            cells += (
                ["-", "-", "-"]
                if u is None
                else [str(u.registers), str(u.shared_bytes), str(u.spill_stores + u.spill_loads)]
            )
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _sort_key(name: str) -> tuple[str, str]:
    kernel, _, params = name.partition("<")
    return kernel, params


def replace_section(text: str, marker: str, body: str) -> str:
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in text or end not in text:
        raise ValueError(f"README has no {marker} markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def update_readme(marker: str, body: str, path: Path = README) -> bool:
    """Rewrite one generated section; returns whether the file changed."""
    old = path.read_text()
    new = replace_section(old, marker, body)
    if new != old:
        path.write_text(new)
    return new != old

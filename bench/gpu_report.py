"""`noria bench gpu`'s report: the rows beside their rooflines, rewritten to OUT.json and OUT.md
after every figure so that a run killed midway still leaves what it measured."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Row:
    phase: str
    name: str
    value: float | None  # None: not measurable here (the note says why)
    unit: str
    floor: float | None = None  # the roofline in the same unit (a ceiling for rates)
    note: str = ""

    @property
    def of_roofline(self) -> float | None:
        """How close to the roofline: floor / measured for times, measured / ceiling for rates."""
        if not self.floor or not self.value:
            return None
        return self.value / self.floor if self.unit.endswith("/s") else self.floor / self.value


class Report:
    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        self.json_path, self.md_path = out.with_suffix(".json"), out.with_suffix(".md")
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.meta = meta
        self.rows: list[Row] = []
        self.phases: dict[str, dict[str, Any]] = {}
        self.flush()

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        pct = f" ({row.of_roofline:.0%} of roofline)" if row.of_roofline is not None else ""
        print(f"  {row.name}: {_value(row)}{pct}{'; ' + row.note if row.note else ''}", flush=True)
        self.flush()
        return row

    def phase(self, name: str, status: str, seconds: float, note: str = "") -> None:
        self.phases[name] = {"status": status, "seconds": round(seconds, 2), "note": note}
        self.flush()

    def data(self) -> dict[str, Any]:
        return {"meta": self.meta, "phases": self.phases,
                "rows": [asdict(r) | {"of_roofline": r.of_roofline} for r in self.rows]}

    def flush(self) -> None:
        for path, text in ((self.json_path, json.dumps(self.data(), indent=2)), (self.md_path, self.markdown())):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text + "\n")
            os.replace(tmp, path)  # a reader (or a kill) never sees half a file

    def markdown(self) -> str:
        m = self.meta
        lines = [f"# noria bench gpu: {m.get('device', '?')}", "",
                 f"Model: {m.get('model', '?')}; {m.get('dtype', '?')}. Device copy "
                 f"{_fmt(m.get('copy_gbps'))} GB/s (read + write), matmul {_fmt(m.get('matmul_tflops'))} TFLOP/s. "
                 f"Graphs: {m.get('graphs', '?')}.", "",
                 "| phase | measurement | value | roofline | % of roofline | note |",
                 "|---|---|---:|---:|---:|---|"]
        for r in self.rows:
            pct = f"{r.of_roofline:.0%}" if r.of_roofline is not None else ""
            floor = f"{_fmt(r.floor)} {r.unit}" if r.floor else ""
            lines.append(f"| {r.phase} | {r.name} | {_value(r)} | {floor} | {pct} | {r.note} |")
        lines += ["", "| phase | status | s | note |", "|---|---|---:|---|"]
        lines += [f"| {k} | {v['status']} | {v['seconds']} | {v['note']} |" for k, v in self.phases.items()]
        return "\n".join(lines)


def _value(r: Row) -> str:
    return "n/a" if r.value is None else f"{_fmt(r.value)} {r.unit}".strip()


def _fmt(x: Any) -> str:
    if not isinstance(x, int | float):
        return "?" if x is None else str(x)
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def speedups(rows: Sequence[Row]) -> list[Row]:
    """noria's ITL against transformers' best at each batch both measured."""
    def by_batch(phase: str) -> dict[int, float]:
        best: dict[int, float] = {}
        for r in rows:
            if r.phase == phase and r.value and r.name.startswith("ITL batch "):
                b = int(r.name.split()[2])
                best[b] = min(best.get(b, r.value), r.value)
        return best

    ours, theirs = by_batch("itl"), by_batch("hf")
    return [Row("vs hf", f"ITL batch {b}: transformers / noria", theirs[b] / ours[b], "x", None,
                "above 1: noria is faster") for b in sorted(ours.keys() & theirs.keys())]

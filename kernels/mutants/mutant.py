"""One catalogue entry of the mutation check, and where the oracle tests it names live."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests" / "kernels"


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str
    source: str
    old: str
    new: str
    tests: tuple[str, ...]
    # One float32 configuration: the tightest tolerance, and one module to compile per mutant.
    keyword: str = "float32-d128-b16"

"""matplotlib for the benchmarks' PNGs, which are optional: the tables are the results."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend, or None (saying so) without the `bench` extra."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'noria[bench]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_rows(out: str, name: str, args: Any, rows: list[dict], plot: Callable[[list[dict], Path], None]) -> None:
    """A benchmark's rows as OUT/NAME.json (with its arguments) and its plot as OUT/NAME.png."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    plot(rows, folder / f"{name}.png")
    print(f"\nwrote {folder / f'{name}.json'}")

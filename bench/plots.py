"""matplotlib for the benchmarks' PNGs, which are optional: the tables are the results."""

from __future__ import annotations

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

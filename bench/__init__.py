"""Benchmarks: `noria bench NAME [args]` runs `bench/NAME.py`'s main(argv)."""

import os

# Every system in one job runs with the same OpenMP setting; passive waiting
# keeps one system's idle threads from stealing cores from the next process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

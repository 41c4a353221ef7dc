"""Benchmarks: `noria bench NAME [args]` runs `bench/NAME.py`'s main(argv)."""

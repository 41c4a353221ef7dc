"""Benchmarks: `noria bench NAME [args]` runs `noria.bench.NAME.main(argv)`."""

# The modules that are benchmarks; the others (workloads, ceiling, plots) are their helpers.
BENCHMARKS = ("generate", "scheduler", "serving", "throughput")

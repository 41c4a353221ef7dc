"""Every `noria bench NAME` runs from the installed console script, in any directory.

The benchmarks ship in the package (noria.bench); they must not need this
repository's tests/ folder or its working directory. Each runs here at its
smallest sizes from a temporary directory outside the repository.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from noria.bench import BENCHMARKS

ROOT = Path(__file__).resolve().parents[1]
NORIA = Path(sys.executable).parent / "noria"  # the venv's console script
PRODUCT = ("noria", "protocol", "frontend", "scheduler", "worker", "kernels", "bench")

# The smallest run of each benchmark, and a line of the table it prints.
TINY = {
    "generate": (["--num-requests", "2", "--num-kv-blocks", "64"], "output tok/s"),
    "scheduler": (["--sizes", "4", "--steps", "3"], "plan ms"),
    "serving": (["--experiments", "rates", "--rates", "50", "--num-requests", "2", "--dtype", "bfloat16",
                 "--out", "out/serving"],
                "TTFT p50/p90/p99 ms"),
    "throughput": (["--model", "serving", "--systems", "noria-serve", "--rounds", "1", "--num-requests", "2",
                    "--max-tokens", "4", "--num-kv-blocks", "64", "--out", "out/throughput"], "runs (s)"),
    "fuzz": (["--inputs", "20", "--check-every", "10"], '"violations": 0'),
    "disconnects": (["--clients", "6", "--keepers", "1"], "every orphan aborted"),
    "overload": (["--seconds", "8", "--factor", "4", "--max-num-seqs", "4", "--max-queued-requests", "4"],
                 "RSS within bound: True"),
    "failover": (["--num-requests", "4", "--max-tokens", "8", "--kills", "1", "--out", "out/failover"],
                 "SIGKILL->next token s"),
    "kernels": (["--decode", "1x64,2x128"], "GB/s"),
    # Ten seconds of paced traffic is all warm-up for the worker's allocator, so the RSS bound
    # is lifted (it is for the long run); nothing lost, duplicated or mismatched still decides.
    "soak": (["--minutes", "0.15", "--warmup-seconds", "5", "--burst", "64", "--sample-interval", "1", "--rss-tolerance", "10",
              "--out", "out/soak"], "every stream equal to its final text: True; ok: True"),
    # Probe and checkpoint only: the engine phases are tests/test_bench_gpu.py's.
    "gpu": (["--tiny", "--phases", "probe,checkpoint", "--out", "out/gpu"], "% of roofline"),
    "routing": (["--configs", "dp2,ca2", "--conversations", "2", "--turns", "2", "--system-prompts", "1",
                 "--system-words", "40", "--max-tokens", "2", "--num-kv-blocks", "128", "--out", "out/routing"],
                "prefix hit rate"),
    "pd": (["--streams", "1", "--decode-tokens", "4", "--long", "1", "--long-words", "40", "--long-tokens", "2",
            "--interval", "0.1", "--num-kv-blocks", "128", "--max-model-len", "1024", "--out", "out/pd"],
           "stream ITL p50/p90/p99/max ms"),
    "spec": (["--model", "serving", "--configs", "off,suffix-2,head2-2,eagle3-2", "--inert-after", "2", "--rounds", "1", "--tokens", "4", "--b1-prompts", "1",
              "--num-requests", "32", "--max-tokens", "4", "--num-kv-blocks", "256", "--out", "out/spec"],
             "ITL b1 ms"),
    "structured": (["--model", "demo", "--num-requests", "2", "--rounds", "1", "--sizes", "2", "--repeats", "2",
                    "--num-kv-blocks", "64"], "constrained / unconstrained tok/s"),
}


def _env() -> dict[str, str]:
    # Nothing but the installed package: no PYTHONPATH pointing into the repository.
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_every_benchmark_has_a_tiny_run():
    assert set(TINY) == set(BENCHMARKS)


def test_the_product_never_imports_tests():
    bad = []
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                bad += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "tests"]
    assert not bad


@pytest.mark.parametrize("name", BENCHMARKS)
def test_help_from_anywhere(name, tmp_path):
    out = subprocess.run([str(NORIA), "bench", name, "--help"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"noria bench {name}" in out.stdout


def test_an_unknown_benchmark_is_named(tmp_path):
    out = subprocess.run([str(NORIA), "bench", "workloads"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "generate" in out.stderr


@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_tiny_run_from_anywhere(name, tmp_path):
    args, table = TINY[name]
    out = subprocess.run([str(NORIA), "bench", name, *args], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert table in out.stdout, out.stdout[-3000:]

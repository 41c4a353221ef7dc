"""`noria bench routing --across-namespaces`: each server on a "host" of its own (bench/hosts.py),
the router reaching them over veths; the namespaces and links are gone afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from noria.bench import hosts
from tests.test_bench_cli import _env

pytestmark = pytest.mark.skipif(hosts.unavailable() is not None, reason=f"no network namespaces: {hosts.unavailable()}")
NORIA = Path(sys.executable).parent / "noria"


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("noria-h")}


def test_routing_across_namespaces(tmp_path):
    before = _namespaces()
    out = subprocess.run([str(NORIA), "bench", "routing", "--configs", "rr2", "--across-namespaces", "--conversations",
                          "2", "--turns", "2", "--system-prompts", "1", "--system-words", "40", "--max-tokens", "2",
                          "--num-kv-blocks", "128", "--out", "out"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    row = json.loads((tmp_path / "out" / "routing.json").read_text())["rows"][0]
    assert row["config"] == "rr2@hosts" and row["requests"] == 4 and row["req_s"] > 0
    assert _namespaces() == before  # the hosts are gone with the run

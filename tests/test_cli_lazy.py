"""The `noria` console script loads a subcommand's code only when that subcommand runs:
building the parser and answering `--help` import no benchmark, no torch, no engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Roots that cost seconds to import (or pull in a whole subsystem).
HEAVY = ("torch", "transformers", "tokenizers", "numpy", "aiohttp", "zmq", "llguidance", "jinja2", "cupy")
# noria's folders whose code runs only inside a subcommand; worker/cli.py only declares arguments.
ENGINE = ("noria.bench", "noria.kernels", "noria.scheduler", "noria.worker.")
DECLARING = {"noria.worker.cli"}

LOADED = """
import json, sys
import noria.cli
try:
    noria.cli.main(sys.argv[1:])
except SystemExit as e:
    code = e.code
else:
    code = None
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _loaded(argv: list[str]) -> tuple[object, list[str]]:
    out = subprocess.run([sys.executable, "-c", LOADED, *argv], capture_output=True, text=True, cwd="/",
                         timeout=120, check=True)
    report = json.loads(out.stdout.splitlines()[-1])
    return report["code"], report["modules"]


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"], ["worker", "--help"],
                                  ["bench", "--help"], ["doctor", "--help"], ["keygen", "--help"]])
def test_help_loads_no_subcommand_code(argv: list[str]) -> None:
    code, modules = _loaded(argv)
    assert code == 0
    heavy = [m for m in modules if m.split(".")[0] in HEAVY]
    engine = [m for m in modules if m.startswith(ENGINE) and m not in DECLARING]
    assert not heavy and not engine, f"`noria {' '.join(argv)}` imported {heavy + engine}"
    assert "noria.cli" in modules and "noria.frontend.cli" in modules  # the probe ran where it should


def test_a_subcommand_loads_its_code_when_it_runs() -> None:
    # The other side of the laziness: an unknown benchmark is refused by the parser (exit 2)
    # before bench loads, and a known one is imported and run (its own --help, exit 0).
    code, modules = _loaded(["bench", "workloads"])
    assert code == 2 and not any(m.startswith("noria.bench") for m in modules)
    code, modules = _loaded(["bench", "scheduler", "--help"])
    assert code == 0 and "noria.bench.scheduler" in modules

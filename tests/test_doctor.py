"""`noria doctor` on a host without a GPU: it says so, runs the CPU/emulator subset and exits 0
when that passes; a failed check makes it exit 1 and name the check.

The GPU half (compile for the local arch, contracts on the device, GPU vs CPU generation,
bandwidth) needs a device: it ran on an H100 (bench/RESULTS.md, "GPU readiness").
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from noria.worker import doctor, doctor_checks

NORIA = Path(sys.executable).parent / "noria"  # the venv's console script

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path of noria doctor")


def test_doctor_on_a_cpu_host_runs_the_cpu_subset(tmp_path: Path, demo_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(NORIA), "doctor", "--max-tokens", "4"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("no GPU: ") for line in lines), out.stdout
    for check in ("kernel contracts under the CPU emulator", "greedy generation, emulated kernels vs torch backend",
                  "swap preemption on emulated kernels (copy_blocks) vs torch backend"):
        assert any(line.startswith(f"  ok    {check}") for line in lines), (check, out.stdout)
    assert "swap-outs and as many swap-ins" in out.stdout  # the swap check saw swaps
    # The CPU kernels a worker here would run, and what --dtype auto makes of a bf16 checkpoint.
    assert any(re.match(r"  ok    native CPU kernels: gemm=\S+.* fused=\S+.* attention=\S+.* stack=\S+", line)
               for line in lines), out.stdout
    for info in ("CPU: ", "bf16 GEMM: ", "--dtype auto, bfloat16 checkpoint: "):
        assert any(line.startswith(f"  info  {info}") for line in lines), (info, out.stdout)
    # The engine under test says what its attention ran on: the emulated kernels.
    emulated = next(line for line in lines if "greedy generation, emulated kernels" in line)
    assert "attention backend kernels" in emulated, emulated
    assert lines[-1].startswith("noria doctor: all ") and lines[-1].endswith(" checks passed")


def test_a_failed_check_exits_1_and_is_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def cpu_checks(report: doctor.Report, max_tokens: int) -> None:
        report.check("fine", lambda: "yes")
        report.check("kernel contracts under the CPU emulator", lambda: doctor_checks._require(False, "2 of 12 failed"))

    monkeypatch.setattr(doctor_checks, "cpu_checks", cpu_checks)
    assert doctor.cmd_doctor(argparse.Namespace(quick=False, max_tokens=4)) == 1
    out = capsys.readouterr().out
    assert "  FAIL  kernel contracts under the CPU emulator: RuntimeError: 2 of 12 failed" in out
    assert out.splitlines()[-1] == "noria doctor: 1 check(s) FAILED: kernel contracts under the CPU emulator"


def test_generation_comparison_allows_only_near_ties(monkeypatch: pytest.MonkeyPatch) -> None:
    from noria.protocol.client import Logprob, SchedulerStats

    def lp(token: int, margin: float) -> Logprob:
        return Logprob(token_id=token, logprob=-0.5, top_token_ids=[token, 9], top_logprobs=[-0.5, -0.5 - margin])

    ref = [([1, 2, 3], [lp(1, 0.5), lp(2, 1e-5), lp(3, 0.5)])]
    runs = {"ref": (ref, SchedulerStats()),
            "tie": ([([1, 9, 4], [lp(1, 0.5), lp(9, 1e-5), lp(4, 0.5)])], SchedulerStats()),
            "wrong": ([([1, 2, 4], [lp(1, 0.5), lp(2, 1e-5), lp(4, 0.5)])], SchedulerStats())}
    monkeypatch.setattr(doctor_checks, "_generate", lambda flags, max_tokens: runs[flags["run"]])
    assert "1 near tie" in doctor_checks.compare_generation({"run": "tie"}, {"run": "ref"}, 3)
    with pytest.raises(AssertionError, match="token 2: 4 vs reference 3"):
        doctor_checks.compare_generation({"run": "wrong"}, {"run": "ref"}, 3)

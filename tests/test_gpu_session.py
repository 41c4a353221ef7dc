"""bin/gpu-session rehearsed on the CPU: a real `--dry-run` (the script, its phases' children, the
report on disk) with one phase forced to fail and one forced to hang past its budget, each
recorded while the next phase still runs; the readers of pytest's and the doctor's output; the
issue's targets; the wheels the GPU machine's image lacks; and noria importable there from the
tree alone.

The phases' own CPU runs are tested where they live (tests/test_doctor.py, tests/test_bench_gpu.py);
the whole dry run, doctor included, takes about a minute on two cores (bin/gpu-session --dry-run)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from noria.bench import gpu_quant, gpu_session, gpu_session_phases, gpu_wheels
from noria.bench.gpu_session_phases import gpu_targets, kernel_targets, parse_doctor, parse_pytest

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["install", "env", "doctor", "tests", "kernels", "bench_gpu"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie is dead, waiting for init to reap it


def test_dry_run_reports_every_phase_and_a_failed_or_cut_phase_does_not_stop_the_next(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, GPU_SESSION_PYTHON=sys.executable)
    proc = subprocess.run([str(ROOT / "bin" / "gpu-session"), "--dry-run", "--out", str(out), "--work", str(tmp_path / "w"),
                           "--inject", "doctor=fail",
                           "--inject", "tests=hang", "--budget", "tests=3"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu-session.json").read_text())
    phases = data["phases"]
    assert list(phases) == PHASES
    assert {k: v["status"] for k, v in phases.items()} == {
        "install": "skipped", "env": "ok", "doctor": "failed", "tests": "cut short", "kernels": "ok", "bench_gpu": "ok"}
    assert data["meta"]["mode"].startswith("dry run") and data["meta"]["elapsed_s"] > 0
    # The forced failure: its exit status and output are on record.
    assert phases["doctor"]["note"] == "exit 1" and "injected failure" in phases["doctor"]["tail"]
    # The forced hang: stopped at its budget with the grandchild it started in a session of its own.
    assert phases["tests"]["note"].startswith("over its 3 s budget") and phases["tests"]["budget_s"] == 3
    grandchild = int(re.search(r"grandchild (\d+)", phases["tests"]["tail"])[1])
    assert not _alive(grandchild)
    # The phases after them ran and read their children's results.
    env_summary = phases["env"]["summary"]
    assert env_summary["copy_gbps"] > 0 and env_summary["import_failures"] == {}
    rows = phases["kernels"]["summary"]["rows"]
    assert {(r["kind"], r["backend"]) for r in rows} >= {("decode", "noria"), ("decode", "sdpa-flash"),
                                                          ("prefill", "noria"), ("mixed", "noria")}
    assert all(r["us"] > 0 for r in rows if r["backend"] == "noria")
    assert all(t["met"] is None for t in phases["kernels"]["summary"]["targets"])  # a rehearsal judges nothing
    bench = phases["bench_gpu"]["summary"]
    assert bench["rows"] and {v["status"] for v in bench["phases"].values()} == {"ok"}
    # The quantized kinds' rows at the tiny sizes: each kind's decode beside its roofline, and the
    # FP8 target read from them (shown, not judged, in a rehearsal).
    names = {r["name"]: r for r in bench["rows"]}
    for label in (gpu_quant.FP8, gpu_quant.W4A16):
        assert names[gpu_quant.decode_name(1, label)]["of_roofline"] > 0
        assert names[gpu_quant.ratio_name(1, label, "float32")]["value"] > 0
    fp8_target = next(t for t in bench["targets"] if t["target"].startswith("FP8 decode throughput >= 1.6x bf16 at "
                                                                            "batch 1"))
    assert fp8_target["value"] > 0 and fp8_target["met"] is None
    assert (out / "bench-gpu.json").exists()
    md = (out / "gpu-session.md").read_text()
    for name, status in (("install", "skipped"), ("env", "ok"), ("doctor", "failed"), ("tests", "cut short"),
                         ("kernels", "ok"), ("bench_gpu", "ok")):
        assert f"| {name} | {status} |" in md, md
    assert "## doctor: the end of its output" in md and "## kernels" in md and "## bench_gpu" in md
    log = (out / "gpu-session.log").read_text()
    assert "==== doctor:" in log and "over its time budget, stopped" in log
    assert len(list(out.iterdir())) <= 8  # the device tool brings back 8 files at most


PLAIN = """\
tests/test_gpu_graphs.py::test_graphs_match_eager[greedy] PASSED         [ 25%]
tests/kernels/test_gpu_kernels.py::test_decode[AttentionConfig(dtype='float32', head_dim=32, block_size=8)-False] FAILED [ 50%]
tests/kernels/test_gpu_kernels.py::test_prefill[AttentionConfig(dtype='bfloat16', head_dim=128, block_size=16)] PASSED [ 75%]
tests/test_gpu_graphs.py::test_kernel_graphs_match_eager SKIPPED (no cupy) [100%]
=========================== short test summary info ============================
FAILED tests/kernels/test_gpu_kernels.py::test_decode[AttentionConfig(dtype='float32', head_dim=32, block_size=8)-False] - AssertionError: max |err| 0.5
============== 1 failed, 2 passed, 1 skipped in 12.34s ==============
"""
XDIST = """\
[gw0] [ 50%] PASSED tests/test_gpu_graphs.py::test_graphs_match_eager[seeded]
[gw1] [100%] ERROR tests/kernels/test_gpu_kernels.py::test_mixed_step[AttentionConfig(dtype='float16', head_dim=64, block_size=16)]
"""


def test_pytest_output_is_read_plain_and_from_xdist_workers_and_when_cut_short() -> None:
    got = parse_pytest(PLAIN)
    assert got["counts"] == {"failed": 1, "passed": 2, "skipped": 1}
    [failed] = got["failed"]
    assert failed["test"].endswith("block_size=8)-False]") and failed["why"] == "AssertionError: max |err| 0.5"
    assert len(got["passed"]) == 2 and got["tests_seen"] == 4
    cut = parse_pytest(XDIST)  # no closing line: counted from what was seen
    assert cut["counts"] == {"passed": 1, "error": 1}
    assert cut["failed"][0]["status"] == "ERROR" and "test_mixed_step" in cut["failed"][0]["test"]


def test_doctor_output_is_read() -> None:
    text = ("noria doctor: torch 2.11.0+cu130, Python 3.12.3\n  info  device: NVIDIA H200, sm_90\n"
            "2026-11-29 09:00:00,000 noria.worker INFO attention: kernels for all 2 layers\n"
            "  ok    compile every instance for sm_90: 412 kernels, no spills (31 s)\n"
            "  FAIL  decode bandwidth: AssertionError: 40% of peak\n"
            "noria doctor: 1 check(s) FAILED: decode bandwidth\n")
    got = parse_doctor(text)
    assert got["checks"] == [{"name": "compile every instance for sm_90", "ok": True, "detail": "412 kernels, no spills (31 s)"},
                             {"name": "decode bandwidth", "ok": False, "detail": "AssertionError: 40% of peak"}]
    assert got["verdict"] == "noria doctor: 1 check(s) FAILED: decode bandwidth"


def test_the_issue_targets_are_judged_from_the_rows() -> None:
    rows = [{"kind": "decode", "backend": "noria", "seqs": 32, "context": 2048, "of_copy": 0.9},
            {"kind": "decode", "backend": "noria", "seqs": 64, "context": 4096, "of_copy": 0.8},
            {"kind": "decode", "backend": "noria", "seqs": 4, "context": 32768, "of_copy": 0.8},
            {"kind": "prefill", "backend": "noria", "seqs": 1, "prompt": 8192, "tflops": 300.0},
            {"kind": "prefill", "backend": "sdpa-flash", "seqs": 1, "length": 8192, "tflops": 400.0},
            {"kind": "prefill", "backend": "sdpa-cudnn", "seqs": 1, "length": 8192, "tflops": 600.0},
            {"kind": "mixed", "backend": "noria", "mixed_over_parts": 0.95}]
    got = {t["target"]: t for t in kernel_targets(rows)}
    assert [t["met"] for t in got.values()] == [True, False, True, False, None, True]
    assert got["prefill 1 x 8192: >= 0.8x SDPA flash"]["value"] == pytest.approx(0.75)
    assert got["prefill 1 x 8192: >= 0.8x SDPA flash"]["note"] == "cuDNN: 0.50x"
    engine = [{"name": "ITL batch 1 (CUDA graphs)", "value": 10.0, "of_roofline": 0.8},
              {"name": "offline 256 x 1024/256", "value": 5000.0},
              {"name": "ITL batch 16 (transformers, static cache, eager)", "value": 20.0},
              {"name": gpu_quant.ratio_name(1, gpu_quant.FP8, "bfloat16"), "value": 1.7},
              {"name": gpu_quant.ratio_name(1, gpu_quant.W4A16, "bfloat16"), "value": 1.2}]
    one, thr, fp8_one, fp8_32 = gpu_targets(engine)
    assert one["met"] and one["value"] == pytest.approx(1.25)
    assert thr["value"] == pytest.approx(5000 / 800) and thr["met"]
    assert fp8_one["met"] and fp8_one["value"] == 1.7  # the fp8 row, not the w4a16 one
    assert fp8_32["met"] is None and fp8_32["value"] is None  # not measured: not judged


def test_the_wheels_carried_are_what_the_image_lacks() -> None:
    reqs = gpu_wheels.runtime_requirements()
    carried = {gpu_wheels.requirement_name(r) for r in gpu_wheels.missing_on_image(reqs)}
    assert {"pyzmq", "msgspec", "llguidance"} <= carried
    assert not carried & gpu_wheels.IMAGE_PACKAGES
    assert {"torch", "transformers", "cupy-cuda13x", "nvidia-cuda-nvrtc", "pytest", "hypothesis"} <= gpu_wheels.IMAGE_PACKAGES
    assert gpu_wheels.IMAGE_VERSIONS["torch"] == "2.11.0"
    # Pinned to what ran here where it is installed here.
    assert gpu_wheels.pinned("msgspec>=0.19") == f"msgspec=={metadata.version('msgspec')}"


def _import_time_modules(path: Path) -> set[str]:
    """Top-level modules a file imports when it is imported (not inside functions, which load
    their optional packages when used), except those under `try: ... except ImportError`."""
    def walk(body: list[ast.stmt]) -> set[str]:
        names = set()
        for node in body:
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.Try) and not any(
                    isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers):
                names |= walk(node.body) | walk(node.orelse) | walk(node.finalbody)
            elif isinstance(node, ast.If | ast.With | ast.ClassDef):
                names |= walk(node.body) | walk(getattr(node, "orelse", []))
        return names

    return walk(ast.parse(path.read_text()).body) - set(sys.stdlib_module_names) - {"noria", "tests", "__future__"}


def test_what_the_gpu_session_imports_is_on_the_image_or_carried() -> None:
    """What importing noria's modules, the session's and the GPU tests loads (the env phase imports
    every one of them on the machine) is in the image's package list or among the carried wheels."""
    files = [p for folder in ("noria", "protocol", "frontend", "scheduler", "worker", "kernels") for p in (ROOT / folder).rglob("*.py")]
    files += [p for p in (ROOT / "bench").glob("*.py") if p.name.startswith(("gpu", "kernel"))]
    files += [ROOT / t.split("::")[0] for group, _ in gpu_session_phases.GPU_TESTS for t in group]
    files += [ROOT / "tests" / n for n in ("conftest.py", "kernels/conftest.py", "test_worker_cuda_graphs.py", "tiny_models.py")]
    dists = metadata.packages_distributions()
    carried = {gpu_wheels.requirement_name(r) for r in gpu_wheels.missing_on_image(gpu_wheels.runtime_requirements())}
    where: dict[str, set[str]] = {}
    for path in files:
        for module in _import_time_modules(path):
            where.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    local = {p.stem for d in ("tests", "tests/kernels") for p in (ROOT / d).glob("*.py")}  # imported by name there
    missing = {m: sorted(f)[:3] for m, f in where.items() if m not in local and not
               {gpu_wheels.canonical(d) for d in dists.get(m, [m])} & (gpu_wheels.IMAGE_PACKAGES | carried)}
    assert not missing, f"imported on the GPU machine, but neither in its image nor carried: {missing}"


def test_noria_imports_from_the_tree_without_an_install(tmp_path: Path) -> None:
    """The install's fallback on an image that cannot build an editable: with no site-packages
    (-S: no editable install to lean on) and the tree as the working folder (its noria/ folder
    first on sys.path), noria's namespace still resolves to the tree's folders."""
    finder = gpu_session.tree_finder(tmp_path / "finder")
    code = "import noria.protocol.switches as s; print(s.__file__)"  # stdlib only: no site-packages here
    env = dict(os.environ, PYTHONPATH=str(finder))
    without = subprocess.run([sys.executable, "-S", "-c", code], env=dict(env, PYTHONPATH=""), cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert without.returncode != 0 and "No module named 'noria.protocol'" in without.stderr
    with_it = subprocess.run([sys.executable, "-S", "-c", "import sitecustomize; " + code], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=True)
    assert with_it.stdout.strip() == str(ROOT / "protocol" / "switches.py")


def test_pack_wheels_takes_only_an_ignored_folder_in_the_tree(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert gpu_wheels.pack(tmp_path / "wheels") == 2  # outside the repository: the device tool would not carry it
    assert "outside the repository" in capsys.readouterr().out
    assert subprocess.run(["git", "check-ignore", "-q", gpu_wheels.DEFAULT_DIR], cwd=ROOT).returncode == 0

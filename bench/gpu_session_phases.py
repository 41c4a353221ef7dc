"""bin/gpu-session's phases after the install: what each runs (on the GPU machine, and in the CPU
rehearsal `--dry-run`), how its output is read, and the issue's targets each figure is held to.

A phase is a function of the runner's context (bench/gpu_session_run.py): it runs its children
through `ctx.call`, which kills them at the phase's deadline, and returns a summary for the
report, or raises PhaseError with the reason (and what it found before it failed).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The GPU tests, most telling first, in groups: graphs vs eager; every kernel instance's contract
# on the device (many small tests: in parallel where pytest-xdist is there); then engine tests that
# take the GPU path on a GPU host (the worker's default device is the GPU, and both runs of each
# use the kernels there), one at a time: an engine sized by --gpu-memory-utilization takes 90% of
# the device and must not meet another.
GPU_TESTS = ((("tests/test_gpu_graphs.py",), False),
             (("tests/kernels/test_gpu_kernels.py", "tests/kernels/test_gpu_gemm_w4a16.py",
               "tests/kernels/test_gpu_attention_fp8.py"), True),
             (("tests/test_worker_parity.py", "tests/test_engine_scheduling.py"), False))
# On the CPU the GPU modules skip (test_gpu_kernels.py is not even collected there: named on the
# command line it would run and fail), so the rehearsal adds two quick tests that pass.
DRY_TESTS = ((("tests/test_gpu_graphs.py", "tests/test_bench_gpu.py::test_decode_and_prefill_floors_by_hand",
               "tests/test_bench_gpu.py::test_throughput_ceiling_by_hand"), False),)
XDIST_WORKERS = "8"

# The shapes: bf16, head 128, 32 query / 8 KV heads.
KERNEL_SHAPES = ["--dtype", "bfloat16", "--head-size", "128", "--heads", "32", "--kv-heads", "8",
                 "--decode", "1x1024,32x2048,64x4096,256x512,4x32768", "--prefill", "1x2048,1x8192,4x2048",
                 "--mixed", "2048+255x2048"]
DRY_KERNEL_SHAPES = ["--dtype", "bfloat16", "--head-size", "128", "--heads", "8", "--kv-heads", "2",
                     "--decode", "2x64", "--prefill", "1x32", "--mixed", "32+3x48", "--emulated"]
SHM_FREE_FOR_CHECKPOINT = 40e9  # bytes free in /dev/shm before bench gpu's 16 GB checkpoint goes there


class PhaseError(Exception):
    def __init__(self, note: str, summary: dict[str, Any] | None = None) -> None:
        super().__init__(note)
        self.summary = summary or {}


@dataclass(frozen=True)
class Phase:
    name: str
    title: str
    cap: float  # seconds at most, on the GPU machine
    dry_cap: float  # in the CPU rehearsal
    need: float  # skipped when less than this is left
    run: Callable[[Any], dict[str, Any]]


def _judged(ctx: Any, targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rehearsal's figures are not measurements: its targets are shown, not judged."""
    return [t | {"met": None, "note": "dry run: not judged"} for t in targets] if ctx.dry_run else targets


def _require(ok: bool, note: str, summary: dict[str, Any]) -> dict[str, Any]:
    if not ok:
        raise PhaseError(note, summary)
    return summary


# ---- env ------------------------------------------------------------------------------------------

def env_phase(ctx: Any) -> dict[str, Any]:
    path = ctx.work / "env.json"
    call = ctx.call([ctx.python, "-m", "noria.bench.gpu_session_env", "--json", str(path),
                     *(["--tiny"] if ctx.dry_run else [])])
    facts = json.loads(path.read_text()) if path.exists() else {}
    ctx.report.meta["env"] = facts
    gpu, probes = facts.get("gpu", {}), facts.get("probes", {})
    summary = {"gpu": gpu.get("gpu", "none (torch sees no CUDA device)"), "torch": facts.get("torch"),
               "cuda": gpu.get("torch_cuda"), "cudnn": gpu.get("cudnn"), "cupy": gpu.get("cupy"),
               "nvidia_smi": gpu.get("nvidia_smi"), "copy_gbps": probes.get("copy_gbps"),
               "bf16_matmul_tflops": probes.get("bf16_matmul_tflops"),
               "import_failures": facts.get("imports", {}).get("failed", {})}
    ctx.report.meta["copy_gbps"], ctx.report.meta["matmul_tflops"] = summary["copy_gbps"], summary["bf16_matmul_tflops"]
    if not ctx.dry_run and not gpu.get("cuda_available"):
        raise PhaseError(gpu.get("error") or "torch sees no CUDA device", summary)
    bad = summary["import_failures"]
    return _require(call.rc == 0, f"exit {call.rc}" + (f"; {len(bad)} module(s) do not import: "
                                                       f"{', '.join(sorted(bad)[:5])}" if bad else ""), summary)


# ---- doctor -----------------------------------------------------------------------------------------

CHECK_LINE = re.compile(r"^  (?P<status>ok|FAIL)\s+(?P<name>.+?)(?:: (?P<detail>.*))?$")


def parse_doctor(text: str) -> dict[str, Any]:
    checks = []
    for line in text.splitlines():
        if m := CHECK_LINE.match(line):
            checks.append({"name": m["name"], "ok": m["status"] == "ok", "detail": (m["detail"] or "")[:300]})
    last = [line for line in text.splitlines() if line.startswith("noria doctor: ")]
    return {"checks": checks, "verdict": last[-1] if last else None}


def doctor_phase(ctx: Any) -> dict[str, Any]:
    call = ctx.call([ctx.python, "-m", "noria.cli", "doctor", "--quick", *(["--max-tokens", "4"] if ctx.dry_run else [])])
    summary = parse_doctor(call.output)
    failed = [c["name"] for c in summary["checks"] if not c["ok"]]
    note = f"{len(failed)} check(s) failed: {'; '.join(failed)}" if failed else f"exit {call.rc}"
    return _require(call.rc == 0 and not failed and summary["checks"], note, summary)


# ---- tests -----------------------------------------------------------------------------------------

_STATUS = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
RESULT_LINE = re.compile(rf"^(?P<id>\S+::.*?) (?P<status>{_STATUS})\b")
XDIST_LINE = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] (?P<status>{_STATUS}) (?P<id>\S+::.*?)\s*$")
SUMMARY_LINE = re.compile(r"^(?P<status>FAILED|ERROR) (?P<id>\S+::.*?)(?: - (?P<why>.*))?$")
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def parse_pytest(text: str) -> dict[str, Any]:
    """Each test's status from `pytest -v` (plain or xdist), the reason of each failure from the
    short summary (-rfE), and the counts of the closing line when there is one."""
    status: dict[str, str] = {}
    why: dict[str, str] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if m := SUMMARY_LINE.match(line):
            why[m["id"]] = (m["why"] or "")[:300]
            status.setdefault(m["id"], m["status"])
        elif m := RESULT_LINE.match(line) or XDIST_LINE.match(line):
            status[m["id"]] = m["status"]
        if line.startswith("=") and (" in " in line) and COUNTS.search(line):
            counts = {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in COUNTS.findall(line)}
    if not counts:  # cut short: no closing line, count what was seen
        for s in status.values():
            key = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped"}.get(s, s.lower())
            counts[key] = counts.get(key, 0) + 1
    failed = [{"test": t, "status": s, "why": why.get(t, "")} for t, s in status.items() if s in ("FAILED", "ERROR")]
    return {"counts": counts, "failed": failed[:200], "passed": sorted(t for t, s in status.items() if s == "PASSED"),
            "tests_seen": len(status)}


def tests_phase(ctx: Any) -> dict[str, Any]:
    import importlib.util

    xdist = importlib.util.find_spec("xdist") is not None
    groups, failed, counts, calls = DRY_TESTS if ctx.dry_run else GPU_TESTS, [], {}, []
    for files, parallel in groups:
        workers = ["-n", XDIST_WORKERS] if parallel and xdist else []
        call = ctx.call([ctx.python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=short",
                         "-rfE", "--timeout", "300", *workers, *files])
        got = parse_pytest(call.output)
        failed += got["failed"]
        for k, n in got["counts"].items():
            counts[k] = counts.get(k, 0) + n
        calls.append({"files": list(files), "workers": int(workers[1]) if workers else 1, "rc": call.rc,
                      "counts": got["counts"]})
    summary = {"counts": counts, "failed": failed[:200], "groups": calls}
    note = (f"{counts.get('failed', 0)} failed, {counts.get('error', 0)} errors: "
            + "; ".join(f["test"] for f in failed[:5])) if failed else f"pytest exit {[c['rc'] for c in calls]}"
    return _require(all(c["rc"] == 0 for c in calls), note, summary)


# ---- kernels ---------------------------------------------------------------------------------------

def kernel_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's kernel targets on the H200, from `noria bench kernels --json` rows."""
    def length(r: dict[str, Any]) -> int:
        return int(r.get("context") or r.get("prompt") or r.get("length") or 0)

    ours = {(r["kind"], r["seqs"], length(r)): r for r in rows if r.get("backend", "noria") == "noria" and "seqs" in r}
    theirs = {(r["kind"], r["backend"], r["seqs"], length(r)): r for r in rows if r.get("backend", "noria") != "noria"}
    out = []
    copies = []
    for seqs, ctx_len in ((32, 2048), (64, 4096)):
        of = (ours.get(("decode", seqs, ctx_len)) or {}).get("of_copy")
        copies += [of] if of else []
        out.append({"target": f"decode {seqs} x {ctx_len}: >= 85% of the device copy", "value": of,
                    "met": None if of is None else of >= 0.85})
    of = (ours.get(("decode", 4, 32768)) or {}).get("of_copy")
    ref = sum(copies) / len(copies) if copies else None
    out.append({"target": "decode 4 x 32768: within 10% of the two above", "value": of,
                "met": None if of is None or ref is None else of >= 0.9 * ref})
    for seqs, prompt in ((1, 8192), (4, 2048)):
        mine = (ours.get(("prefill", seqs, prompt)) or {}).get("tflops")
        flash = (theirs.get(("prefill", "sdpa-flash", seqs, prompt)) or {}).get("tflops")
        cudnn = (theirs.get(("prefill", "sdpa-cudnn", seqs, prompt)) or {}).get("tflops")
        ratio = mine / flash if mine and flash else None
        out.append({"target": f"prefill {seqs} x {prompt}: >= 0.8x SDPA flash", "value": ratio,
                    "met": None if ratio is None else ratio >= 0.8,
                    "note": f"cuDNN: {mine / cudnn:.2f}x" if mine and cudnn else "cuDNN: n/a"})
    mixed = next((r for r in rows if r["kind"] == "mixed"), None)
    ratio = mixed["mixed_over_parts"] if mixed else None
    out.append({"target": "mixed step no slower than its two parts apart", "value": ratio,
                "met": None if ratio is None else ratio <= 1.0})
    return out


def kernels_phase(ctx: Any) -> dict[str, Any]:
    path = ctx.work / "kernels.json"
    call = ctx.call([ctx.python, "-m", "noria.cli", "bench", "kernels", *(DRY_KERNEL_SHAPES if ctx.dry_run else
                                                                         KERNEL_SHAPES), "--baselines", "--json", str(path)])
    rows = json.loads(path.read_text()) if path.exists() else []
    summary = {"rows": rows, "targets": _judged(ctx, kernel_targets(rows))}
    return _require(call.rc == 0 and bool(rows), f"exit {call.rc}" + ("" if rows else ", no rows"), summary)


# ---- bench gpu -------------------------------------------------------------------------------------

def gpu_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's engine targets, from `noria bench gpu`'s rows."""
    by = {r["name"]: r for r in rows}
    one = by.get("ITL batch 1 (CUDA graphs)") or by.get("ITL batch 1 (default)") or {}
    of = one.get("of_roofline")
    out = [{"target": "batch-1 decode step within 1.3x of its weights-read roofline (graphs)", "value": 1 / of if of else None,
            "met": None if not of else 1 / of <= 1.3}]
    thr = next((r["value"] for r in rows if r["name"].startswith("offline ") and r.get("value")), None)
    hf = [r["value"] for r in rows if r["name"].startswith("ITL batch 16 (transformers") and r.get("value")]
    ratio = thr / (16 / (min(hf) / 1e3)) if thr and hf else None
    out.append({"target": "offline throughput >= 4x transformers' static-cache generate at batch 16",
                "value": ratio, "met": None if ratio is None else ratio >= 4})
    for batch in (1, 32):  # issue 39: bench/gpu_quant.py's ratio rows ("decode batch B: fp8 ... / bfloat16")
        fp8 = next((r.get("value") for r in rows if r["name"].startswith(f"decode batch {batch}: fp8")), None)
        out.append({"target": f"FP8 decode throughput >= 1.6x bf16 at batch {batch} (8B shape)", "value": fp8,
                    "met": None if fp8 is None else fp8 >= 1.6})
    return out


def bench_gpu_phase(ctx: Any) -> dict[str, Any]:
    out = ctx.out / "bench-gpu"
    from noria.protocol import switches  # installed by now: the phases run after the install

    env = {}
    if ctx.dry_run:
        extra = ["--tiny", "--device", "cpu"]
    else:
        extra = []
        shm = Path("/dev/shm")
        if shm.is_dir() and shutil.disk_usage(shm).free > SHM_FREE_FOR_CHECKPOINT:
            env[switches.CACHE] = str(shm / "noria-gpu-session")  # the 16 GB checkpoint in memory, not on disk
    # bench gpu keeps its own budget, ending (and writing its report) before the phase is killed.
    budget = max(ctx.left() - 20, 10)
    call = ctx.call([ctx.python, "-m", "noria.cli", "bench", "gpu", "--time-budget", f"{budget:.0f}", "--out", str(out),
                     *extra], env=env)
    path = out.with_suffix(".json")
    data = json.loads(path.read_text()) if path.exists() else {}
    summary = {"report": str(path), "checkpoint_cache": env.get(switches.CACHE, "default"),
               "phases": data.get("phases", {}), "rows": data.get("rows", []), "meta": data.get("meta", {}),
               "targets": _judged(ctx, gpu_targets(data.get("rows", [])))}
    bad = [k for k, v in summary["phases"].items() if v.get("status") in ("failed", "cut short")]
    return _require(call.rc == 0 and not bad, f"exit {call.rc}" + (f"; bench gpu phases {', '.join(bad)}" if bad else ""),
                    summary)


PHASES = (
    Phase("env", "environment and ceilings", 60, 60, 10, env_phase),
    Phase("doctor", "noria doctor --quick", 150, 120, 30, doctor_phase),
    Phase("tests", "the GPU tests (pytest)", 150, 90, 30, tests_phase),
    Phase("kernels", "noria bench kernels beside torch's attention", 75, 90, 20, kernels_phase),
    Phase("bench_gpu", "noria bench gpu in what is left", 450, 150, 60, bench_gpu_phase),
)

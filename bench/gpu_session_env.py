"""bin/gpu-session's first phase, in a child process: what the machine is (GPU, driver, torch,
CUDA, cuDNN, CuPy, NVRTC, nvcc, the Python packages noria runs on), whether every noria module
imports under those packages, and the two ceilings every later figure is read against: a
device-to-device copy's bandwidth and a large bfloat16 matmul's rate.

    python -m noria.bench.gpu_session_env --json FILE [--tiny]

`--tiny` (the CPU rehearsal) probes small sizes. The facts are printed and written to FILE.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import platform
import shutil
import subprocess
import sys
import time
from importlib import metadata
from typing import Any

# Packages whose versions matter for noria on the device (the image's, or the carried wheels').
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "cupy-cuda13x", "nvidia-cuda-nvrtc",
            "msgspec", "pyzmq", "llguidance", "aiohttp", "uvloop", "prometheus-client", "pytest", "pytest-xdist",
            "hypothesis", "flash-attn")
NVIDIA_SMI_FIELDS = "name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw"


def _run(argv: list[str], timeout: float = 20) -> str:
    """A tool's output, or why there is none."""
    if shutil.which(argv[0]) is None:
        return f"{argv[0]}: not on PATH"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"{argv[0]}: no answer in {timeout:.0f} s"
    return (done.stdout or done.stderr).strip()


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def gpu_facts() -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        return facts
    props = torch.cuda.get_device_properties(0)
    facts |= {"gpu": props.name, "capability": f"sm_{props.major}{props.minor}", "sm_count": props.multi_processor_count,
              "memory_gib": round(props.total_memory / 2**30, 1), "l2_mib": getattr(props, "L2_cache_size", 0) / 2**20,
              "cudnn": torch.backends.cudnn.version(), "device_count": torch.cuda.device_count()}
    facts["nvidia_smi"] = _run(["nvidia-smi", f"--query-gpu={NVIDIA_SMI_FIELDS}", "--format=csv,noheader"])
    facts["nvcc"] = _run(["nvcc", "--version"]).splitlines()[-1:]
    facts["ncu"] = shutil.which("ncu") or "not on PATH"
    try:
        from noria.kernels.device_info import cupy_status

        facts["cupy"] = cupy_status()[1]
        import cupy

        facts["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
        facts["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as e:  # noqa: BLE001 - CuPy missing or broken is a fact to report
        facts["cupy"] = f"{type(e).__name__}: {e}"
    return facts


def import_all() -> dict[str, Any]:
    """Import every noria module (not `__main__`s; of bench/, the GPU session's own): under the
    device's torch and transformers a missing name shows here, before a phase trips over it. The
    other benchmarks may need their extras (websockets, ...), which the image need not have."""
    names = ["noria", "noria.bench"]
    for pkg in ("noria.protocol", "noria.frontend", "noria.scheduler", "noria.worker", "noria.kernels"):
        names.append(pkg)
        names += [m.name for m in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + ".")]
    names += [m.name for m in pkgutil.iter_modules(importlib.import_module("noria.bench").__path__, "noria.bench.")
              if m.name.rsplit(".", 1)[1].startswith(("gpu", "kernel"))]
    failed = {}
    for name in names:
        if name.endswith("__main__"):
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            failed[name] = f"{type(e).__name__}: {e}"[:300]
    return {"modules": len(names), "failed": failed}


def probes(tiny: bool) -> dict[str, Any]:
    import torch

    from noria.bench.gpu_probes import probe_copy_gbps, probe_matmul_tflops

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    big = dev.type == "cuda" and not tiny
    start = time.perf_counter()
    copy = probe_copy_gbps(dev, (1 << 30) if big else (32 << 20))
    tflops = probe_matmul_tflops(dev, torch.bfloat16, 8192 if big else 256)
    return {"device": str(dev), "copy_gbps": copy, "copy_bytes": (1 << 30) if big else (32 << 20),
            "bf16_matmul_tflops": tflops, "matmul_n": 8192 if big else 256,
            "seconds": round(time.perf_counter() - start, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m noria.bench.gpu_session_env", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="write the facts here")
    ap.add_argument("--tiny", action="store_true", help="small probes (the CPU rehearsal)")
    args = ap.parse_args(argv)
    import torch

    facts: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                             "torch": torch.__version__, "packages": versions()}
    for part, fn in (("gpu", gpu_facts), ("imports", import_all), ("probes", lambda: probes(args.tiny))):
        try:
            facts[part] = fn()
        except Exception as e:  # noqa: BLE001 - report what was found so far, and why not the rest
            facts[part] = {"error": f"{type(e).__name__}: {e}"[:500]}
        with open(args.json, "w") as f:
            json.dump(facts, f, indent=2, default=str)
    print(json.dumps(facts, indent=2, default=str))
    broken = [k for k in ("gpu", "imports", "probes") if "error" in facts[k]] + list(facts["imports"].get("failed", {}))
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())

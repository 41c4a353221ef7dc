"""`bin/gpu-session`: every GPU check and benchmark of noria in one command, inside 8 minutes, for
the few minutes a lent GPU machine gives (the device tool: 15 minutes a session, start-up
included; nothing can be installed there from a registry).

    bin/gpu-session [--dry-run] [--out DIR] [--phases P,...] [--time-budget S] [--budget PHASE=S]
    bin/gpu-session --pack-wheels DIR        # on a CPU host with PyPI (bench/gpu_wheels.py)

On the GPU machine, in order of value, each phase in child processes under its own time budget
(its cap, at most what is left of --time-budget; a phase that needs more than is left is
skipped, one that overruns is killed with every process it started, one that fails is recorded
with its error and output tail, and the next phase runs all the same):

  install    the carried wheels (--wheels, default .gpu-wheels) into a scratch folder, and noria
             itself (`pip install -e` offline, else a finder of its namespace in the tree): no
             network; always first (a few seconds), whatever --phases names, unless --no-install;
  env        GPU, driver, torch, CUDA, cuDNN, CuPy, NVRTC, nvcc, package versions; every noria
             module imported; device-copy bandwidth and bf16 matmul rate (bench/gpu_session_env.py);
  doctor     `noria doctor --quick`;
  tests      the GPU tests through pytest, with a pass/fail list;
  kernels    `noria bench kernels` on the issue's shapes beside torch's attention backends;
  bench_gpu  `noria bench gpu` in what is left (its checkpoint in /dev/shm where that has room).

The report, gpu-session.json and its markdown twin in the out folder (default $OUT, else
bench/results/gpu-session), is rewritten after every phase, so a run cut short still says what
it found; gpu-session.log there holds every child's output.

`--dry-run` rehearses the same phases on the CPU (no install; the kernels under the CUDA
emulator; tiny sizes), end to end in under 3 minutes on two cores: the plumbing, not figures.

This file runs before noria is installed (bin/gpu-session starts it by path on the GPU machine),
so it imports only the standard library until the install is done; the phases live in
bench/gpu_session_run.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("env", "doctor", "tests", "kernels", "bench_gpu")  # after the install, in this order
DEFAULT_TIME_BUDGET = 470.0  # seconds for every phase: the whole run ends inside 8 minutes
NORIA_MODULES = "import noria.cli, noria.kernels.ops, noria.worker.model_runner, noria.frontend.llm"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bin/gpu-session", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="rehearse on the CPU: no install, the kernels under "
                    "the CUDA emulator, tiny sizes")
    ap.add_argument("--out", default=None, help="the report's folder (default $OUT, else bench/results/gpu-session)")
    ap.add_argument("--pack-wheels", metavar="DIR", default=None, help="on a CPU host: download the wheels the GPU "
                    "machine's image lacks into DIR (git-ignored) and print the carry list and command")
    ap.add_argument("--wheels", default=".gpu-wheels", help="the carried wheels to install first (default .gpu-wheels)")
    ap.add_argument("--no-install", action="store_true", help="on a GPU host that has noria and its packages already")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    ap.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET,
                    help=f"seconds for every phase together (default {DEFAULT_TIME_BUDGET:.0f})")
    ap.add_argument("--budget", action="append", default=[], metavar="PHASE=S", help="a phase's cap in seconds "
                    "(repeatable)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a new one in the temp folder)")
    # Tests only: PHASE=fail makes that phase's child exit 1, PHASE=hang makes it sleep.
    ap.add_argument("--inject", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.phase_list = [p.strip() for p in args.phases.split(",") if p.strip()]
    if unknown := set(args.phase_list) - set(PHASES):
        ap.error(f"unknown phase(s) {', '.join(sorted(unknown))}; choose from {', '.join(PHASES)}")
    args.caps = {}
    for item in args.budget:
        name, _, seconds = item.partition("=")
        try:
            args.caps[name] = float(seconds)
        except ValueError:
            ap.error(f"--budget takes PHASE=SECONDS, not {item!r}")
        if name not in ("install", *PHASES):
            ap.error(f"--budget: unknown phase {name!r}")
    args.faults = dict(item.partition("=")[::2] for item in args.inject)
    return args


def _call(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\n(no answer in {timeout:.0f} s)"
    return done.returncode, done.stdout + done.stderr


FINDER = """\
# Written by bin/gpu-session (bench/gpu_session.py): noria's namespace from the tree at {root},
# as `pip install -e` maps it (pyproject's package-dir), ahead of every path entry, so that the
# tree's own noria/ folder (on sys.path when the working folder is the tree) cannot shadow it.
import importlib.util
import sys

_MAP = {mapping!r}


class NoriaTreeFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        folder = _MAP.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, folder + "/__init__.py",
                                                      submodule_search_locations=[folder])


if not any(getattr(f, "__name__", "") == "NoriaTreeFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, NoriaTreeFinder)
"""


def tree_finder(dest: Path) -> Path:
    """A folder whose `sitecustomize` module (run by every Python started with it on PYTHONPATH) imports
    noria's namespace from this tree: what `pip install -e` gives, with no build backend. This
    process runs the file itself. Returns the folder."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    mapping = {name: str(ROOT / folder) for name, folder in package_dir.items()}
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "sitecustomize.py"
    path.write_text(FINDER.format(root=ROOT, mapping=mapping))
    spec = importlib.util.spec_from_file_location("noria_tree_finder", path)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return dest


def install(wheels: Path, work: Path, seconds: float) -> tuple[dict[str, Any], list[str]]:
    """The install phase (stdlib only): (its report entry, the folders to put on PYTHONPATH)."""
    start, deadline, log = time.monotonic(), time.monotonic() + seconds, []
    paths: list[str] = []
    entry: dict[str, Any] = {"status": "ok", "note": ""}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if found:
        site = work / "site"
        rc, out = _call([*pip, "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
                         "--target", str(site), *map(str, found)], deadline - time.monotonic())
        log.append(out)
        if rc != 0:
            entry = {"status": "failed", "note": f"pip could not install the carried wheels (exit {rc})"}
        paths.append(str(site))
        entry["wheels"] = [w.name for w in found]
    else:
        entry["wheels"] = []
        entry["note"] = f"no carried wheels in {wheels} (bin/gpu-session --pack-wheels {wheels} on a CPU host)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep))
    rc, out = _call([*pip, "install", "-q", "--no-index", "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
                    deadline - time.monotonic(), env)
    log.append(out)
    entry["noria"] = "pip install -e"
    if rc != 0:  # an image without a setuptools that builds editables: the same namespace, found from the tree
        paths.insert(0, str(tree_finder(work / "noria-finder")))
        entry["noria"] = f"a finder in {work / 'noria-finder'} (pip install -e failed: exit {rc})"
    env["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
    rc, out = _call([sys.executable, "-c", NORIA_MODULES + "; import zmq, msgspec, llguidance"],
                    max(deadline - time.monotonic(), 30), env)
    log.append(out)
    if rc != 0:
        last = (out.strip().splitlines() or ["?"])[-1]
        entry = entry | {"status": "failed", "note": f"noria does not import after the install: {last}"}
    entry["seconds"] = round(time.monotonic() - start, 2)
    entry["tail"] = "\n".join(log)[-3000:]
    return entry, paths


def _emergency_report(out: Path, install_entry: dict[str, Any] | None, error: BaseException) -> None:
    """The runner itself would not import: say so where the report would be."""
    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": {"error": f"bench/gpu_session_run.py did not import: {type(error).__name__}: {error}"},
            "phases": {"install": install_entry or {}}}
    (out / "gpu-session.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / "gpu-session.md").write_text(f"# gpu-session\n\n{data['meta']['error']}\n\n```\n"
                                        f"{(install_entry or {}).get('tail', '')}\n```\n")


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    if args.pack_wheels:
        from noria.bench.gpu_wheels import pack

        return pack(Path(args.pack_wheels))
    out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results" / "gpu-session")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-session-"))
    work.mkdir(parents=True, exist_ok=True)
    install_entry: dict[str, Any] | None = None
    if not (args.dry_run or args.no_install):
        print("[install] the carried wheels and noria, from local files", flush=True)
        wheels = Path(args.wheels) if Path(args.wheels).is_absolute() else ROOT / args.wheels
        install_entry, paths = install(wheels, work, min(args.caps.get("install", 120.0), args.time_budget))
        print(f"[install] {install_entry['status']}: {install_entry['noria']}; {install_entry['note']}", flush=True)
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
        # Its children inherit PYTHONPATH; this process imports the runner through the tree's
        # finder (an editable install's own is loaded at start-up only).
        sys.path[:0] = [p for p in paths if p not in sys.path]
        tree_finder(work / "noria-finder")
    try:
        from noria.bench.gpu_session_run import run
    except Exception as e:  # noqa: BLE001 - the report must say why there is no report
        _emergency_report(out, install_entry, e)
        print(f"gpu-session: the runner did not import ({type(e).__name__}: {e}); see {out}", flush=True)
        return 1
    return run(args, out, work, started, install_entry)


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # run by path: bench/'s modules are noria.bench.*, never top-level names
    raise SystemExit(main())

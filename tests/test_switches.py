"""Environment switches: one module reads every NORIA_* variable, importing noria changes no
environment, and the worker's entry point sets its OpenMP and allocator settings before torch
loads. Also the step observer that bench's step log installs through NORIA_STEP_OBSERVER."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from noria.bench import step_log
from noria.bench.ceiling import read_steps
from noria.protocol import switches
from noria.worker.cli import PROCESS_ENV
from noria.worker.errors import WorkerFatal
from noria.worker.model_runner import StepStats
from noria.worker.process import install_step_observer

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("protocol", "frontend", "scheduler", "worker", "kernels", "bench", "noria")


def test_switches_are_read_when_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (*switches.SWITCHES, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert switches.cache_dir() == tmp_path / "home" / ".cache" / "noria"
    assert switches.kernel_cache_dir() == tmp_path / "home" / ".cache" / "noria" / "kernels"
    assert switches.vllm_venv() == tmp_path / "home" / ".cache" / "noria" / "vllm-venv"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert switches.cache_dir() == tmp_path / "xdg" / "noria"
    monkeypatch.setenv("NORIA_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("NORIA_KERNEL_CACHE", str(tmp_path / "k"))
    assert switches.cache_dir() == tmp_path / "c"
    assert switches.vllm_venv() == tmp_path / "c" / "vllm-venv"
    assert switches.kernel_cache_dir() == tmp_path / "k"

    assert [switches.cpu_family_disabled(f) for f in ("gemm", "stack")] == [None, None]
    monkeypatch.setenv("NORIA_DISABLE_CPU_GEMM", "1")
    assert switches.cpu_family_disabled("gemm") == "NORIA_DISABLE_CPU_GEMM=1"
    assert switches.cpu_family_disabled("stack") is None
    monkeypatch.setenv("NORIA_DISABLE_CPU_KERNELS", "1")
    assert switches.cpu_family_disabled("stack") == "NORIA_DISABLE_CPU_KERNELS=1"

    assert not switches.emulated_kernels()
    monkeypatch.setenv("NORIA_EMULATED_KERNELS", "0")  # a flag is on at exactly 1
    assert not switches.emulated_kernels()
    monkeypatch.setenv("NORIA_EMULATED_KERNELS", "1")
    assert switches.emulated_kernels()

    monkeypatch.setenv("NORIA_API_KEY", "k1")
    assert switches.take_api_key() == "k1"
    assert "NORIA_API_KEY" not in os.environ and switches.take_api_key() is None


def _python_files() -> list[Path]:
    return [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]


def test_no_module_but_switches_names_a_noria_variable() -> None:
    # A NORIA_* name as a whole string is how code reads (or sets) the variable; only the
    # switch module may hold one, so that every switch has its one documented reader.
    own = ROOT / "protocol" / "switches.py"
    found = []
    for path in _python_files():
        if path == own:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"NORIA_[A-Z0-9_]+", node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert not found, "read these through noria.protocol.switches:\n" + "\n".join(found)


def test_the_docs_name_every_switch() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [name for name in switches.SWITCHES if name not in page]
    assert not missing, f"docs/architecture.md does not name {missing}"


IMPORT_ALL = """
import importlib, json, os, sys
changed, skipped, failed = {}, [], {}
for name in sys.argv[1:]:
    before = dict(os.environ)
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").startswith("noria"):
            failed[name] = repr(e)
        else:
            skipped.append(f"{name}: {e.name}")  # an optional dependency this host lacks
    except Exception as e:
        failed[name] = repr(e)
    after = dict(os.environ)
    if after != before:
        changed[name] = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
print(json.dumps({"changed": changed, "skipped": skipped, "failed": failed, "torch": "torch" in sys.modules}))
"""


def _modules() -> list[str]:
    names = []
    for path in _python_files():
        rel = path.relative_to(ROOT).with_suffix("")
        if rel.name == "__main__":
            continue  # runs its program when imported
        parts = list(rel.parts) if rel.parts[0] != "noria" else list(rel.parts[1:])
        if parts and parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(["noria", *parts]))
    return names


def test_importing_noria_changes_no_environment() -> None:
    env = {k: v for k, v in os.environ.items() if k not in PROCESS_ENV}
    modules = _modules()
    assert {"noria.worker", "noria.worker.model_runner", "noria.frontend.llm", "noria.bench.throughput"} <= set(modules)
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL, *modules], capture_output=True, text=True, env=env,
                         cwd="/", timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["torch"]  # the probe imported the worker for real, not a stub
    assert report["changed"] == {}, f"importing these changed os.environ: {report['changed']}"
    assert report["failed"] == {}


PROBE = """
import json, os, sys, types
# The worker's process loop, replaced: it reports what the entry point set up before it.
fake = types.ModuleType("noria.worker.process")
fake.WorkerOptions = lambda **kw: kw
def run(opts):
    print(json.dumps({k: os.environ.get(k) for k in %r} | {"torch": "torch" in sys.modules}))
    return 0
fake.run = run
sys.modules["noria.worker.process"] = fake
entry = sys.argv[1]
if entry == "python -m noria.worker":
    import runpy
    sys.argv = ["noria.worker", "--connect", "tcp://127.0.0.1:9", "--standalone"]
    runpy.run_module("noria.worker", run_name="__main__")
else:
    import noria.cli
    sys.exit(noria.cli.main(["worker", "--connect", "tcp://127.0.0.1:9"]))
"""


@pytest.mark.parametrize("entry", ["python -m noria.worker", "noria worker"])
def test_the_worker_entry_point_sets_its_process_env_before_torch(entry: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in PROCESS_ENV}
    out = subprocess.run([sys.executable, "-c", PROBE % (list(PROCESS_ENV),), entry], capture_output=True,
                         text=True, env=env, cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.splitlines()[-1])
    assert report == {**PROCESS_ENV, "torch": False}


def test_a_process_env_already_set_wins() -> None:
    env = {**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}
    out = subprocess.run([sys.executable, "-c", PROBE % (list(PROCESS_ENV),), "noria worker"], capture_output=True,
                         text=True, env=env, cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(out.stdout.splitlines()[-1])["OMP_WAIT_POLICY"] == "ACTIVE"


def _runner(rank: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(rank=rank, step_observers=[])


def test_the_step_log_installs_through_the_switch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "steps"
    for name, value in step_log.env(path).items():
        monkeypatch.setenv(name, value)
    first, other = _runner(0), _runner(1)
    install_step_observer(first)
    install_step_observer(other)
    assert len(first.step_observers) == 1 and other.step_observers == []  # one file, from rank 0
    steps = [StepStats([5, 1], [5, 9], 2, 0.0125), StepStats([3], [12], 0, 1.5)]
    for s in steps:
        first.step_observers[0](s)
    # The format bench/ceiling.py, throughput and roofline read: one JSON list per line.
    assert path.read_text() == "[[5, 1], [5, 9], 2, 0.012500]\n[[3], [12], 0, 1.500000]\n"
    assert read_steps(path) == [([5, 1], [5, 9], 2, 0.0125), ([3], [12], 0, 1.5)]
    assert read_steps(path, skip=1) == [([3], [12], 0, 1.5)]


def test_no_observer_unless_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NORIA_STEP_OBSERVER", raising=False)
    monkeypatch.setenv("NORIA_RECORD_STEPS", str(tmp_path / "steps"))  # the file alone installs nothing
    runner = _runner(0)
    install_step_observer(runner)
    assert runner.step_observers == [] and not (tmp_path / "steps").exists()


@pytest.mark.parametrize("name", ["noria.bench.no_such_module:install", "noria.bench.step_log:no_such_name"])
def test_an_observer_that_does_not_resolve_fails_the_rank(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv("NORIA_STEP_OBSERVER", name)
    with pytest.raises(WorkerFatal, match="NORIA_STEP_OBSERVER"):
        install_step_observer(_runner(0))


def test_recording_puts_the_environment_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NORIA_STEP_OBSERVER", raising=False)
    monkeypatch.setenv("NORIA_RECORD_STEPS", "before")
    with step_log.recording(tmp_path / "steps"):
        assert switches.step_observer() == step_log.OBSERVER
        assert switches.record_steps() == str(tmp_path / "steps")
    assert switches.step_observer() is None and switches.record_steps() == "before"

"""Fixtures for the kernel tests: the kernel source dir (a mutated copy during mutation
runs) and emulator backends per thread order, with every module the selected tests need
compiled up front in parallel."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# The repository root, so that `kernels` imports when noria is not pip-installed.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from noria.kernels.backends import EmuBackend  # noqa: E402
from noria.kernels.emu import EmuConfig  # noqa: E402
from noria.kernels.instances import ModuleSpec  # noqa: E402
from noria.kernels.options import SOURCE_DIR  # noqa: E402

# The GPU module runs only where a GPU is; elsewhere it is not collected (rather than skipped).
collect_ignore = [] if torch.cuda.is_available() else ["test_gpu_kernels.py"]

# Emulated launches spread blocks over both cores of the CI machine.
EMU_WORKERS = min(2, os.cpu_count() or 1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kernels-src",
        default=None,
        help="directory with the .cu sources to test (kernels.mutate points it at mutants)",
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the NVRTC compile checks now, so they overlap the emulated tests."""
    if any(item.path.name == "test_nvrtc_build.py" for item in session.items):
        import nvrtc_runs

        session.config.stash[nvrtc_runs.RUNS_KEY] = nvrtc_runs.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    import nvrtc_runs

    for run in session.config.stash.get(nvrtc_runs.RUNS_KEY, []):
        if run.proc.poll() is None:  # the run was cut short: do not leave compilers behind
            run.proc.kill()
            run.proc.wait()


@pytest.fixture(scope="session")
def source_dir(request: pytest.FixtureRequest) -> Path:
    opt = request.config.getoption("--kernels-src")
    return Path(opt).resolve() if opt else SOURCE_DIR


def _selected_specs(session: pytest.Session) -> list[ModuleSpec]:
    """Modules of the selected tests: a test module lists them with emu_specs(params)."""
    specs: dict[ModuleSpec, None] = {}
    for item in session.items:
        fn = getattr(item.module, "emu_specs", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if fn is not None:
            for spec in fn(params):
                specs.setdefault(spec)
    return list(specs)


@pytest.fixture(scope="session")
def emu(request: pytest.FixtureRequest, source_dir: Path) -> Callable[[str], EmuBackend]:
    """emu(schedule) -> an emulator backend that runs blocks in that thread order."""
    EmuBackend(source_dir).prebuild(_selected_specs(request.session))
    cache: dict[str, EmuBackend] = {}

    def get(schedule: str = "forward") -> EmuBackend:
        if schedule not in cache:
            # CUDAEMU_MEMCHECK=0 turns the memory check off (to show what only it catches).
            memcheck = os.environ.get("CUDAEMU_MEMCHECK", "1") != "0"
            cfg = EmuConfig(schedule=schedule, workers=EMU_WORKERS, strict=True, memcheck=memcheck)
            cache[schedule] = EmuBackend(source_dir, cfg)
        return cache[schedule]

    return get

"""The built wheel installs as one `noria` namespace and lives beside Hugging Face's `kernels`.

What this proves: a wheel of this repository holds only `noria/` (the top-level folders mapped
under it, with their C/CUDA sources and the playground page) and its dist-info; installed into a
fresh venv next to the PyPI distribution named `kernels`, both `import kernels` (Hugging Face's)
and `import noria.kernels` (ours) load in one interpreter, and the venv's `noria` console script
generates the same text as this checkout does.

The fresh venv borrows torch & co. from this environment through a `.pth` file holding a plain
path: Python adds that folder to sys.path without running the `.pth` hooks inside it, so this
environment's editable install of noria stays inactive and `noria` must come from the wheel.
Needs PyPI for Hugging Face's `kernels` (and whichever of its dependencies are missing here);
without it the test skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("protocol", "frontend", "scheduler", "worker", "kernels", "bench")
# Non-Python files the installed code reads at run time.
DATA_GLOBS = (
    "frontend/static/*.html",
    "worker/csrc/*.c",
    "worker/csrc/*.h",  # included by the .c files (paged_decode_fp8.h)
    "kernels/csrc/*.cu",
    "kernels/csrc/*.cuh",
    "kernels/emu/include/**/*.h",
)
pytestmark = pytest.mark.wheel  # `-m "not wheel"` leaves out the build and the PyPI download
NOT_SOURCE = (".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis")


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _plain_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", **extra)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Build from a copy so that setuptools' build/ and egg-info never land in the checkout.
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    out = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"), str(src)],
        timeout=300, env=_plain_env(),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (whl,) = (work / "dist").glob("noria-*.whl")
    return whl


def test_wheel_holds_only_the_noria_namespace(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and tops - dist_info == {"noria"}, sorted(tops)

    # Every module and data file of the folders, under its noria.* name (reference: the tree).
    expected = {str(p.relative_to(ROOT)) for p in (ROOT / "noria").glob("*.py")}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            expected.add(f"noria/{path.relative_to(ROOT)}")
    for pattern in DATA_GLOBS:
        found = list(ROOT.glob(pattern))
        assert found, f"{pattern} matches nothing in the repository"
        expected.update(f"noria/{p.relative_to(ROOT)}" for p in found)
    assert not {e for e in expected if "__pycache__" in e}
    assert expected - names == set(), sorted(expected - names)

    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info.pop()}/entry_points.txt").decode()
    assert "noria = noria.cli:main" in entry_points


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv") / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    py = env_dir / "bin" / "python"
    # This environment's pip installs into the fresh one (`--python`), so the venv needs no pip.
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "--retries", "1", "--timeout", "20"]
    out = _run([*pip, "--no-deps", str(wheel)], timeout=300, env=_plain_env())
    assert out.returncode == 0, out.stderr[-3000:]

    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout=60)
    Path(site.stdout.strip(), "zz-borrow-main-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # With this environment visible, pip adds only what Hugging Face's kernels lacks here.
    out = _run([*pip, "kernels"], timeout=600, env=_plain_env())
    if out.returncode != 0:
        last = out.stderr.strip().splitlines()[-1:] or ["(no output)"]
        pytest.skip(f"Hugging Face's `kernels` could not be installed from PyPI here: {last[0]}")
    return env_dir


PROBE = """
import importlib.metadata as md, json, sys
import kernels
import noria, noria.kernels
print(json.dumps({
    "kernels_file": kernels.__file__,
    "kernels_dist_files": [str(f) for f in md.distribution("kernels").files if f.name == "__init__.py"],
    "kernels_version": kernels.__version__,
    "kernels_dist_version": md.version("kernels"),
    "kernels_has_get_kernel": callable(getattr(kernels, "get_kernel", None)),
    "noria_file": noria.__file__,
    "noria_kernels_file": noria.kernels.__file__,
    "noria_kernels_all": noria.kernels.__all__,
    "finders": [type(f).__module__ for f in sys.meta_path],
    "editable_loaded": sorted(m for m in sys.modules if "editable" in m),
}))
"""


def test_hf_kernels_and_noria_kernels_import_side_by_side(venv: Path, tmp_path: Path) -> None:
    import json

    out = _run([str(venv / "bin/python"), "-c", PROBE], timeout=120, cwd=tmp_path, env=_plain_env())
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    site = Path(got["noria_file"]).parents[1]
    assert site.is_relative_to(venv), f"noria came from {got['noria_file']}, not the fresh venv"
    assert Path(got["noria_kernels_file"]) == site / "noria" / "kernels" / "__init__.py"
    assert not got["editable_loaded"], "the main environment's editable finder ran"
    assert not any("editable" in m for m in got["finders"])

    # Hugging Face's: its own distribution's file, its version and API, not our kernels folder.
    assert Path(got["kernels_file"]) == site / "kernels" / "__init__.py"
    assert "kernels/__init__.py" in got["kernels_dist_files"]
    assert got["kernels_version"] == got["kernels_dist_version"]
    assert got["kernels_has_get_kernel"]
    assert "paged_attention" in got["noria_kernels_all"]


def _generate(cmd: list[str], cwd: Path, cache: Path) -> str:
    out = _run([*cmd, "generate", "Hello", "--max-tokens", "4"], timeout=300, cwd=cwd, env=_plain_env(NORIA_CACHE=str(cache)))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_installed_console_script_generates(venv: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    text = _generate([str(venv / "bin/noria")], tmp_path, cache)
    assert text.strip(), "no text printed"
    # Reference: this checkout's code on the same demo model, greedy, so the text must agree.
    here = [sys.executable, "-c", "import sys; from noria.cli import main; sys.exit(main(sys.argv[1:]))"]
    assert text == _generate(here, tmp_path, cache)

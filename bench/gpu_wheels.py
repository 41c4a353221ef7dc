"""`bin/gpu-session --pack-wheels DIR`, on a CPU host with PyPI: the wheels of noria's runtime
dependencies that the GPU machine's image lacks, for its Python (cp312, manylinux x86_64), into
DIR (git-ignored: the device tool carries it when `carry` names it); then the `carry` list and
the device command to paste.

The image's packages are the device tool's KINDS.md list ("Python packages already there",
nvidia-h200), kept here as IMAGE_PACKAGES: nothing can be installed there from a registry, and a
package is carried only when the image has none of it. The versions carried are the ones
installed here (what the tests ran), else the newest that pyproject.toml allows; each wheel's
own requirements are followed the same way. The total must stay well under the 64 MiB the tool
carries with the working tree.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The device image's Python packages: the device tool's KINDS.md, "Python packages already there"
# (nvidia-h200, as read on a machine running the image on 2026-11-17). Update both together.
# Pasted as it reads there, comma-separated; compared by canonical name.
_KINDS_PACKAGES = """
absl-py, accelerate, aiofiles, aiohappyeyeballs, aiohttp, aiosignal, annotated-doc, anyio, attrs, botorch,
build, certifi, charset-normalizer, chex, click, cloudpickle, cmake, colorama, contourpy, coverage,
cuda-bindings, cuda-core, cuda-pathfinder, cuda-toolkit, cupy-cuda13x, cycler, cython, diffrax, e3nn, einops,
equinox, etils, execnet, filelock, flatbuffers, flax, fonttools, formulaic, frozenlist, fsspec, gpytorch,
grpcio, h11, h5py, hf-xet, httpcore, httpx, huggingface-hub, humanize, hypothesis, idna, imageio, iniconfig,
interface-meta, jax, jax-cuda13-pjrt, jax-cuda13-plugin, jaxlib, jaxtyping, jinja2, joblib, kiwisolver,
lazy-loader, lightning, lightning-utilities, linear-operator, lineax, llvmlite, lxml, markdown, markdown-it-py,
markupsafe, matplotlib, mdurl, meson, ml-dtypes, mpi4py, mpmath, msgpack, multidict, multipledispatch,
mypy-extensions, nanobind, narwhals, networkx, ninja, numba, numba-cuda, numpy, numpyro, nvidia-cublas,
nvidia-cuda-cupti, nvidia-cuda-nvrtc, nvidia-cuda-runtime, nvidia-cudnn-cu13, nvidia-cufft, nvidia-cufile,
nvidia-curand, nvidia-cusolver, nvidia-cusparse, nvidia-cusparselt-cu13, nvidia-ml-py, nvidia-nccl-cu13,
nvidia-nvjitlink, nvidia-nvshmem-cu13, nvidia-nvtx, onnx, onnx-ir, onnxruntime, onnxscript,
opencv-python-headless, optax, opt-einsum, opt-einsum-fx, optimistix, orbax-checkpoint, packaging, pandas,
pathspec, patsy, peft, pillow, pip, pluggy, portalocker, prometheus-client, propcache, protobuf, psutil,
pyarrow, pybind11, py-cpuinfo, pygments, pyparsing, pyproject-hooks, pyre-extensions, pytest, pytest-benchmark,
pytest-cov, pytest-mock, pytest-timeout, pytest-xdist, python-dateutil, pytorch-lightning, pyyaml, regex,
requests, rich, sacrebleu, safetensors, scikit-build-core, scikit-image, scikit-learn, scipy, seaborn,
sentencepiece, sentence-transformers, setuptools, shellingham, simplejson, six, sortedcontainers, statsmodels,
sympy, tabulate, tensorboard, tensorboard-data-server, tensorstore, threadpoolctl, tifffile, tiktoken, timm,
tokenizers, toolz, torch, torchaudio, torchdiffeq, torch-geometric, torchmetrics, torchvision, tqdm,
transformers, treescope, triton, typer, typing-extensions, typing-inspect, urllib3, uvloop, wadler-lindig,
werkzeug, wheel, wrapt, xarray, xxhash, yarl, zipp
"""
IMAGE_PACKAGES = frozenset(re.sub(r"[-_.]+", "-", n.strip()).lower() for n in _KINDS_PACKAGES.split(",") if n.strip())
# Versions KINDS.md's pip list gives for the image: the code must run under these, not the pins.
IMAGE_VERSIONS = {"python": "3.12.3", "torch": "2.11.0", "transformers": "5.17.0", "tokenizers": "0.23.2",
                  "safetensors": "0.8.0", "numpy": "2.5.2", "cupy-cuda13x": "14.2.0", "huggingface-hub": "1.33.0",
                  "triton": "3.6.0"}
# What the GPU phases need beside the runtime: the [cuda] extra and the tests' runner.
GPU_EXTRAS = ("cuda",)
GPU_TEST_REQUIREMENTS = ("pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100")

PYTHON_VERSION = "3.12"
# pip matches manylinux_2_N exactly: every N the image's glibc (Ubuntu 24.04: 2.39) runs.
PLATFORMS = ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in range(5, 40)))
CARRY_LIMIT = 64 << 20  # the device tool: the working tree and every carried path, together
WHEELS_BUDGET = 24 << 20  # "well under": the tree travels beside them
DEFAULT_DIR = ".gpu-wheels"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return canonical(re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0])


def runtime_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in GPU_EXTRAS:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    return reqs + list(GPU_TEST_REQUIREMENTS)


def missing_on_image(reqs: list[str]) -> list[str]:
    """The requirements whose distribution the image has none of."""
    return [r for r in reqs if requirement_name(r) not in IMAGE_PACKAGES]


def pinned(req: str) -> str:
    """`name==version` as installed here, else the requirement as written (pip picks)."""
    name = requirement_name(req)
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return req.split(";")[0].strip()


def wheel_requirements(wheel: Path) -> list[str]:
    """A wheel's Requires-Dist that apply on the image (CPython 3.12, Linux, no extras)."""
    from packaging.requirements import Requirement

    env = {"python_version": PYTHON_VERSION, "python_full_version": IMAGE_VERSIONS["python"],
           "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "os_name": "posix", "extra": ""}
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append(str(req).split(";")[0])
    return out


def download(reqs: list[str], dest: Path) -> list[Path]:
    before = set(dest.glob("*.whl"))
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           PYTHON_VERSION, "--implementation", "cp", *plats, "-d", str(dest), *reqs]
    print("$", " ".join(cmd[:4]), "...", " ".join(reqs), flush=True)
    subprocess.run(cmd, check=True)
    return sorted(set(dest.glob("*.whl")) - before)


def tree_bytes() -> int:
    """What the device tool sends besides the carried paths: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return sum((ROOT / f).stat().st_size for f in out.split("\0") if f and (ROOT / f).is_file())


def pack(dest: Path) -> int:
    dest = dest if dest.is_absolute() else Path.cwd() / dest
    dest.mkdir(parents=True, exist_ok=True)
    try:
        rel = dest.resolve().relative_to(ROOT)
    except ValueError:
        print(f"--pack-wheels: {dest} is outside the repository; the device tool carries only paths inside it")
        return 2
    if subprocess.run(["git", "check-ignore", "-q", str(rel)], cwd=ROOT).returncode != 0:
        print(f"--pack-wheels: {rel} is not git-ignored; add it to .gitignore (`{DEFAULT_DIR}/` is) so that it "
              "travels only when `carry` names it")
        return 2
    for old in dest.glob("*.whl"):  # one version of each: two stop the whole install
        old.unlink()
    print(f"the image (the device tool's KINDS.md): Python {IMAGE_VERSIONS['python']}, " +
          ", ".join(f"{k} {v}" for k, v in IMAGE_VERSIONS.items() if k != "python"))
    here = {k: _version(k) for k in IMAGE_VERSIONS if k != "python"}
    differ = [f"{k} {here[k]} here, {v} there" for k, v in IMAGE_VERSIONS.items() if k in here and here[k] != v]
    if differ:
        print("  differs from this host (the code must run under the image's): " + "; ".join(differ))
    wanted = [pinned(r) for r in missing_on_image(runtime_requirements())]
    seen = {requirement_name(r) for r in wanted}
    wheels: list[Path] = []
    while wanted:
        got = download(wanted, dest)
        wheels += got
        wanted = []
        for w in got:
            for r in missing_on_image(wheel_requirements(w)):
                if requirement_name(r) not in seen:
                    seen.add(requirement_name(r))
                    wanted.append(pinned(r))
    total, tree = sum(w.stat().st_size for w in wheels), tree_bytes()
    for w in wheels:
        print(f"  {w.name}  {w.stat().st_size / 2**20:.2f} MiB")
    print(f"{len(wheels)} wheels, {total / 2**20:.2f} MiB; with the working tree ({tree / 2**20:.2f} MiB): "
          f"{(total + tree) / 2**20:.2f} of the {CARRY_LIMIT >> 20} MiB the device tool carries")
    if total > WHEELS_BUDGET or total + tree > CARRY_LIMIT:
        print(f"--pack-wheels: too large (wheels over {WHEELS_BUDGET >> 20} MiB, or all over {CARRY_LIMIT >> 20} MiB)")
        return 1
    flag = "" if str(rel) == DEFAULT_DIR else f" --wheels {rel}"
    print("\nOn the device (the tool's run; the session ends within 8 minutes, so 560 s leaves it room):")
    print(f'  carry: ["{rel}"]')
    print(f"  command: bin/gpu-session{flag}")
    print("  timeout_s: 560")
    print("Again for some phases, within the 30 s a machine stays warm: the same carry and, e.g., "
          f"bin/gpu-session{flag} --phases tests,kernels --time-budget 200 (the install runs first again: seconds)")
    return 0


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None

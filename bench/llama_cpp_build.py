"""llama.cpp's build and its GGUF files, made under `$NORIA_CACHE/llama-cpp/` (bench/llama_cpp.py
says how and why): where each lives, the pinned llama-cpp-python sdist fetched and checked, its
vendored llama.cpp built with cmake (`llama-server` alone), the GGUF converter's own venv, and a
checkpoint converted to GGUF once per type: "f32", "bf16" and "q8_0" by the converter itself,
"q4_k_m" by `llama-quantize` from the checkpoint's own float type (f32, or bf16 for a bfloat16
checkpoint), as llama.cpp's users make it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

from noria.protocol import switches

VERSION = "0.3.36"  # llama-cpp-python; its sdist vendors llama.cpp at one commit
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SIMPLE_INDEX = "https://pypi.org/simple/llama-cpp-python/"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF", "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary in the cache
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
    # The web UI is either built with npm or downloaded from Hugging Face at build time: neither
    # is wanted (nor reachable here); the server then serves its API alone.
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",  # loopback HTTP only
)


def root() -> Path:
    return switches.cache_dir() / "llama-cpp"


def build_dir(base: Path | None = None) -> Path:
    return (base or root()) / VERSION


# The targets built: the server, and the quantizer that makes the K-quant GGUF files.
TARGETS = ("llama-server", "llama-quantize")


def server_binary(base: Path | None = None) -> Path:
    return build_dir(base) / "build" / "bin" / "llama-server"


def quantize_binary(base: Path | None = None) -> Path:
    return build_dir(base) / "build" / "bin" / "llama-quantize"


def source_dir(base: Path | None = None) -> Path:
    return build_dir(base) / "src"


def build_info(base: Path | None = None) -> dict | None:
    """What setup recorded about the build (None until a build completed)."""
    path = build_dir(base) / "build.json"
    if not path.exists() or not server_binary(base).exists():
        return None
    return json.loads(path.read_text())


def convert_python(base: Path | None = None) -> Path:
    return (base or root()) / "convert-venv" / "bin" / "python"


def _converter_ready(base: Path) -> bool:
    return (convert_python(base).parent.parent / "ready").exists()


def _unsupported() -> str | None:
    """Why llama.cpp cannot be built here, or None."""
    missing = [t for t in ("cmake", "c++", "cc") if shutil.which(t) is None]
    if missing:
        return f"no {', '.join(missing)} on PATH to build llama.cpp"
    return None


def cmake_commands(src: Path, build: Path, commit: str, jobs: int) -> list[list[str]]:
    """The configure and build commands: only the `llama-server` and `llama-quantize` targets are built."""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    return [["cmake", "-S", str(src), "-B", str(build), *generator, *CMAKE_FLAGS,
             f"-DLLAMA_BUILD_COMMIT={commit}", "-DLLAMA_BUILD_NUMBER=0"],
            ["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(jobs)]]


def _download(dest: Path, log) -> None:
    """The pinned sdist, through PyPI's JSON simple API (PEP 691), checked against SDIST_SHA256."""
    req = urllib.request.Request(SIMPLE_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.loads(r.read())["files"]
    [entry] = [f for f in files if f["filename"] == SDIST]
    print(f"downloading {entry['url']} ...", file=log, flush=True)
    tmp = dest.with_suffix(".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(entry["url"], timeout=300) as r, open(tmp, "wb") as f:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != SDIST_SHA256:
        tmp.unlink()
        raise RuntimeError(f"{SDIST}: sha256 {digest.hexdigest()}, expected {SDIST_SHA256}")
    tmp.rename(dest)


def _extract(sdist: Path, src: Path) -> str:
    """vendor/llama.cpp of the sdist into `src`; the llama.cpp commit the sdist's submodule pins."""
    top = f"llama_cpp_python-{VERSION}/"
    vendor = top + "vendor/llama.cpp/"
    head = top + ".git/modules/vendor/llama.cpp/HEAD"
    tmp = src.with_name(src.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    commit = "unknown"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if m.name == head:
                commit = tar.extractfile(m).read().decode().strip()  # type: ignore[union-attr]
            elif m.name.startswith(vendor) and m.name != vendor + ".git":  # a submodule's gitdir link
                m.name = m.name[len(vendor):]
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(src, ignore_errors=True)
    tmp.rename(src)
    return commit


def setup(install: bool = True, base: Path | None = None, jobs: int | None = None, log=sys.stderr) -> str | None:
    """Build llama-server, llama-quantize and the converter's venv if needed. None when ready, else why not."""
    base = base or root()
    built = build_info(base) is not None
    if built and quantize_binary(base).exists() and _converter_ready(base):
        return None
    if not install:
        what = "llama-quantize in the llama.cpp build" if built else "llama.cpp build"
        return (f"no {what} from llama-cpp-python {VERSION} in {build_dir(base)} "
                f"(make it with `python -m noria.bench.llama_cpp setup`)")
    why = _unsupported()
    if why:
        return why
    jobs = jobs or max(1, (os.cpu_count() or 1))
    try:
        if not built:
            _build(base, jobs, log)
        elif not quantize_binary(base).exists():  # a build from before the quantizer was a target
            print("building llama-quantize in the existing llama.cpp build ...", file=log, flush=True)
            build = build_dir(base) / "build"
            subprocess.run(["cmake", "--build", str(build), "--target", "llama-quantize", "-j", str(jobs)],
                           stdout=log, stderr=log, check=True)
        if not _converter_ready(base):
            _converter_venv(base, log)
    except (OSError, RuntimeError, subprocess.CalledProcessError, ValueError) as e:
        return f"llama.cpp setup failed: {e}"
    return None


def _build(base: Path, jobs: int, log) -> None:
    out = build_dir(base)
    out.mkdir(parents=True, exist_ok=True)
    sdist = base / SDIST
    if not sdist.exists():
        _download(sdist, log)
    commit = _extract(sdist, source_dir(base))
    print(f"building llama-server and llama-quantize (llama.cpp {commit[:12]}, from llama-cpp-python {VERSION}) "
          f"with {jobs} jobs: several minutes ...", file=log, flush=True)
    for cmd in cmake_commands(source_dir(base), out / "build", commit[:8], jobs):
        subprocess.run(cmd, stdout=log, stderr=log, check=True)
    version = subprocess.run([str(server_binary(base)), "--version"], capture_output=True, text=True, timeout=60)
    cc = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    (out / "build.json").write_text(json.dumps({
        "llama_cpp_python": VERSION, "sdist_sha256": SDIST_SHA256, "llama_cpp_commit": commit,
        "server_version": (version.stdout + version.stderr).strip(), "compiler": cc[0] if cc else "",
        "cmake_flags": list(CMAKE_FLAGS)}, indent=2))


def _converter_requirements(src: Path) -> list[str]:
    """The converter's own pinned requirements (requirements/requirements-convert_*.txt) less
    torch, gguf and index options: torch is pinned to noria's CPU build instead (PyPI's default
    torch wheel is the CUDA one, gigabytes), and gguf comes from the same source tree."""
    out: list[str] = []
    for name in ("requirements-convert_hf_to_gguf.txt", "requirements-convert_legacy_llama.txt"):
        for line in (src / "requirements" / name).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-") and not line.startswith(("torch", "gguf")):
                out.append(line)
    return out


def _noria_torch() -> str:
    import importlib.metadata

    return importlib.metadata.version("torch")


def _converter_venv(base: Path, log) -> None:
    py = convert_python(base)
    venv = py.parent.parent
    shutil.rmtree(venv, ignore_errors=True)
    src = source_dir(base)
    print(f"making the GGUF converter's venv in {venv} ...", file=log, flush=True)
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    subprocess.run([sys.executable, "-m", "venv", str(venv)], stdout=log, stderr=log, check=True)
    torch = f"torch=={_noria_torch()}"
    if subprocess.run([*pip, torch], stdout=log, stderr=log).returncode != 0:
        subprocess.run([*pip, "--extra-index-url", "https://download.pytorch.org/whl/cpu", torch],
                       stdout=log, stderr=log, check=True)
    # gguf-py's own needs; the converter puts the source tree's gguf-py on its path itself.
    needs = [*_converter_requirements(src), "tqdm", "pyyaml", "requests", "safetensors"]
    subprocess.run([*pip, *needs], stdout=log, stderr=log, check=True)
    (venv / "ready").write_text(json.dumps(needs + [torch]))


# --- GGUF -------------------------------------------------------------------------------------


def pre_tokenizer(checkpoint: Path) -> str | None:
    """"gpt-2" where tokenizer.json is a byte-level BPE whose pre-tokenizer is exactly GPT-2's
    (ByteLevel with its regex, nothing else): the name llama.cpp gives that pre-tokenizer.
    None otherwise (the converter's own table then decides)."""
    path = checkpoint / "tokenizer.json"
    if not path.exists():
        return None
    tok = json.loads(path.read_text())
    pre = tok.get("pre_tokenizer") or {}
    if (tok.get("model") or {}).get("type") == "BPE" and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    return None


def _fingerprint(checkpoint: Path) -> str:
    """The checkpoint's files (name, size, mtime): a rebuilt checkpoint gets new GGUF files."""
    h = hashlib.sha256(str(checkpoint.resolve()).encode())
    for f in sorted(checkpoint.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


# The GGUF types a checkpoint is made into: the converter's own outtypes, and llama-quantize's
# types, each quantized from a converted float file (QUANTIZE_FROM).
CONVERT_TYPES = ("f32", "bf16", "q8_0")
QUANTIZE_TYPES = {"q4_k_m": "Q4_K_M"}
GGUF_TYPES = (*CONVERT_TYPES, *QUANTIZE_TYPES)


def gguf_path(checkpoint: Path, outtype: str, base: Path | None = None) -> Path:
    return (base or root()) / "gguf" / VERSION / f"{checkpoint.name}-{_fingerprint(checkpoint)}-{outtype}.gguf"


def convert_command(checkpoint: Path, outtype: str, out: Path, base: Path | None = None) -> list[str]:
    pre = pre_tokenizer(checkpoint)
    return [str(convert_python(base)), str(Path(__file__).with_name("llama_cpp_convert.py")), str(source_dir(base)),
            str(checkpoint), *(["--pre", pre] if pre else []), "--", "--outtype", outtype, "--outfile", str(out)]


def quantize_from(checkpoint: Path) -> str:
    """The float GGUF type llama-quantize reads for `checkpoint`: its own weights' type, so the
    float file holds them exactly (bf16 for a bfloat16 checkpoint, f32 otherwise)."""
    config = json.loads((checkpoint / "config.json").read_text()) if (checkpoint / "config.json").exists() else {}
    dtype = config.get("torch_dtype") or config.get("dtype")
    return "bf16" if dtype == "bfloat16" else "f32"


def quantize_command(src: Path, out: Path, outtype: str, n_threads: int, base: Path | None = None) -> list[str]:
    """llama-quantize's command line: `src` (a float GGUF) to `out` of `outtype` ("q4_k_m"), its
    default mix (no importance matrix), on `n_threads` threads."""
    return [str(quantize_binary(base)), str(src), str(out), QUANTIZE_TYPES[outtype], str(n_threads)]


def convert(checkpoint: Path, outtype: str, base: Path | None = None, log=sys.stderr) -> Path:
    """The checkpoint as a GGUF of `outtype` (GGUF_TYPES), converted once and cached."""
    if outtype not in GGUF_TYPES:
        raise ValueError(f"no GGUF type {outtype!r} (made here: {', '.join(GGUF_TYPES)})")
    out = gguf_path(checkpoint, outtype, base)
    if out.exists():
        return out
    if outtype in QUANTIZE_TYPES:
        src = convert(checkpoint, quantize_from(checkpoint), base, log)
        cmd = quantize_command(src, out.with_name(out.name + ".part"), outtype, os.cpu_count() or 1, base)
        how = f"quantizing {src.name} to {QUANTIZE_TYPES[outtype]}"
    else:
        cmd = convert_command(checkpoint, outtype, out.with_name(out.name + ".part"), base)
        how = f"converting {checkpoint} to GGUF ({outtype})"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{how} ...", file=log, flush=True)
    subprocess.run(cmd, stdout=log, stderr=log, check=True)
    out.with_name(out.name + ".part").rename(out)
    return out

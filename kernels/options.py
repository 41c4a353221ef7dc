"""Compile options and source locations, fixed in one place for every consumer: the CuPy
loader, the offline NVRTC check and the CPU emulator all build the same text the same way."""

from __future__ import annotations

from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"

# Architectures the compile check covers (A100, H100).
ARCHS: tuple[str, ...] = ("80", "90")

# Asks ptxas for per-kernel registers, shared memory and spills (printed in the NVRTC log).
PTXAS_VERBOSE: tuple[str, ...] = ("-Xptxas", "-v")


def compile_options(source_dir: Path = SOURCE_DIR) -> tuple[str, ...]:
    """Options for cupy.RawModule(options=...). CuPy itself adds the CUDA include path,
    -ftz=true, -arch and --device-as-default-execution-space."""
    return ("-std=c++17", f"-I{Path(source_dir).resolve()}")


def read_source(name: str, source_dir: Path = SOURCE_DIR) -> str:
    return (Path(source_dir) / name).read_text()

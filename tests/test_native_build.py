"""worker/native_build.py: the cached library of a C file is keyed by the headers it includes too.

paged_decode.c keeps its fp8 cache code in paged_decode_fp8.h; an edit there alone must give a
new library, not the cached one built before it."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from noria.worker import native_build


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("NORIA_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _value(src: Path) -> int:
    dll = native_build.build(src, ["-O1", "-shared", "-fPIC"])
    assert dll is not None, native_build.failure(src)
    dll.value.restype = ctypes.c_int
    return int(dll.value())


def test_an_edited_header_rebuilds_the_library(cache: Path) -> None:
    src, outer, inner = cache / "k.c", cache / "k_part.h", cache / "k_inner.h"
    src.write_text('#include "k_part.h"\nint value(void) { return PART + INNER; }\n')
    outer.write_text('#include "k_inner.h"\n#define PART 1\n')
    inner.write_text("#define INNER 10\n")
    assert _value(src) == 11
    outer.write_text('#include "k_inner.h"\n#define PART 2\n')
    assert _value(src) == 12
    inner.write_text("#define INNER 20\n")  # included by the header: keyed too
    assert _value(src) == 22
    built = sorted(p.name for p in (cache / "cache" / "cpu-kernels").glob("k-*.so"))
    assert len(built) == 3
    outer.write_text('#include "k_inner.h"\n#define PART 1\n')
    inner.write_text("#define INNER 10\n")
    assert _value(src) == 11  # the first build's library, from the cache
    assert sorted(p.name for p in (cache / "cache" / "cpu-kernels").glob("k-*.so")) == built


def test_a_source_that_includes_itself_through_headers_is_keyed_once(cache: Path) -> None:
    src, header = cache / "r.c", cache / "r.h"
    header.write_text('#ifndef R_H\n#define R_H\n#include "r.h"\n#define R 3\n#endif\n')
    src.write_text('#include "r.h"\n#include "r.h"\nint value(void) { return R; }\n')
    assert _value(src) == 3

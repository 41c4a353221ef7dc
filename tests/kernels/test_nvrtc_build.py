"""Every kernel and template instance compiles through cupy.RawModule's NVRTC call for sm_80
and sm_90 with -Xptxas -v; no spills; the per-kernel resources go into kernels/README.md."""

from __future__ import annotations

import nvrtc_runs
import pytest

from noria.kernels import instances, nvrtc_check, readme_tables
from noria.kernels.options import ARCHS, SOURCE_DIR


@pytest.fixture(scope="module")
def records(request: pytest.FixtureRequest) -> list[nvrtc_check.CompileRecord]:
    runs = request.config.stash.get(nvrtc_runs.RUNS_KEY, None) or nvrtc_runs.start()
    return nvrtc_runs.collect(runs)


def test_every_instance_compiles_for_every_arch(records: list[nvrtc_check.CompileRecord]) -> None:
    wanted = instances.all_instances()
    for arch in ARCHS:
        for source, names in wanted.items():
            [rec] = [r for r in records if r.arch == arch and r.source == source]
            assert rec.cubin_bytes > 0
            assert sorted(u.name for u in rec.usage) == sorted(names), (arch, source)


def test_no_spills_and_shared_memory_fits(records: list[nvrtc_check.CompileRecord]) -> None:
    usage = [u for r in records for u in r.usage]
    spilled = [u for u in usage if u.spill_stores or u.spill_loads or u.stack_bytes]
    assert not spilled, f"register spills / local memory: {spilled}"
    # Static shared memory above 48 KB does not even launch without an opt-in.
    assert max(u.shared_bytes for u in usage) <= 48 * 1024
    # 128-thread CTAs: more than 255 registers would not compile, more than 128 halves
    # occupancy; flag it so that a change that bloats a kernel is noticed. The tensor-core
    # prefill kernel keeps a warp's Q fragments and O accumulators in registers by design
    # (FlashAttention-2), about 250 at head size 256; it asks ptxas for one CTA per SM.
    flat = [u for u in usage if not u.name.startswith("paged_attention_prefill_tc<")]
    assert max(u.registers for u in flat) <= 128
    assert max(u.registers for u in usage) <= 255


def test_nvrtc_gets_rawmodules_options(records: list[nvrtc_check.CompileRecord]) -> None:
    """Guards the CuPy patch: if an upgrade changed RawModule's path, this notices."""
    import cupy

    assert cupy.__version__ == nvrtc_check.CUPY_VERSION
    for r in records:
        opts = r.nvrtc_options
        assert f"-arch=sm_{r.arch}" in opts
        for expected in (
            "-std=c++17",
            f"-I{SOURCE_DIR}",
            "-Xptxas",
            "-v",
            "-ftz=true",
            "--device-as-default-execution-space",
        ):
            assert expected in opts, (expected, opts)


def test_resource_table_in_readme(records: list[nvrtc_check.CompileRecord]) -> None:
    table = readme_tables.resource_table([u for r in records for u in r.usage])
    readme_tables.update_readme("resources", table)
    assert table in readme_tables.README.read_text()


def test_compile_errors_surface(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check really compiles: a broken kernel fails with NVRTC's message."""
    from cupy.cuda.compiler import CompileException

    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    code = "template <typename T> __global__ void k(T* x) { x[0] = undefined_name; }"
    with nvrtc_check.offline_nvrtc("90"), pytest.raises(CompileException, match="undefined_name"):
        nvrtc_check.rawmodule_compile(code, ("-std=c++17",), ["k<float>"])

"""The native float32 GEMM (worker/csrc/gemm_f32.c) against a float64 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from noria.worker import cpu_kernels, cpu_ops, fused_kernels, gemm_kernels, native_stack
from noria.worker.gemm_kernels import PackedWeight, gemm
from noria.worker.models.layers import RMSNorm
from noria.worker.models.linear import TorchLinear, linear_op
from noria.worker.models.ops import TorchOps, choose_ops

pytestmark = pytest.mark.skipif(gemm_kernels.load() is None, reason="no C compiler: the native GEMM is not built")


def _nr() -> int:
    dll = gemm_kernels.load()
    assert dll is not None
    return int(dll.gemm_nr())


# Odd sizes on purpose: row counts around the 6-row register tile and the
# 192-row block, output features around the panel width (a zero-padded tail
# panel), reduction lengths that are not a multiple of any vector width.
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 31, 64, 191, 193, 400])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 3), (15, 17), (33, 64), (100, 129), (257, 200)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_float64(rows: int, out_features: int, in_features: int, with_bias: bool) -> None:
    torch.manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    x = torch.randn(rows, in_features)
    got = gemm(x, PackedWeight(weight), bias)
    want = x.double() @ weight.double().T + (bias.double() if bias is not None else 0)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * in_features**0.5)


def test_strided_rows_and_thread_counts_give_identical_results() -> None:
    """Rows read through a row stride (a slice of a wider tensor) and any thread
    count: every output is the same in-order sum, so bit for bit the same."""
    torch.manual_seed(0)
    weight = torch.randn(3 * _nr() + 5, 96)
    wide = torch.randn(37, 200)
    x = wide[:, 10:106]
    assert not x.is_contiguous()
    packed = PackedWeight(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm(x, packed, None)
        torch.set_num_threads(max(2, threads))
        many = gemm(x, packed, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    assert torch.equal(one, gemm(x.contiguous(), packed, None))
    # A row's result does not depend on the other rows of its batch.
    assert torch.equal(one[5:6], gemm(x[5:6], packed, None))


def _has_fma() -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return " fma" in flags


# Every row count from 1 to 2 x 6 + 1 (each tile height 1-6 and each mix of them
# as M is cut into near-equal tiles), the decode sizes 16-63 with their ragged
# ends, and both sides of the 192-row block.
@pytest.mark.skipif(not _has_fma(), reason="the kernel's sums are fused multiply-adds only where the CPU has FMA")
@pytest.mark.parametrize("rows", [*range(1, 14), 16, 17, 18, 19, 23, 24, 25, 31, 32, 47, 48, 63, 64, 192, 197])
def test_every_output_is_one_in_order_fused_sum(rows: int) -> None:
    """Bit for bit, each output is fma(x[k], w[k], acc) for k = 0..K-1 in order, then + bias:
    emulated here in float64 (a float32 product is exact there), rounded to float32 per step."""
    torch.manual_seed(rows)
    nr = _nr()
    out_features, in_features = 3 * nr + 7, 37  # three full panels and a ragged tail one
    weight, x, bias = torch.randn(out_features, in_features), torch.randn(rows, in_features), torch.randn(out_features)
    acc = torch.zeros(rows, out_features)
    for k in range(in_features):
        acc = (acc.double() + x[:, k : k + 1].double() * weight[:, k].double()).float()
    packed = PackedWeight(weight)
    assert torch.equal(gemm(x, packed, None), acc)
    assert torch.equal(gemm(x, packed, bias), acc + bias)


@pytest.mark.parametrize("rows", [1, 7, 16, 18, 31, 48, 63, 200])
def test_results_do_not_depend_on_threads_or_batch_neighbours(rows: int) -> None:
    """Threads split the panels (here more threads than panels too); every row is
    the same bits whatever the thread count and whichever rows share its batch."""
    torch.manual_seed(rows)
    weight, x = torch.randn(5 * _nr() + 3, 131), torch.randn(rows, 131)
    packed = PackedWeight(weight)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            results.append(gemm(x, packed, None))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert torch.equal(results[0], other)
    for lo, hi in ((0, 1), (rows // 2, rows), (rows - 1, rows)):
        assert torch.equal(gemm(x[lo:hi], packed, None), results[0][lo:hi])


def test_empty_batch() -> None:
    out = gemm(torch.empty(0, 8), PackedWeight(torch.randn(4, 8)), None)
    assert out.shape == (0, 4)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    gemm_kernels.load.cache_clear()
    monkeypatch.setenv("NORIA_DISABLE_CPU_GEMM", "1")
    try:
        assert gemm_kernels.load() is None
        assert not gemm_kernels.usable(torch.randn(4, 4))
    finally:
        monkeypatch.delenv("NORIA_DISABLE_CPU_GEMM")
        gemm_kernels.load.cache_clear()


def test_no_compiler_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No compiler (and nothing built yet): every CPU op family on torch, and the layers still compute."""
    monkeypatch.setenv("NORIA_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    loads = (gemm_kernels.load, fused_kernels.load, cpu_kernels.load, native_stack.load)
    for load in loads:
        load.cache_clear()
    try:
        assert gemm_kernels.load() is None and fused_kernels.load() is None
        why = f"torch (no C compiler at {tmp_path / 'no-such-compiler'})"
        assert cpu_ops.paths() == {"gemm": why, "fused": why, "attention": why, "stack": why}
        weight, x = torch.randn(24, 16), torch.randn(5, 16)
        op = linear_op(weight)
        assert isinstance(op, TorchLinear)
        torch.testing.assert_close(op(x, None), x @ weight.T, rtol=1e-5, atol=1e-5)
        ops = choose_ops("silu", torch.device("cpu"), torch.float32)
        assert type(ops) is TorchOps
        norm = RMSNorm(16, 1e-6)
        norm.weight.data.fill_(1.0)
        out, residual = ops.add_norm(x.clone(), x, norm)
        assert torch.equal(residual, x + x)
        torch.testing.assert_close(out, norm(x + x))
        assert torch.equal(fused_kernels.argmax_rows(x), x.argmax(dim=-1))
    finally:
        for load in loads:
            load.cache_clear()

"""The FP8 weight GEMMs: the native CPU kernel (worker/gemm_fp8_kernels.py) on every build, and
the `_scaled_mm` kind (worker/models/quant_fp8.py, the GPU's; torch's CPU computes the same
row-wise recipe), each against float64 products of the dequantized weights (and, for the native
kernel's "dot" layout, of x rounded to bf16 as that layout rounds it)."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from noria.protocol import switches
from noria.protocol.quant_config import WeightScheme
from noria.worker import gemm_fp8_kernels, gemm_quant_kernels
from noria.worker.gemm_fp8_kernels import PackedFp8Weight, gemm_fp8
from noria.worker.models.quant_fp8 import ScaledMmFp8, quantize_acts, quantize_rows_fp8
from noria.worker.models.quant_linear import QuantLinear
from tests.bf16_rounding import check_rounded, rounding_rows

pytestmark = pytest.mark.skipif(not gemm_fp8_kernels.usable(), reason="no C compiler for the native kernels")
X86 = platform.machine() in ("x86_64", "AMD64")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


def _weights(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values over their whole range (subnormals and both signs; no NaN) and positive scales."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 200).clamp(-448, 448)
    q = q.to(torch.float8_e4m3fn)
    return q, torch.rand(n, k // group, generator=g) * 0.01 + 1e-4


def _want(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int, bias: torch.Tensor | None,
          rounded: bool = False) -> torch.Tensor:
    """float64 x @ (q * scale).T (+ bias); `rounded`: x rounded to bf16 first (to nearest even)."""
    w = q.double() * scale.double().repeat_interleave(group, dim=1)
    y = (x.to(torch.bfloat16) if rounded else x).double() @ w.T
    return y if bias is None else y + bias.double()


def _check(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel of the loaded build against float64 on the x its layout multiplies."""
    dot = gemm_fp8_kernels.layout() == "dot"
    got = gemm_fp8(x, PackedFp8Weight(q, scale, group), bias)
    want = _want(x, q, scale, group, bias, rounded=dot)
    # float32 sums of K products: a few units of float32 rounding of the largest partial sums.
    bound = 4e-7 * x.shape[1] ** 0.5 * float((x.abs().double() @ (q.double().abs() * scale.double().repeat_interleave(
        group, dim=1)).T).max() + 1)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=bound)
    if dot and x.shape[1] > 1:
        # The kernel multiplies bf16 x, not float32 x: its summation error is far below what
        # rounding x moves the result by.
        exact = _want(x, q, scale, group, bias)
        assert (got.double() - want).norm() < 1e-2 * (exact - want).norm()
    return got


# (N, K, group): an odd K (the dot layout pads its last pair), groups of odd length inside K.
SHAPES = [(37, 259, None), (70, 130, None), (45, 384, 128), (33, 256, 128), (128, 512, 128), (40, 90, 45)]


@pytest.mark.parametrize("rows", [1, 3, 16, 100])
@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_native_fp8_matches_float64(rows: int, n: int, k: int, group: int | None) -> None:
    group = group or k
    q, scale = _weights(n, k, group, rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + 1))
    _check(x, q, scale, group, torch.randn(n) if rows % 2 else None)
    # A row stride other than K, as the decoder's views give.
    wide = torch.randn(rows, k + 5)
    _check(wide[:, :k], q, scale, group, None)


def test_every_byte_widens_exactly() -> None:
    # One-hot rows of x pick single weights: y = float32(w * scale), one rounding, for all 254
    # finite e4m3 values (the subnormals too), widened to float32 or to bf16 by the layout.
    raw = torch.arange(256, dtype=torch.uint8)
    raw = raw[(raw & 0x7F) != 0x7F]
    q = raw.view(torch.float8_e4m3fn).reshape(1, -1).repeat(3, 1)
    scale = torch.tensor([[1.0], [0.375], [2.0**-20]])
    x = torch.eye(q.shape[1])
    got = gemm_fp8(x, PackedFp8Weight(q, scale, q.shape[1]), None)
    assert torch.equal(got, (q.float() * scale).T)


def test_the_dot_layout_rounds_activations_as_torch_does() -> None:
    """x's ties go to even, a NaN stays NaN, infinities and the largest finite values survive."""
    if gemm_fp8_kernels.layout() != "dot":
        pytest.skip("this build widens to float32 (no AVX512_BF16 and AVX512_VBMI)")
    x = rounding_rows()
    k = x.shape[1]
    w = PackedFp8Weight(torch.ones(1, k).to(torch.float8_e4m3fn), torch.ones(1, 1), k)
    check_rounded(x, gemm_fp8(x, w, None)[:, 0])


def test_thread_counts_and_batches_give_identical_bits() -> None:
    # 40 rows: 7 row tiles per panel (the dot layout widens each panel once, into scratch); a row
    # alone widens in registers. The same bits either way.
    q, scale = _weights(200, 384, 128, 0)
    w = PackedFp8Weight(q, scale, 128)
    x = torch.randn(40, 384)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm_fp8(x, w, None)
        torch.set_num_threads(2)
        two = gemm_fp8(x, w, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert torch.equal(gemm_fp8(x[7:8], w, None), one[7:8])  # a row alone, as in a batch


def test_unpack_round_trip_and_refusals() -> None:
    q, scale = _weights(50, 256, 128, 3)
    w = PackedFp8Weight(q, scale, 128)
    got_q, got_s = w.unpack()
    assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_s, scale)
    assert torch.equal(w.dequantize(), q.float() * scale.repeat_interleave(128, dim=1))
    nan = q.clone()
    nan.view(torch.uint8)[3, 5] = 0x7F
    with pytest.raises(ValueError, match="NaN"):
        PackedFp8Weight(nan, scale, 128)
    with pytest.raises(ValueError, match="group size 100 must divide K = 256"):
        PackedFp8Weight(q, scale, 100)
    with pytest.raises(ValueError, match=r"scales must be float \[50, 2\]"):
        PackedFp8Weight(q, scale[:, :1], 128)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        PackedFp8Weight(q.to(torch.float8_e5m2), scale, 128)
    with pytest.raises(ValueError, match="x must be float32"):
        gemm_fp8(torch.randn(2, 255), w, None)


# Builds of the same source: (-march, the path it takes, what the CPU needs to run it). x86-64-v4 is
# AVX-512 without AVX512_BF16: the widening layout on 16-float vectors.
BUILDS = [
    pytest.param((None, None, None), id="native"),
    pytest.param(("-march=x86-64-v4", "avx512", "avx512f"), id="avx512"),
    pytest.param(("-march=x86-64-v3", "avx2", "avx2"), id="avx2"),
    pytest.param(("-march=x86-64", "portable", None), id="portable"),
]


@pytest.fixture
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    march, want, needs = request.param
    if march is not None and not X86:
        pytest.skip("x86 builds")
    if needs is not None and needs not in _cpu_flags():
        pytest.skip(f"this CPU lacks {needs}")
    flags = list(gemm_fp8_kernels._FLAGS)
    if march is not None:
        flags[flags.index("-march=native")] = march
    monkeypatch.setattr(gemm_fp8_kernels, "_FLAGS", flags)
    gemm_fp8_kernels.load.cache_clear()
    try:
        if gemm_fp8_kernels.load() is None:
            pytest.skip("no compiler for this build")
        yield want or gemm_fp8_kernels.isa()
    finally:
        monkeypatch.undo()
        gemm_fp8_kernels.load.cache_clear()


CASES = [(1, 37, 259, None), (3, 45, 384, 128), (16, 70, 130, None), (100, 33, 256, 128)]


def _outputs() -> list[torch.Tensor]:
    out = []
    for rows, n, k, group in CASES:
        group = group or k
        q, scale = _weights(n, k, group, rows)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        out.append(_check(x, q, scale, group, torch.ones(n)))
    return out


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_every_build_against_float64_and_the_widening_bits(build: str) -> None:
    # Widening: every product exact, one fused multiply-add per step on every path, so every
    # widening build gives the portable C's bits. The dot layout rounds x (checked against float64
    # on the rounded x in _outputs) and has a layout id of its own.
    assert gemm_fp8_kernels.isa() == build
    layout, layout_id = gemm_fp8_kernels.layout(), int(gemm_fp8_kernels._dll().gemm_fp8_layout())
    assert layout == "dot" or layout_id >> 16 == 0
    got = _outputs()
    if layout == "dot":
        assert layout_id >> 16 == 1 and build == "avx512"
        return
    gemm_fp8_kernels.load.cache_clear()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(gemm_fp8_kernels, "_FLAGS", ["-O3", "-march=x86-64" if X86 else "-march=native", "-fopenmp",
                                               "-shared", "-fPIC"])
        assert gemm_fp8_kernels.layout() == "widen"
        portable = _outputs()
    gemm_fp8_kernels.load.cache_clear()
    for a, b in zip(got, portable, strict=True):
        assert torch.equal(a, b)


# decoder_f32.c's gemm_fn: (x, ldx, packed, bias, y, ldy, M, N, K, threads).
_GEMM_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int)


def _through_desc(kind: str, w: PackedFp8Weight, x: torch.Tensor, bias: torch.Tensor | None, ldy: int,
                  threads: int) -> torch.Tensor:
    """The native decoder driver's call of gemm_quant.c's entry `kind` on the weight's descriptor."""
    m = x.shape[0]
    y = torch.full((m, ldy), -7.0)
    assert w.desc_ptr is not None
    _GEMM_FN(gemm_quant_kernels.entry(kind))(x.data_ptr(), x.stride(0), w.desc_ptr,
                                             None if bias is None else bias.data_ptr(), y.data_ptr(), ldy, m, w.n,
                                             w.k, threads)
    assert (y[:, w.n:] == -7).all()  # nothing written past N
    return y[:, : w.n]


@pytest.mark.skipif(not gemm_quant_kernels.usable(), reason="no quantized GEMM library for the descriptor entries")
@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_the_descriptor_entries_run_the_packing_builds_kernel(build: str) -> None:
    # gemm_quant.c's entries (built natively) call the kernel whose address the descriptor holds: the
    # build that packed the panels, whose panel width (16 features on AVX2, 32 on AVX-512) another
    # build's kernel would misread. The same bits as the layer's own call.
    for rows, n, k, group in CASES:
        group = group or k
        q, scale = _weights(n, k, group, rows)
        w = PackedFp8Weight(q, scale, group)
        d = w.desc
        assert d is not None and w.desc_ptr == ctypes.addressof(d)
        assert (d.kind, d.n, d.k, d.group, d.layout) == (5, n, k, group, int(w._dll.gemm_fp8_layout()))
        assert d.fp8 == ctypes.cast(w._dll.gemm_fp8, ctypes.c_void_p).value
        x = torch.randn(rows, k + 9, generator=torch.Generator().manual_seed(rows))[:, 4 : 4 + k]
        bias = torch.randn(n) if rows % 2 else None
        want = gemm_fp8(x, w, bias)
        for kind, ldy, threads in (("any", n, 2), ("fp8", n + 5, 1), ("any", n + 64, 3)):
            assert torch.equal(_through_desc(kind, w, x, bias, ldy, threads), want), (build, rows, kind, ldy)


@pytest.mark.skipif(not gemm_quant_kernels.usable(), reason="no quantized GEMM library for the descriptor entries")
def test_the_descriptor_entries_with_k_zero() -> None:
    w = PackedFp8Weight(torch.zeros(5, 0, dtype=torch.float8_e4m3fn), torch.ones(5, 0), 1)
    bias = torch.randn(5)
    assert torch.equal(_through_desc("any", w, torch.zeros(3, 0), bias, 5, 1), bias.expand(3, 5))
    assert torch.equal(_through_desc("fp8", w, torch.zeros(3, 0), None, 5, 1), torch.zeros(3, 5))


@pytest.mark.skipif(not gemm_quant_kernels.usable(), reason="no quantized GEMM library for the descriptor entries")
@pytest.mark.parametrize("case", ["another kind's entry", "the wrong N", "no kernel"])
def test_a_descriptor_that_does_not_fit_is_refused_loudly(case: str) -> None:
    """A descriptor handed to an entry it does not fit aborts with a message, rather than read wrong."""
    call = {"another kind's entry": "f = fn(g.entry('w8a8g')); n = 4",
            "the wrong N": "f = fn(g.entry('any')); n = 3",
            "no kernel": "w.desc.fp8 = None; f = fn(g.entry('any')); n = 4"}[case]
    code = ("import ctypes, torch\n"
            "from noria.worker import gemm_quant_kernels as g\n"
            "from noria.worker.gemm_fp8_kernels import PackedFp8Weight\n"
            "w = PackedFp8Weight(torch.ones(4, 8).to(torch.float8_e4m3fn), torch.ones(4, 1), 8)\n"
            "x, y = torch.ones(1, 8), torch.zeros(1, 4)\n"
            "fn = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3"
            " + [ctypes.c_int64] * 4 + [ctypes.c_int])\n"
            f"{call}\n"
            "f(x.data_ptr(), 8, w.desc_ptr, None, y.data_ptr(), 4, 1, n, 8, 1)\n"
            "print(y)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "does not fit this entry" in out.stderr, out.stderr[-2000:]


def test_the_native_build_takes_the_cpus_widest_path() -> None:
    if switches.cpu_march() != "native":
        pytest.skip("NORIA_CPU_MARCH builds another host's instruction set")
    flags = _cpu_flags()
    want = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "f16c", "fma"} <= flags else "portable"
    assert gemm_fp8_kernels.isa() == want
    dot = {"avx512f", "avx512_bf16", "avx512vbmi"} <= flags
    assert gemm_fp8_kernels.layout() == ("dot" if dot else "widen")


def _layer(q: torch.Tensor, scale: torch.Tensor, group: int | None, act: str,
           input_scale: float | None = None) -> QuantLinear:
    scheme = WeightScheme(8, group, True, packed=False, act_int8=False, kind="fp8", layout="fp8", fp8_act=act)
    layer = QuantLinear(q.shape[1], q.shape[0], False, scheme)
    layer.qweight.data, layer.weight_scale.data = q, scale
    if input_scale is not None:
        layer.input_scale = torch.nn.Parameter(torch.full((q.shape[0], 1), input_scale), requires_grad=False)
    return layer


@pytest.mark.parametrize("rows", [1, 3, 16, 100])
@pytest.mark.parametrize(("group", "act"), [(None, "dynamic"), (None, "static"), (128, "dynamic")])
def test_scaled_mm_kind_matches_float64_of_its_rounded_activations(rows: int, group: int | None, act: str) -> None:
    n, k = 48, 384
    q, scale = _weights(n, k, group or k, rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    static = 8.0 / 448 if act == "static" else None
    op = ScaledMmFp8(_layer(q, scale, group, act, static))
    bias = torch.randn(n)
    got = op(x, bias)
    g = group or k
    want = bias.double().clone()
    for i in range(k // g):  # the activations rounded as the kind says: per token (and group), or by the static scale
        xq, sx = quantize_acts(x[:, i * g:(i + 1) * g], None if static is None else torch.tensor(static))
        want = want + (xq.double() * sx.double()) @ (q[:, i * g:(i + 1) * g].double() * scale[:, i:i + 1].double()).T
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    # And within e4m3's rounding of the float activations' product.
    exact = _want(x, q, scale, g, bias)
    assert float((got.double() - exact).abs().max()) < 0.1 * float(exact.abs().max())


def test_quantize_rules() -> None:
    w = torch.tensor([[0.0, 0.0], [1.0, -896.0], [3.0, 0.001]])
    q, s = quantize_rows_fp8(w)
    assert s.flatten().tolist() == [1.0, 2.0, (torch.tensor(3.0) / 448).item()]  # a row of zeros: 1
    assert q[1].float().tolist() == [0.5, -448.0]
    xq, sx = quantize_acts(torch.tensor([[2.0, -448.0 * 4]]), None)
    assert sx.item() == 4.0 and xq.float().tolist() == [[0.5, -448.0]]
    xq, _ = quantize_acts(torch.tensor([[1e6]]), torch.tensor(1.0))  # a static scale clamps
    assert xq.float().item() == 448.0


def test_the_scaled_mm_kind_runs_a_checkpoint_as_compressed_tensors_quantizes_it(tmp_path, monkeypatch) -> None:
    # compressed-tensors' own forward (transformers' default loading) rounds every quantized layer's
    # input to e4m3 as the GPU kind does; noria with that kind forced on the CPU lands nearer to it
    # than the float-activation model is (tests/quant_checks.py: chained rounding allows no tighter).
    pytest.importorskip("compressed_tensors")
    from noria.worker.models import quant_fp8
    from tests.fp8_checkpoints import save_compressed_fp8, transformers_logits
    from tests.quant_checks import check_logits, prompt_logits

    prompt = [1, 17, 300, 5, 88, 42, 19, 240, 7, 7, 130, 64, 3, 99]
    for strategy, acts in [("channel", "dynamic"), ("tensor", "static")]:
        path = save_compressed_fp8(tmp_path / acts, strategy, acts)
        plain, _ = prompt_logits(path, prompt)
        with monkeypatch.context() as m:
            m.setattr(quant_fp8, "choose", ScaledMmFp8)
            got, runner = prompt_logits(path, prompt)
        assert {op.kind for op in (mod.op for mod in runner.model.modules() if isinstance(mod, QuantLinear))} == {
            "scaled_mm_fp8"}
        check_logits(got, transformers_logits(path, prompt), plain)

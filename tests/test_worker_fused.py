"""The fused CPU elementwise kernels (worker/csrc/fused_f32.c) against torch and float64 references."""

from __future__ import annotations

import platform

import pytest
import torch

from noria.protocol.model_spec import RopeSpec
from noria.worker import fused_kernels
from noria.worker.models.layers import RMSNorm, RotaryEmbedding, apply_rope
from noria.worker.models.ops import CpuOps, TorchOps

pytestmark = pytest.mark.skipif(fused_kernels.load() is None, reason="no C compiler: the fused kernels are not built")


@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.parametrize("n", [1, 7, 8, 64, 100, 768])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_float64(rows: int, n: int, with_residual: bool) -> None:
    torch.manual_seed(rows * 31 + n)
    h = torch.randn(rows, n) * 3
    residual = torch.randn(rows, n) if with_residual else None
    weight = torch.randn(n)
    eps = 1e-5
    total = h.double() + (residual.double() if residual is not None else 0)
    want = weight.double() * total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps)
    got, new_residual = fused_kernels.add_rms_norm(h.clone(), residual, weight, eps)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # The residual stream is the float32 sum, exactly as torch adds it.
    want_sum = h + residual if residual is not None else h
    assert torch.equal(new_residual, want_sum)


@pytest.mark.parametrize("rows", [1, 5, 70])
def test_add_rms_norm_agrees_with_the_torch_module(rows: int) -> None:
    """The native CPU ops' fused norm and the torch ops' give the same result (to float32 rounding)."""
    torch.manual_seed(rows)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data.normal_()
    h, residual = torch.randn(rows, 96), torch.randn(rows, 96)
    fused, fused_res = CpuOps("silu").add_norm(h.clone(), residual, norm)
    assert torch.equal(fused_res, residual + h)
    plain, plain_res = TorchOps("silu").add_norm(h.clone(), residual, norm)
    assert torch.equal(plain_res, fused_res)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused, norm(residual + h), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 13, 65])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 4, 64), (4, 4, 128), (3, 1, 6), (2, 2, 34)])
def test_rope_split_is_bit_for_bit_apply_rope(rows: int, heads: int, kv_heads: int, head_dim: int) -> None:
    torch.manual_seed(rows + heads * 7 + head_dim)
    rotary = RotaryEmbedding(RopeSpec(theta=10000.0), head_dim)
    positions = torch.randint(0, 4000, (rows,))
    cos, sin = rotary.cos_sin(positions, torch.float32)
    width = (heads + 2 * kv_heads) * head_dim
    wide = torch.randn(rows, width + 5)
    qkv = wide[:, :width]  # rows through a stride, as a slice of a wider buffer
    q, k, v = fused_kernels.rope_split(qkv, cos, sin, heads, kv_heads, head_dim)
    q_ref, k_ref, v_ref = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    assert torch.equal(q, apply_rope(q_ref.reshape(rows, heads, head_dim), cos, sin))
    assert torch.equal(k, apply_rope(k_ref.reshape(rows, kv_heads, head_dim), cos, sin))
    assert torch.equal(v, v_ref.reshape(rows, kv_heads, head_dim))
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    # And apply_rope itself against float64 rotation.
    x = q_ref.reshape(rows, heads, head_dim).double()
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.double(), sin.double()
    torch.testing.assert_close(q.double(), torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 13, 65])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(16, 8, 128), (8, 1, 64), (4, 4, 128), (3, 1, 6)])
def test_qk_norm_rope_split_is_the_norm_then_the_rotary(rows: int, heads: int, kv_heads: int,
                                                        head_dim: int) -> None:
    """Qwen3's per-head q/k RMSNorm before the rotary: bit for bit the row norm kernel over each
    head followed by apply_rope, and within float32 rounding of float64 arithmetic."""
    torch.manual_seed(rows + heads * 7 + head_dim)
    rotary = RotaryEmbedding(RopeSpec(theta=1000000.0), head_dim)
    cos, sin = rotary.cos_sin(torch.randint(0, 4000, (rows,)), torch.float32)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, width + 3)[:, :width] * 4
    q_w, k_w = torch.randn(head_dim), torch.randn(head_dim)
    eps = 1e-6
    q, k, v = fused_kernels.qk_norm_rope_split(qkv, cos, sin, heads, kv_heads, head_dim, q_w, k_w, eps)
    q_ref, k_ref, v_ref = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    for got, ref, n, w in ((q, q_ref, heads, q_w), (k, k_ref, kv_heads, k_w)):
        normed, _ = fused_kernels.add_rms_norm(ref.reshape(rows * n, head_dim).clone(), None, w, eps)
        assert torch.equal(got, apply_rope(normed.view(rows, n, head_dim), cos, sin))
        x = ref.reshape(rows, n, head_dim).double()
        x = w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos.double(), sin.double()
        want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v_ref.reshape(rows, kv_heads, head_dim))
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (1, 32000), (3, 7), (9, 1001), (40, 32000)])
def test_argmax_rows_is_torch_argmax(rows: int, vocab: int) -> None:
    torch.manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab + 3)[:, :vocab]  # rows through a stride
    assert torch.equal(fused_kernels.argmax_rows(logits), logits.argmax(dim=-1))


def test_argmax_rows_ties_infinities_and_nan_follow_torch() -> None:
    logits = torch.randn(6, 45)
    logits[0, 3] = logits[0, 40] = 50.0  # a tie: the first index
    logits[1] = float("-inf")  # everything masked: index 0
    logits[2, 44] = float("inf")  # in the scalar tail
    logits[3, 17] = float("nan")  # torch's answer for a NaN row
    logits[4, 20] = float("nan")
    logits[4, 21] = float("inf")
    logits[5] = 1.0
    assert torch.equal(fused_kernels.argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("rows", [1, 18, 150])
@pytest.mark.parametrize("n", [1, 7, 8, 37, 1024])
def test_silu_mul_matches_float64_as_closely_as_torch(rows: int, n: int) -> None:
    """Within 2 float32 ulps of the float64 SwiGLU, everywhere torch's F.silu(gate) * up is
    within 1 (the exp differs in its last bit); 150 x 1024 runs on two threads."""
    torch.manual_seed(rows * 7 + n)
    gate_up = torch.randn(rows, 2 * n + 5)[:, : 2 * n] * 8  # rows through a stride; |x| up to ~40
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = fused_kernels.silu_mul(gate_up)
    assert got.shape == (rows, n)
    ulp = torch.finfo(torch.float32).eps * want.abs()
    assert ((got.double() - want).abs() <= 2 * ulp + 1e-37).all()


def test_silu_mul_limits_follow_torch() -> None:
    gate = torch.tensor([-1e4, -100.0, -88.5, -87.5, -1e-30, 0.0, 3.0, 87.5, 89.0, 1e4,
                         float("inf"), float("-inf"), float("nan"), 1.0, 2.0, -2.0])
    up = torch.tensor([2.0] * 10 + [1.0, 1.0, 1.0, float("inf"), float("nan"), 0.5])
    got = fused_kernels.silu_mul(torch.cat([gate, up])[None])[0]
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(got, want, rtol=2.5e-7, atol=1e-35, equal_nan=True)  # e^88.5 overflows here, not in torch


def test_argmax_rows_many_ties_across_lanes_and_threads() -> None:
    # Few distinct values: the maximum recurs in many lanes and accumulators, where only the
    # merge by smallest index gives torch's first index; 60 x 5000 splits rows among threads.
    torch.manual_seed(0)
    logits = torch.randint(-3, 4, (60, 5000)).float()
    logits[0] = float("-inf")
    logits[1] = 0.0
    logits[1, 1::2] = -0.0  # equal to 0.0: still the first index
    logits[2, 4000:] = 9.0  # the maximum only after the first vector block
    logits[3, 37] = float("nan")  # a NaN inside the vector pass
    logits[4, :31] = -1.0  # the row's maximum in the scalar tail of a short-row-sized prefix
    assert torch.equal(fused_kernels.argmax_rows(logits), logits.argmax(dim=-1))
    short = logits[:5, :31].contiguous()  # shorter than one vector block: the scalar path
    assert torch.equal(fused_kernels.argmax_rows(short), short.argmax(dim=-1))


def _gelu_tanh_float64(gate: torch.Tensor) -> torch.Tensor:
    """gelu_pytorch_tanh by its definition, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in float64."""
    x = gate.double()
    return 0.5 * x * (1.0 + torch.tanh((2.0 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize(("rows", "n"), [(1, 1), (3, 7), (18, 37), (150, 1024)])
def test_gelu_tanh_mul_matches_float64(isa: str, rows: int, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma's GeGLU against its float64 definition, on the -march=native build and on an AVX2
    (x86-64-v3) one: within (3 + 3|a|) float32 ulps, a = 2 sqrt(2 / pi) (x + 0.044715 x^3) the
    exponent of its e^-a (the float32 rounding of a, a few ulps of it, scales the output by
    e^(a ulps)), plus the float64 tanh form's own cancellation, 1 + tanh rounding to a float64
    ulp of 1 (2^-52 |x up|). Where |gate| < 1 that is within 2 ulps, as close as torch's own
    F.gelu; 150 x 1024 runs on two threads; gate_up through a row stride."""
    if isa == "avx2":
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip("AVX2 is an x86 instruction set")
        flags = ["-march=x86-64-v3" if f == "-march=native" else f for f in fused_kernels._FLAGS]
        monkeypatch.setattr(fused_kernels, "_FLAGS", flags)
        fused_kernels.load.cache_clear()
    try:
        if fused_kernels.load() is None:
            pytest.skip("no compiler for the AVX2 build")
        torch.manual_seed(rows * 5 + n)
        gate_up = torch.randn(rows, 2 * n + 3)[:, : 2 * n] * 4  # |gate| up to ~16: outputs down to 1e-38
        gate_up[0, 0] = 0.0
        got = fused_kernels.gelu_tanh_mul(gate_up).double()
    finally:
        monkeypatch.undo()
        fused_kernels.load.cache_clear()
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = _gelu_tanh_float64(gate) * up
    a = (2.0 * (2.0 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)).abs()
    ulp = torch.finfo(torch.float32).eps * want.abs()
    tiny = torch.finfo(torch.float32).tiny + torch.finfo(torch.float64).eps * (gate * up).abs()
    assert got.shape == (rows, n)
    assert ((got - want).abs() <= (3 + 3 * a) * ulp + tiny).all()
    near = gate.abs() < 1
    assert ((got - want).abs() <= 2 * ulp + tiny)[near].all()


def test_gelu_tanh_mul_limits_and_the_tanh_forms_tail() -> None:
    """Infinities and NaN as torch's F.gelu(approximate="tanh"); and where tanh is near -1 (gate
    -3.5 to -5.5) the kernel keeps the small outputs' digits, which torch's float32 1 + tanh loses."""
    gate = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e4, -1e4, 1e-30, -1e-30])
    up = torch.ones_like(gate)
    got = fused_kernels.gelu_tanh_mul(torch.cat([gate, up])[None])[0]
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(got, want, rtol=2.5e-7, atol=1e-35, equal_nan=True)
    tail = torch.linspace(-5.5, -3.5, 64)
    got = fused_kernels.gelu_tanh_mul(torch.cat([tail, torch.ones_like(tail)])[None])[0].double()
    want = _gelu_tanh_float64(tail)
    rel = ((got - want) / want).abs()
    assert rel.max() < 1e-4 and (got < 0).all()
    torch_rel = ((torch.nn.functional.gelu(tail, approximate="tanh").double() - want) / want).abs()
    assert torch_rel.max() > 0.1  # the cancellation this kernel's form avoids

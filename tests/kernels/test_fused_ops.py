"""The fused elementwise kernels (csrc/fused_ops.cu) under the CPU emulator against float64
references: residual add + RMSNorm, rotary on the fused QKV rows with the KV-cache write,
SiLU-and-mul; float32 / float16 / bfloat16, 16-byte and one-element instances, strided rows.
Caches start NaN-filled: a slot the kernel must not write stays NaN, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from noria.kernels import fused_ops, instances, reference
from noria.kernels.instances import ModuleSpec
from noria.kernels.scenes import TORCH_DTYPES, assert_matches

DTYPES = list(TORCH_DTYPES)
schedules = pytest.mark.parametrize("schedule", ["forward", "greedy-reverse"])


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    return [instances.fused_module(params["dtype"])] if "dtype" in params else []


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {4: torch.int32, 2: torch.int16, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


# (rows, hidden, row stride of x): 16-byte accesses over several warps; one element at a time
# for a hidden size no vector divides; a row stride that breaks 16-byte alignment; a row
# longer than 1024 one-element accesses (threads loop).
NORM_SHAPES = [(3, 1024, 1024), (2, 37, 37), (2, 64, 66), (2, 1100, 1100)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}s{s[2]}")
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first"])
@schedules
def test_add_rms_norm(emu: Any, schedule: str, with_residual: bool, shape: tuple[int, int, int],
                      dtype: str) -> None:
    rows, hidden, stride = shape
    t = TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(rows, stride, generator=g) * 2).to(t)[:, :hidden]
    residual = torch.randn(rows, hidden, generator=g).to(t) if with_residual else None
    weight = (1 + 0.5 * torch.randn(hidden, generator=g)).to(t)
    expected, expected_sum = reference.add_rms_norm(x, residual, weight, 1e-5)
    x_before = x.clone()
    torch_sum = None if residual is None else residual + x  # torch's own rounding in dtype
    out = fused_ops.add_rms_norm(x, residual, weight, 1e-5, backend=emu(schedule))
    assert_matches(out, expected, dtype)
    assert same_bits(x, x_before)
    if residual is not None and torch_sum is not None:
        assert same_bits(residual, expected_sum) and same_bits(residual, torch_sum)


def test_norm_instances_are_chosen_by_alignment() -> None:
    f32 = torch.zeros(4, 64)
    assert fused_ops._vec_for("float32", 64, [f32]) == 4
    assert fused_ops._vec_for("float16", 64, [f32.half()]) == 8
    assert fused_ops._vec_for("float32", 37, [f32[:, :37]]) == 1
    assert fused_ops._vec_for("float32", 60, [torch.zeros(4, 66)[:, :60]]) == 1  # row stride
    assert fused_ops._vec_for("float32", 60, [torch.zeros(4, 65)[:, 1:61]]) == 1  # base address


def _qkv_case(dtype: str, tokens: int, heads: int, kv_heads: int, head_dim: int, pad: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    # Rows of a wider buffer: the QKV projection's row stride is free.
    qkv = torch.randn(tokens, width + pad, generator=g).to(t)[:, :width]
    pos = torch.randint(0, 4000, (tokens,), generator=g).double()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    freqs = pos[:, None] * inv_freq[None, :]
    # [T, 1, D/2] as the worker's RotaryEmbedding.cos_sin gives them.
    return qkv, freqs.cos().to(t)[:, None, :], freqs.sin().to(t)[:, None, :]


ROPE_CASES = [  # (heads, kv_heads, head_dim, block_size, row padding)
    (4, 2, 64, 16, 0),
    (3, 1, 80, 8, 6),  # MQA, an odd head count, padded rows
    (2, 2, 128, 16, 0),  # MHA
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}")
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@schedules
def test_rotary_qkv_cache(emu: Any, schedule: str, slot_dtype: torch.dtype, case: tuple[int, ...],
                          dtype: str) -> None:
    heads, kv_heads, head_dim, bs, pad = case
    tokens, num_blocks = 11, 5
    t = TORCH_DTYPES[dtype]
    qkv, cos, sin = _qkv_case(dtype, tokens, heads, kv_heads, head_dim, pad, head_dim + heads)
    g = torch.Generator().manual_seed(3)
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens]
    slots[::4] = -1  # tokens whose KV is not kept
    k_cache = torch.full((num_blocks, bs, kv_heads, head_dim), float("nan"), dtype=t)
    v_cache = k_cache.clone()
    before = qkv.clone()
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    c2, s2 = cos[:, 0], sin[:, 0]
    exp_q = reference.rotary_neox(before[:, :q_size].view(tokens, heads, head_dim), c2, s2)
    exp_k = reference.rotary_neox(before[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim), c2, s2)
    v_in = before[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)

    q, k, v = fused_ops.rotary_qkv_cache(qkv, cos, sin, k_cache, v_cache, slots.to(slot_dtype), heads,
                                         backend=emu(schedule))
    assert q.data_ptr() == qkv.data_ptr() and q.shape == (tokens, heads, head_dim)
    assert_matches(q, exp_q, dtype)
    assert_matches(k, exp_k, dtype)
    assert same_bits(v, v_in)  # v passes through untouched
    # The cache holds exactly the rotated k and v at the kept slots, NaN everywhere else.
    expected_k = torch.full_like(k_cache, float("nan"))
    expected_v = expected_k.clone()
    reference.reshape_and_cache(k, v, expected_k, expected_v, slots)
    assert same_bits(k_cache, expected_k) and same_bits(v_cache, expected_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 96, 192), (3, 37, 80), (2, 600, 1201)],
                         ids=lambda s: f"{s[0]}x{s[1]}s{s[2]}")
@schedules
def test_silu_and_mul(emu: Any, schedule: str, shape: tuple[int, int, int], dtype: str) -> None:
    """An aligned width, an odd one, and a row stride that breaks alignment over several CTAs."""
    rows, inter, stride = shape
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(rows, stride, generator=g) * 3).to(TORCH_DTYPES[dtype])[:, : 2 * inter]
    out = fused_ops.silu_and_mul(gate_up, backend=emu(schedule))
    assert out.shape == (rows, inter)
    assert_matches(out, reference.silu_and_mul(gate_up), dtype)


def test_shape_checks() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight"):
        fused_ops.add_rms_norm(x, None, torch.zeros(7), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        fused_ops.add_rms_norm(x, torch.zeros(3, 8), torch.zeros(8), 1e-5)
    with pytest.raises(TypeError, match="dtype"):
        fused_ops.add_rms_norm(x, None, torch.zeros(8, dtype=torch.float16), 1e-5)
    with pytest.raises(ValueError, match="features must be contiguous"):
        fused_ops.silu_and_mul(torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="even"):
        fused_ops.silu_and_mul(torch.zeros(2, 5))
    cache = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="qkv"):
        fused_ops.rotary_qkv_cache(torch.zeros(3, 500), torch.zeros(3, 32), torch.zeros(3, 32), cache, cache,
                                   torch.zeros(3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="cos"):
        fused_ops.rotary_qkv_cache(torch.zeros(3, 512), torch.zeros(3, 64), torch.zeros(3, 64), cache, cache,
                                   torch.zeros(3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="slot_mapping"):
        fused_ops.rotary_qkv_cache(torch.zeros(3, 512), torch.zeros(3, 32), torch.zeros(3, 32), cache, cache,
                                   torch.zeros(2, dtype=torch.int64), 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rounds_as_apply_rope(emu: Any, dtype: str) -> None:
    """Bit for bit the worker's torch rotary (worker/models/layers.apply_rope) on the CPU: each
    product rounded to the dtype, then the sum. A kernel that rounds once is closer to float64
    but not to the torch backend, and in bfloat16 that turned the engine's greedy tokens."""
    from noria.worker.models.layers import apply_rope

    heads, kv_heads, head_dim = 4, 2, 64
    qkv, cos, sin = _qkv_case(dtype, 9, heads, kv_heads, head_dim, 0, 21)
    q_size = heads * head_dim
    exp_q = apply_rope(qkv[:, :q_size].view(9, heads, head_dim), cos, sin)
    exp_k = apply_rope(qkv[:, q_size : q_size + kv_heads * head_dim].view(9, kv_heads, head_dim), cos, sin)
    cache = torch.zeros(2, 16, kv_heads, head_dim, dtype=TORCH_DTYPES[dtype])
    slots = torch.full((9,), -1, dtype=torch.int64)
    q, k, _ = fused_ops.rotary_qkv_cache(qkv, cos, sin, cache, cache.clone(), slots, heads, backend=emu("forward"))
    assert same_bits(q.contiguous(), exp_q) and same_bits(k.contiguous(), exp_k)


def _rotary_partial_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Float64 neox rotary of the first 2 * cos.shape[-1] dims of each head; the rest as they are."""
    rot = 2 * cos.shape[-1]
    rotated = reference.rotary_neox(x[..., :rot].contiguous(), cos, sin)
    return torch.cat((rotated, x[..., rot:].double()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(4, 2, 64, 16), (3, 1, 96, 24)], ids=["h4kv2d64r32", "h3kv1d96r48"])
@schedules
def test_rotary_partial_with_scaled_table(emu: Any, schedule: str, case: tuple[int, int, int, int],
                                          dtype: str) -> None:
    """Partial rotary (Phi-3's partial_rotary_factor): cos / sin hold rot / 2 < head_dim / 2
    values per token, from a yarn table whose attention factor scales them; only the first rot
    dims of each head turn, the rest of q and k stay bit for bit, and the cache holds all of k."""
    from noria.protocol.model_spec import RopeSpec
    from noria.worker.models.layers import RotaryEmbedding, apply_rope

    heads, kv_heads, head_dim, rot_half = case
    tokens, bs, num_blocks = 10, 8, 4
    t = TORCH_DTYPES[dtype]
    rope = RopeSpec(theta=10000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=256,
                    partial_rotary_factor=2 * rot_half / head_dim, max_position_embeddings=1024)
    rotary = RotaryEmbedding(rope, head_dim)
    assert rotary.rotary_dim == 2 * rot_half and rotary.attention_factor > 1.0
    g = torch.Generator().manual_seed(head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=g).to(t)
    cos, sin = rotary.cos_sin(torch.randint(0, 1000, (tokens,), generator=g), t)
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens]
    slots[1::3] = -1
    k_cache = torch.full((num_blocks, bs, kv_heads, head_dim), float("nan"), dtype=t)
    v_cache = k_cache.clone()
    before = qkv.clone()
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q_in = before[:, :q_size].view(tokens, heads, head_dim)
    k_in = before[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    q, k, v = fused_ops.rotary_qkv_cache(qkv, cos, sin, k_cache, v_cache, slots, heads, backend=emu(schedule))
    c2, s2 = cos[:, 0], sin[:, 0]
    assert_matches(q, _rotary_partial_ref(q_in, c2, s2), dtype)
    assert_matches(k, _rotary_partial_ref(k_in, c2, s2), dtype)
    rot = 2 * rot_half
    assert same_bits(q[..., rot:].contiguous(), q_in[..., rot:].contiguous())
    assert same_bits(k[..., rot:].contiguous(), k_in[..., rot:].contiguous())
    # Bit for bit the worker's torch path on the same table.
    assert same_bits(q.contiguous(), apply_rope(q_in, cos, sin))
    assert same_bits(k.contiguous(), apply_rope(k_in, cos, sin))
    expected_k = torch.full_like(k_cache, float("nan"))
    expected_v = expected_k.clone()
    reference.reshape_and_cache(k, v, expected_k, expected_v, slots)
    assert same_bits(k_cache, expected_k) and same_bits(v_cache, expected_v)

"""The fp8 (e4m3) KV cache on the kernels, under the CPU emulator: the cache writes
(reshape_and_cache, rotary_qkv_cache) bit for bit against the torch path's quantization
(fp8(x / scale), saturated to +-448, ties to even), every e4m3 byte widened exactly, and the
tensor-core decode (single and split) and prefill kernels, and a mixed step through
ops.paged_attention, against the float64 reference over the dequantized cache. K and V scales
differ from 1 and from each other, so a kernel that drops either fails."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_decode_attention import SCALE
from test_decode_attention import run_decode as run_decode_16
from test_prefill_attention import ragged_batch

from noria.kernels import fused_ops, instances, ops, reference
from noria.kernels.instances import AttentionConfig, ModuleSpec
from noria.kernels.scenes import TORCH_DTYPES, Scene, assert_matches, edge_lengths, make_scene

FP8 = reference.FP8
K_SCALE, V_SCALE = 0.02, 0.01  # cached values reach a few hundred: the e4m3 range is used
CONFIGS = [AttentionConfig("bfloat16", 64, 16, kv_fp8=True), AttentionConfig("float16", 128, 32, kv_fp8=True)]
SCHEDULES = ["forward", "greedy-reverse"]


def cfg_id(cfg: AttentionConfig) -> str:
    return f"{cfg.dtype}-d{cfg.head_dim}-b{cfg.block_size}"


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    if "cfg" in params:
        return [instances.decode_module(params["cfg"]), instances.prefill_module(params["cfg"])]
    plain = AttentionConfig("bfloat16", 64, 16)
    return [instances.decode_module(CONFIGS[0]), instances.prefill_module(CONFIGS[0]), instances.decode_module(plain),
            *(m for d in instances.TENSOR_CORE_DTYPES
              for m in (instances.reshape_module(d, True), instances.fused_module(d), instances.rotary_fp8_module(d)))]


def fp8_scene(cfg: AttentionConfig, lens: list[int], num_kv_heads: int, seed: int) -> tuple[Scene, Scene]:
    """(the scene with fp8 caches, the same scene dequantized to float64 for the reference).
    Unowned slots stay NaN (e4m3 has a NaN), so reading past a context still shows."""
    plain = make_scene(AttentionConfig(cfg.dtype, cfg.head_dim, cfg.block_size), lens, num_kv_heads, seed)
    k8 = reference.fp8_quantize(plain.k_cache.float(), K_SCALE)
    v8 = reference.fp8_quantize(plain.v_cache.float(), V_SCALE)
    fp8 = Scene(cfg, k8, v8, plain.block_tables, plain.seq_lens, plain.poison_block)
    wide = Scene(cfg, reference.fp8_dequantize(k8, K_SCALE), reference.fp8_dequantize(v8, V_SCALE),
                 plain.block_tables, plain.seq_lens, plain.poison_block)
    return fp8, wide


def query_rows(cfg: AttentionConfig, tokens: int, heads: tuple[int, int], seed: int) -> torch.Tensor:
    """Queries as the Q part of a fused QKV row (a token stride wider than the heads)."""
    num_heads, num_kv_heads = heads
    d = cfg.head_dim
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * d, generator=g).to(TORCH_DTYPES[cfg.dtype])
    return qkv[:, : num_heads * d].view(tokens, num_heads, d)


def run_decode(backend: Any, scene: Scene, query: torch.Tensor, **kw: Any) -> torch.Tensor:
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    ops.paged_attention_decode(out, query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, SCALE,
                               k_scale=K_SCALE, v_scale=V_SCALE, backend=backend, **kw)
    return out


EDGES = [0.0, 448.0, 449.0, 463.9, 464.0, 480.0, 1e6, float("inf"), 2.0**-10, 3 * 2.0**-10, 2.0**-12,
         1.0625, 1.1875, 2.0**-6 * 1.0625, 2.0**-6 * 0.96875, 15.5, 0.1, 300.0]


@pytest.mark.parametrize("dtype", instances.TENSOR_CORE_DTYPES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cache_write_quantizes_as_the_torch_path(emu: Any, dtype: str, schedule: str) -> None:
    """reshape_and_cache into an fp8 cache: the bytes of fp8((x / scale).clamp(+-448)) at kept
    slots, untouched bytes elsewhere. Values past 448 (and infinities) saturate, exact ties
    between e4m3 neighbours (normal and subnormal) round to even, NaN stays NaN."""
    t = TORCH_DTYPES[dtype]
    tokens, kv_heads, d, bs, blocks = 9, 2, 64, 16, 3
    g = torch.Generator().manual_seed(5)
    key = (torch.randn(tokens, kv_heads, d, generator=g) * 300).to(t)
    value = (torch.randn(tokens, kv_heads, d, generator=g) * 0.01).to(t)  # subnormal e4m3s
    edges = torch.tensor(EDGES + [-x for x in EDGES] + [float("nan")], dtype=t)
    key[1].view(-1)[: edges.numel()] = edges  # with k_scale 1 below: the exact edges
    value[1].view(-1)[-edges.numel():] = edges * 0.5
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    slots[::4] = -1  # tokens 0, 4, 8 are not kept
    k_cache = torch.full((blocks, bs, kv_heads, d), 0x55, dtype=torch.uint8).view(FP8)
    v_cache = k_cache.clone()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ops.reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale=1.0, v_scale=0.5, backend=emu(schedule))
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots, 1.0, 0.5)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))
    # The edges themselves, as torch converts them (a check of the reference, too).
    stored = k_cache.view(-1, kv_heads * d)[slots[1]].view(torch.uint8)[: edges.numel()]
    assert int(stored[1]) == 0x7E and int(stored[7]) == 0x7E  # 448 and inf: the largest finite
    assert int(stored[8]) == 0 and int(stored[9]) == 2  # 2^-10 -> 0, 3 * 2^-10 -> 2^-8 (even)


@pytest.mark.parametrize("dtype", instances.TENSOR_CORE_DTYPES)
def test_rotary_cache_write_quantizes_the_rotated_keys(emu: Any, dtype: str) -> None:
    """rotary_qkv_cache into an fp8 cache stores exactly what the 16-bit cache would hold,
    quantized with the layer's scales; q, k, v come back as with a 16-bit cache."""
    t = TORCH_DTYPES[dtype]
    tokens, heads, kv_heads, d, bs, blocks = 7, 4, 2, 64, 16, 2
    g = torch.Generator().manual_seed(11)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g) * 8).to(t)
    angles = torch.rand(tokens, d // 2, generator=g) * 6
    cos, sin = angles.cos().to(t), angles.sin().to(t)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    slots[2] = -1
    plain = torch.zeros(blocks, bs, kv_heads, d, dtype=t)
    plain_v = plain.clone()
    qkv16 = qkv.clone()
    q16, k16, v16 = fused_ops.rotary_qkv_cache(qkv16, cos, sin, plain, plain_v, slots, heads, backend=emu("forward"))
    k_cache = torch.zeros(blocks, bs, kv_heads, d, dtype=FP8)
    v_cache = k_cache.clone()
    q8, k8, v8 = fused_ops.rotary_qkv_cache(qkv, cos, sin, k_cache, v_cache, slots, heads, k_scale=0.07,
                                            v_scale=0.03, backend=emu("greedy-reverse"))
    assert torch.equal(q8, q16) and torch.equal(k8, k16) and torch.equal(v8, v16)
    kept = slots[slots >= 0].long()
    flat = (blocks * bs, kv_heads, d)
    assert torch.equal(k_cache.view(flat)[kept].view(torch.uint8),
                       reference.fp8_quantize(plain.view(flat)[kept], 0.07).view(torch.uint8))
    assert torch.equal(v_cache.view(flat)[kept].view(torch.uint8),
                       reference.fp8_quantize(plain_v.view(flat)[kept], 0.03).view(torch.uint8))


@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
def test_every_e4m3_byte_widens_exactly(emu: Any, cfg: AttentionConfig) -> None:
    """Decode over one-token contexts returns the single V row times v_scale: with all 256
    bytes among the rows (subnormals, the largest, both zeros, NaN) the output is each byte's
    exact value (as torch widens it) rounded once to the query dtype."""
    d = cfg.head_dim
    rows = 256 // d
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(rows, 1, d)
    k_cache = torch.zeros(rows, cfg.block_size, 1, d, dtype=torch.uint8)
    v_cache = k_cache.clone()
    v_cache[:, 0] = codes
    scene = Scene(cfg, k_cache.view(FP8), v_cache.view(FP8), torch.arange(rows, dtype=torch.int32).view(rows, 1),
                  torch.ones(rows, dtype=torch.int32), 0)
    query = query_rows(cfg, rows, (2, 1), seed=3)
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    ops.paged_attention_decode(out, query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, SCALE,
                               k_scale=K_SCALE, v_scale=0.75, backend=emu("forward"))
    expected = (codes.view(FP8).double() * 0.75).to(query.dtype).expand(rows, 2, d)
    nan = torch.isnan(expected)
    assert int(nan.sum()) == 2 * 2  # 0x7f and 0xff, in both query heads
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan], expected[~nan])


@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fp8_decode_matches_reference(emu: Any, cfg: AttentionConfig, split: bool, schedule: str) -> None:
    """The GQA decode kernel over an fp8 cache: 8 query heads over 2 KV heads, contexts around
    block edges and a long one; split: partitions of 3 blocks (long contexts split, short ones
    not, in one launch, merged)."""
    lens = edge_lengths(cfg.block_size, 150)
    scene, wide = fp8_scene(cfg, lens, 2, seed=cfg.head_dim)
    query = query_rows(cfg, len(lens), (8, 2), seed=cfg.head_dim + 1)
    expected = reference.paged_attention_decode(query, wide.k_cache, wide.v_cache, wide.block_tables,
                                                wide.seq_lens, SCALE)
    out = run_decode(emu(schedule), scene, query, split=split, partition_size=3 * cfg.block_size)
    assert_matches(out, expected, cfg.dtype)


@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fp8_prefill_matches_reference(emu: Any, cfg: AttentionConfig, schedule: str) -> None:
    """The tensor-core prefill kernel over an fp8 cache: the ragged batch of the prefill tests
    (whole prompts, a chunk after a cached prefix, a long prefix, a decode row, empty
    sequences), 8 query heads over 2 KV heads."""
    batch = ragged_batch(cfg.block_size, 100)
    scene, wide = fp8_scene(cfg, [c for c, _ in batch], 2, seed=7 * cfg.head_dim)
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _, q in batch]), 0)
    query = query_rows(cfg, int(qsl[-1]), (8, 2), seed=cfg.head_dim)
    expected = reference.paged_attention_prefill(query, wide.k_cache, wide.v_cache, wide.block_tables,
                                                 wide.seq_lens, qsl, SCALE)
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    ops.paged_attention_prefill(out, query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl,
                                SCALE, k_scale=K_SCALE, v_scale=V_SCALE, backend=emu(schedule))
    assert_matches(out, expected, cfg.dtype)


def test_fp8_mixed_step_through_paged_attention(emu: Any) -> None:
    """ops.paged_attention with a step plan: decode rows on the decode kernel, the rest on the
    prefill kernel, both reading the fp8 cache with the layer's scales."""
    cfg = CONFIGS[0]
    batch = [(33, 33), (40, 1), (50, 9), (70, 1)]
    scene, wide = fp8_scene(cfg, [c for c, _ in batch], 2, seed=31)
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _, q in batch]), 0)
    query = query_rows(cfg, int(qsl[-1]), (8, 2), seed=32)
    expected = reference.paged_attention_prefill(query, wide.k_cache, wide.v_cache, wide.block_tables,
                                                 wide.seq_lens, qsl, SCALE)
    plan = ops.plan_step([q for _, q in batch], [c for c, _ in batch], torch.device("cpu"))
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    ops.paged_attention(out, query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, SCALE,
                        max_query_len=33, max_seq_len=70, plan=plan, k_scale=K_SCALE, v_scale=V_SCALE,
                        backend=emu("forward"))
    assert_matches(out, expected, cfg.dtype)


def test_a_16_bit_cache_ignores_the_scales(emu: Any) -> None:
    """LayerAttention's scales belong to an fp8 cache: a bfloat16 cache reads as it is."""
    cfg = AttentionConfig("bfloat16", 64, 16)
    lens = [5, 40]
    scene = make_scene(cfg, lens, 2, seed=9)
    query = query_rows(cfg, len(lens), (8, 2), seed=10)
    plain = run_decode_16(emu("forward"), scene, query)
    assert torch.equal(run_decode(emu("forward"), scene, query), plain)


def test_fp8_instances_and_refusals() -> None:
    """fp8 caches have instances for 16-bit queries at the listed head and block sizes only;
    elsewhere the launch refuses before reaching a kernel."""
    names = instances.all_instances()
    fp8 = [n for ns in names.values() for n in ns if n.endswith("unsigned char>")]
    assert len(fp8) == 2 * 2 * len(instances.FP8_HEAD_SIZES) * len(instances.FP8_BLOCK_SIZES) + 2 * 2 * 2
    with pytest.raises(ValueError, match="fp8"):
        AttentionConfig("float32", 64, 16, kv_fp8=True)
    with pytest.raises(ValueError, match="head size 80"):
        AttentionConfig("float16", 80, 16, kv_fp8=True)
    q = torch.zeros(1, 2, 64)
    cache = torch.zeros(2, 16, 1, 64, dtype=FP8)
    with pytest.raises(ValueError, match="fp8"):
        ops.paged_attention_decode(torch.zeros_like(q), q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                   torch.ones(1, dtype=torch.int32), SCALE)
    with pytest.raises(ValueError, match="v_scale"):
        ops.reshape_and_cache(q.bfloat16()[:, :1], q.bfloat16()[:, :1], cache, cache,
                              torch.zeros(1, dtype=torch.int64), v_scale=0.0)

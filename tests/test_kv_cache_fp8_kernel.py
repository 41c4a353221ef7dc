"""The fp8 KV cache below the engine: the native paged decode kernel's _fp8 entry points against a
float64 reference over the dequantized cache, the bytes its fused write and the torch backend's
write_kv store (against torch's own `.to(torch.float8_e4m3fn)`), the exact widening of every byte,
the torch backend's decode and prefill paths over an fp8 cache, and swaps of fp8 blocks."""

from __future__ import annotations

import pytest
import torch

from noria.worker import cpu_kernels
from noria.worker.attention import (
    AttentionMetadata,
    LayerAttention,
    TorchAttentionBackend,
    write_kv,
)
from noria.worker.kv_cache import KVCache, KVLayout
from noria.worker.kv_fp8 import FP8, FP8_MAX, dequantize, quantize
from tests.test_worker_cpu_kernels import _as_float32, _causal_reference, _kernel, _reference

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the native kernels")
ISAS = ["native", "avx2", "sse2"]  # the host's widest vectors, 8-float AVX2, 4-float SSE2 (tests/test_worker_cpu_kernels)
NAN_BYTE = 0x7F  # e4m3fn's NaN: a block filled with it poisons any output that reads it


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _fp8_paged(seed: int, lens: list[int], heads: int, kvh: int, d: int, bs: int, k_scale: float, v_scale: float):
    """Queries, fp8 K/V caches of values of about +-2 (so x = k / scale spans e4m3 from its subnormals
    at scale 3 to saturation at scale 0.02), block tables of scattered blocks whose unused entries (holes past each length) point
    at a block of NaN bytes, and the lengths."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // bs)
    nb = len(lens) * max_blocks + 1
    k = torch.randn(nb, bs, kvh, d, generator=g) * 2
    v = torch.randn(nb, bs, kvh, d, generator=g) * 2
    k_cache, v_cache = quantize(k, k_scale), quantize(v, v_scale)
    poison = nb - 1
    _bits(k_cache)[poison] = NAN_BYTE
    _bits(v_cache)[poison] = NAN_BYTE
    order = torch.randperm(nb - 1, generator=g)
    tables = torch.full((len(lens), max_blocks), poison, dtype=torch.long)
    for i, n in enumerate(lens):
        used = -(-n // bs)
        tables[i, :used] = order[i * max_blocks : i * max_blocks + used]
    q = torch.randn(len(lens), heads, d, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
def test_fp8_paged_decode_matches_float64_reference_of_the_dequantized_cache(isa, threads, monkeypatch):
    """Every score, softmax and sum over the widened, scaled fp8 K/V within float32 rounding of float64
    on the same dequantized values; the step's rows written in the same call first, as quantize
    stores them. Ragged lengths (one 2,100-token sequence split across chunks), GQA groups of 1-8
    (and 3, with 15 heads), head sizes 64 and 128 (their own compiled copies), 80 (the generic one)
    and 34 (off every vector width: the scalar widening), windows, soft caps, scales far from 1."""
    _kernel(isa, monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for heads, kvh, d, bs, k_scale, v_scale in ((12, 4, 64, 16, 0.02, 0.5), (8, 1, 128, 8, 3.0, 0.01),
                                                    (15, 5, 80, 32, 1.0, 1.0), (6, 2, 34, 16, 0.125, 7.0)):
            lens = [1, 15, 16, 17, 100, 333, 2100]
            q, k_cache, v_cache, tables, lens_t = _fp8_paged(heads + d, lens, heads, kvh, d, bs, k_scale, v_scale)
            pos = lens_t - 1
            slots = tables[torch.arange(len(lens)), pos // bs] * bs + pos % bs
            g = torch.Generator().manual_seed(d)
            k_new = torch.randn(len(lens), kvh, d, generator=g) * 4
            v_new = torch.randn(len(lens), kvh, d, generator=g) * 4
            for window in (None, 37):
                for cap in (None, 5.0):
                    k, v = k_cache.clone(), v_cache.clone()
                    out = cpu_kernels.paged_decode(q, k, v, tables, lens_t, d**-0.5, window,
                                                   new_kv=(k_new, v_new, slots), soft_cap=cap,
                                                   kv_scales=(k_scale, v_scale))
                    expect_k, expect_v = k_cache.clone(), v_cache.clone()
                    _bits(expect_k).view(-1, kvh, d)[slots] = _bits(quantize(k_new, k_scale))
                    _bits(expect_v).view(-1, kvh, d)[slots] = _bits(quantize(v_new, v_scale))
                    assert torch.equal(_bits(k), _bits(expect_k)) and torch.equal(_bits(v), _bits(expect_v))
                    assert not out.isnan().any(), "a hole of the block tables (NaN bytes) was read"
                    ref = _reference(q, dequantize(expect_k, k_scale, torch.float64),
                                     dequantize(expect_v, v_scale, torch.float64), tables, lens_t, d**-0.5, window,
                                     cap)
                    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=2e-5)
            # The scales are used: the same bytes read unscaled give other outputs.
            unscaled = cpu_kernels.paged_decode(q, k_cache.clone(), v_cache.clone(), tables, lens_t, d**-0.5, None)
            scaled = cpu_kernels.paged_decode(q, k_cache.clone(), v_cache.clone(), tables, lens_t, d**-0.5, None,
                                              kv_scales=(k_scale, v_scale))
            assert (k_scale, v_scale) == (1.0, 1.0) or not torch.allclose(scaled, unscaled)
    finally:
        torch.set_num_threads(before)


def _fp8_rounding_cases() -> torch.Tensor:
    """float32s where rounding to e4m3 can go wrong: ties to even either way (kept part odd or even,
    one carrying into the exponent: 15.5 -> 16), just under and over a tie; the top: 448, between
    448 and 464 (the tie with 2^9, which e4m3 lacks), 480 and beyond, infinities (all saturate to
    +-448); the subnormals 2^-9 .. 7 * 2^-9, 2^-10 (the tie with 0: to 0), 3 * 2^-11 (over it),
    ties between subnormals, the largest subnormal and the tie up into 2^-6; float32 subnormals,
    signed zeros; NaNs; random bits over e4m3's exponents and over every exponent."""
    values = [1.0, 1.0625, 1.1875, 1.0624, 1.0626, 15.5, -15.5, 448.0, 449.0, 463.9, 464.0, 470.0, 480.0, 1e6,
              3.4e38, float("inf"), -448.0, -500.0, float("-inf"), 2.0**-9, 3 * 2.0**-9, 7 * 2.0**-9, 2.0**-10,
              3 * 2.0**-11, 2.0**-10 + 2.0**-30, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 7.5 * 2.0**-9, 2.0**-6 - 2.0**-10,
              2.0**-6, 1e-40, -1e-40, 0.0, -0.0, -(2.0**-10), -3 * 2.0**-11, float("nan"), -float("nan")]
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**32, (4000,), dtype=torch.int64, generator=g)
    exponents = torch.randint(113, 137, (4000,), dtype=torch.int64, generator=g)  # 2^-14 .. 2^9
    in_range = (bits & 0x807FFFFF) | exponents << 23
    ties = (in_range & ~0xFFFFF) | 0x80000  # exact halves (of normals), their kept parts random
    return torch.cat([torch.tensor(values, dtype=torch.float32), _as_float32(bits), _as_float32(in_range),
                      _as_float32(ties)])


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("kvh, d", [(2, 64), (1, 60)])
@pytest.mark.parametrize("isa", ISAS)
def test_fp8_rows_are_rounded_as_torch_rounds(isa, kvh, d, scale, monkeypatch):
    """The kernel's fused write and write_kv store the same bytes: torch's own `.to(float8_e4m3fn)`
    of k / scale wherever that is within +-448, and +-448 past it (vLLM saturates; older torch
    writes NaN from 480 up); a NaN stays a NaN."""
    _kernel(isa, monkeypatch)
    values = _fp8_rounding_cases() * scale
    rows = -(-values.numel() // (kvh * d))
    flat = torch.zeros(rows * kvh * d)
    flat[: values.numel()] = values
    k_new = flat.view(rows, kvh, d)
    v_new = -k_new
    bs = 16
    nb = -(-rows // bs) + 1
    slots = torch.randperm(nb * bs - 1)[:rows]  # scattered, never the last slot
    caches = [torch.zeros(nb, bs, kvh, d, dtype=FP8) for _ in range(4)]
    cpu_kernels.paged_decode(torch.randn(1, 2, d), caches[0], caches[1], torch.tensor([[nb - 1]]),
                             torch.tensor([bs]), 0.1, None, new_kv=(k_new, v_new, slots), kv_scales=(scale, scale))
    write_kv(k_new, v_new, caches[2], caches[3], slots, (scale, scale))
    for cache, new in ((caches[0], k_new), (caches[1], v_new), (caches[2], k_new), (caches[3], v_new)):
        got = _bits(cache.view(-1, kvh, d)[slots])
        x = new / scale
        nan, inside = torch.isnan(x), x.abs() < FP8_MAX
        assert nan.sum() >= 2 and torch.equal((got & 0x7F) == 0x7F, nan)
        assert torch.equal(got[inside], _bits(x[inside].to(FP8)))
        past = ~inside & ~nan
        assert past.sum() >= 20 and torch.equal(got[past], torch.where(x[past] > 0, 0x7E, 0xFE).to(torch.uint8))
        assert ((got & 0x78) == 0).sum() > 50  # subnormals kept, not flushed
        written = torch.zeros(nb * bs, dtype=torch.bool)
        written[slots] = True
        assert not _bits(cache.view(-1, kvh, d)[~written]).any()  # nothing else written


@pytest.mark.parametrize("d", [64, 35])  # V widened a vector at a time, and (35) one by one
@pytest.mark.parametrize("isa", ISAS)
def test_every_fp8_byte_widens_exactly(isa, d, monkeypatch):
    """Each of the 256 bytes, as a V row of a one-token context (softmax weight exactly 1), comes out
    as torch's float32 of it times the V scale (a power of two: exact): normals, subnormals,
    signed zeros as zeros, NaN as NaN."""
    _kernel(isa, monkeypatch)
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(2).view(FP8)
    b = -(-patterns.numel() // d)
    v_cache = torch.zeros(b * d, dtype=FP8)
    v_cache[: patterns.numel()] = patterns
    v_cache = v_cache.view(b, 1, 1, d)  # one block of one token per sequence
    k_cache = torch.zeros_like(v_cache)
    for v_scale in (1.0, 0.25):
        out = cpu_kernels.paged_decode(torch.randn(b, 1, d), k_cache, v_cache, torch.arange(b).view(b, 1),
                                       torch.ones(b, dtype=torch.int64), d**-0.5, None, kv_scales=(3.0, v_scale))
        got, want = out.view(-1)[: patterns.numel()], patterns.float() * v_scale
        nan = torch.isnan(want)
        assert nan.sum() == 4 and torch.equal(torch.isnan(got), nan)
        assert torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize("d", [64, 35])  # the score's vector loop, and (35) its scalar tail
@pytest.mark.parametrize("isa", ISAS)
def test_every_fp8_byte_scores_as_its_float32(isa, d, monkeypatch):
    """Each of the 256 bytes as a K row, scored by a one-hot query (one lane of the vector loop, and the
    last lane: for 35 the scalar tail) against a zero K row: the outputs, a softmax of the two scores
    over V rows 0 and 1, are bit for bit those of the float32 kernel over the same values, K scale
    and all (a power of two), so the widened K times the query scale is each byte's exact product;
    NaN scores NaN."""
    _kernel(isa, monkeypatch)
    b = 256
    k = torch.zeros(b, 2, 1, d, dtype=torch.uint8)
    k[:, 1] = torch.arange(b, dtype=torch.int32).to(torch.uint8).view(b, 1, 1)
    v = torch.zeros(b, 2, 1, d, dtype=torch.uint8)
    v[:, 1] = 0x38  # 1.0
    k_cache, v_cache = k.view(FP8), v.view(FP8)
    q = torch.zeros(b, 2, d)
    q[torch.arange(b), 0, torch.arange(b) % (d // 16 * 16)] = 0.01
    q[:, 1, d - 1] = -0.3
    tables, lens = torch.arange(b).view(b, 1), torch.full((b,), 2)
    for k_scale in (1.0, 0.5):
        got = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, d**-0.5, None, kv_scales=(k_scale, 1.0))
        want = cpu_kernels.paged_decode(q, k_cache.float() * k_scale, v_cache.float(), tables, lens, d**-0.5, None)
        nan = torch.isnan(want)
        assert nan.any(dim=(1, 2)).sum() == 2 and torch.equal(torch.isnan(got), nan)  # 0x7f, 0xff
        assert torch.equal(got[~nan], want[~nan])
        assert want[~nan].unique().numel() > 200  # the scores are told apart


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-gather"])
def test_torch_backend_decodes_and_prefills_over_an_fp8_cache(native):
    """The torch backend with an fp8 cache: a step of decode rows and prompts (one after a cached
    prefix, one fresh) writes each row as quantize stores it and attends to the dequantized cache,
    on the native kernel or the gather + SDPA path, with the layer's scales."""
    torch.manual_seed(2)
    bs, d, heads, kvh, k_scale, v_scale = 16, 64, 8, 2, 0.05, 0.2
    query_lens, seq_lens = [1, 1, 9, 20], [5, 40, 30, 20]
    nb = 20
    k_cache = quantize(torch.randn(nb, bs, kvh, d) * 5 * k_scale * 20, k_scale)
    v_cache = quantize(torch.randn(nb, bs, kvh, d) * 5 * v_scale * 20, v_scale)
    tables = torch.randperm(nb - 1)[:12].view(4, 3)  # each sequence its own blocks: no slot written twice
    t = sum(query_lens)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(s - n, s) for n, s in zip(query_lens, seq_lens, strict=True)])
    seq_of = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    slots = tables[seq_of, positions // bs] * bs + positions % bs
    q, k_new, v_new = torch.randn(t, heads, d), torch.randn(t, kvh, d) * 3, torch.randn(t, kvh, d) * 3
    meta = AttentionMetadata(positions=positions, slot_mapping=slots, query_start_loc=starts,
                             seq_lens=torch.tensor(seq_lens), block_tables=tables, block_size=bs,
                             query_lens_host=query_lens, seq_lens_host=seq_lens, query_start_host=starts.tolist())
    backend = TorchAttentionBackend(native=native)
    backend.prepare(meta)
    layer = LayerAttention(heads, kvh, d, d**-0.5, k_scale=k_scale, v_scale=v_scale)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    _bits(expect_k).view(-1, kvh, d)[slots] = _bits(quantize(k_new, k_scale))
    _bits(expect_v).view(-1, kvh, d)[slots] = _bits(quantize(v_new, v_scale))
    out = backend.forward(layer, q, k_new, v_new, k_cache, v_cache, meta)
    assert torch.equal(_bits(k_cache), _bits(expect_k)) and torch.equal(_bits(v_cache), _bits(expect_v))
    ref = _causal_reference(q, dequantize(expect_k, k_scale, torch.float32),
                            dequantize(expect_v, v_scale, torch.float32), tables, query_lens, seq_lens, d**-0.5, None)
    # V of about +-20 here: float32 rounding of SDPA's sums is ~1e-6 of it.
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=2e-5)


def test_fp8_blocks_swap_out_and_back_byte_for_byte():
    """Swaps move an fp8 cache's bytes as they are, every layer's K and V, into the planned blocks,
    and a block is a quarter of a float32 one's bytes."""
    layout = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=FP8)
    assert layout.bytes_per_block * 4 == KVLayout(3, 4, 2, 8, torch.float32).bytes_per_block
    cache = KVCache(layout, num_blocks=10, num_cpu_blocks=6, device=torch.device("cpu"))
    assert cache.device_cache.dtype == cache.cpu_cache.dtype == FP8
    g = torch.Generator().manual_seed(0)
    dev, cpu = _bits(cache.device_cache), _bits(cache.cpu_cache)
    dev[:, :, :10] = torch.randint(0, 256, dev[:, :, :10].shape, generator=g, dtype=torch.uint8)
    cpu.copy_(torch.randint(0, 256, cpu.shape, generator=g, dtype=torch.uint8))
    dev0, cpu0 = dev.clone(), cpu.clone()
    cache.swap_out([(1, 0), (3, 5)])
    assert torch.equal(cpu[:, :, 0], dev0[:, :, 1]) and torch.equal(cpu[:, :, 5], dev0[:, :, 3])
    assert torch.equal(cpu[:, :, 1:5], cpu0[:, :, 1:5]) and torch.equal(dev, dev0)
    dev[:, :, 1] = 0
    cache.swap_in([(9, 0), (6, 5)])
    assert torch.equal(dev[:, :, 9], dev0[:, :, 1]) and torch.equal(dev[:, :, 6], dev0[:, :, 3])
    k, v = cache.layer(2)
    assert torch.equal(_bits(k[9]), dev0[2, 0, 1]) and torch.equal(_bits(v[9]), dev0[2, 1, 1])

"""The native CPU decode kernel against a float64 reference and the torch path."""

from __future__ import annotations

import platform

import pytest
import torch

from noria.worker import cpu_kernels, native_build

# The cache dtypes: float32, and the half types that are rounded as written and widened as read.
_CACHE_DTYPES, _CACHE_IDS = [torch.float32, torch.bfloat16, torch.float16], ["f32-cache", "bf16-cache", "f16-cache"]
_HALF, _HALF_IDS = [torch.bfloat16, torch.float16], ["bf16", "f16"]


def _capped(s, cap):
    """Gemma 2's logit soft-capping (None: off)."""
    return s if cap is None else cap * torch.tanh(s / cap)


def _reference(q, k_cache, v_cache, tables, lens, scale, window, cap=None):
    q, k_cache, v_cache = q.double(), k_cache.double(), v_cache.double()
    b, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    for i in range(b):
        n = int(lens[i])
        pos = torch.arange(n)
        blocks = tables[i][pos // bs]
        k = k_cache[blocks, pos % bs]  # [n, KVH, D]
        v = v_cache[blocks, pos % bs]
        lo = max(0, n - window) if window else 0
        for head in range(h):
            kh = head // (h // kvh)
            s = _capped((k[lo:, kh] @ q[i, head]) * scale, cap)
            out[i, head] = torch.softmax(s, 0) @ v[lo:, kh]
    return out


def test_the_kernel_builds_here():
    assert cpu_kernels.load() is not None, "gcc could not build worker/csrc/paged_decode.c"


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (12, 4), (8, 1)])
@pytest.mark.parametrize("window", [None, 5, 40])
# Head sizes with their own compiled copy (64, 128) and the generic one (80);
# blocks smaller than, equal to and larger than the kernel's 16-token tile.
@pytest.mark.parametrize("bs, d", [(16, 64), (8, 128), (32, 80)])
def test_paged_decode_matches_float64_reference(heads, kv_heads, window, bs, d):
    torch.manual_seed(heads * 10 + kv_heads)
    nb = 64
    lens = torch.tensor([1, 15, 16, 17, 100, 333])
    max_blocks = -(-333 // bs)
    # Scattered, shared and out-of-order blocks; unused entries point at block 0.
    tables = torch.stack([torch.randperm(nb)[:max_blocks] for _ in lens])
    tables[1, 0] = tables[2, 0]
    k_cache = torch.randn(nb, bs, kv_heads, d)
    v_cache = torch.randn(nb, bs, kv_heads, d)
    q = torch.randn(len(lens), heads, d)
    out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, d**-0.5, window)
    ref = _reference(q, k_cache, v_cache, tables, lens, d**-0.5, window)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", _CACHE_DTYPES, ids=_CACHE_IDS)
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-gather"])
def test_both_decode_paths_of_the_torch_backend_agree_with_the_reference(native, dtype):
    from noria.worker.attention import AttentionMetadata, LayerAttention, TorchAttentionBackend

    torch.manual_seed(1)
    bs, d, nb, heads, kvh = 16, 64, 40, 12, 4
    lens = torch.tensor([1, 16, 17, 70])
    tables = torch.stack([torch.randperm(nb)[:5] for _ in lens])
    k_cache, v_cache = torch.randn(nb, bs, kvh, d).to(dtype), torch.randn(nb, bs, kvh, d).to(dtype)
    q = torch.randn(len(lens), heads, d)
    b = len(lens)
    meta = AttentionMetadata(
        positions=lens - 1, slot_mapping=torch.zeros(b, dtype=torch.long), query_start_loc=torch.arange(b + 1),
        seq_lens=lens, block_tables=tables, block_size=bs, query_lens_host=[1] * b,
        seq_lens_host=lens.tolist(), query_start_host=list(range(b + 1)),
    )
    backend = TorchAttentionBackend(native=native)
    backend.prepare(meta)
    out = backend._decode(LayerAttention(heads, kvh, d, d**-0.5), q, k_cache, v_cache, meta.backend_data)
    ref = _reference(q, k_cache, v_cache, tables, lens, d**-0.5, None)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_paged_decode_is_exact_on_sharp_softmax():
    """Scores spread over ~±100: the kernel's exp must underflow to zero
    cleanly and its running max must rescale earlier tiles correctly."""
    torch.manual_seed(3)
    bs, d, nb, heads, kvh = 16, 64, 32, 8, 2
    lens = torch.tensor([7, 50, 200])
    tables = torch.stack([torch.randperm(nb)[:13] for _ in lens])
    k_cache, v_cache = torch.randn(nb, bs, kvh, d), torch.randn(nb, bs, kvh, d)
    q = torch.randn(len(lens), heads, d) * 12
    out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, d**-0.5, None)
    ref = _reference(q, k_cache, v_cache, tables, lens, d**-0.5, None)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def _ragged_paged(seed, lens, heads, kv_heads, d, bs, nb=None):
    """Scattered, out-of-order blocks; each sequence its own blocks (the tail of the last one unwritten)."""
    g = torch.Generator().manual_seed(seed)
    per = -(-max(lens) // bs)
    nb = nb or len(lens) * per + 3
    tables = torch.randperm(nb, generator=g)[: len(lens) * per].view(len(lens), per).contiguous()
    k_cache = torch.randn(nb, bs, kv_heads, d, generator=g)
    v_cache = torch.randn(nb, bs, kv_heads, d, generator=g)
    q = torch.randn(len(lens), heads, d, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("d", [64, 128])
def test_gqa_ratios_and_head_sizes_on_ragged_paged_inputs(kv_heads, group, d):
    # Odd lengths, partial last blocks, one sequence long enough to be split across chunks.
    lens = [1, 3, 16, 31, 129, 250, 777]
    q, k_cache, v_cache, tables, lens_t = _ragged_paged(kv_heads * 100 + group * 10 + d, lens, kv_heads * group,
                                                        kv_heads, d, 16)
    for window in (None, 37):
        out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens_t, d**-0.5, window)
        ref = _reference(q, k_cache, v_cache, tables, lens_t, d**-0.5, window)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_split_k_of_one_long_sequence(threads):
    """A single 3,000-token sequence: the kernel cuts it into chunks and merges their partial softmaxes."""
    q, k_cache, v_cache, tables, lens = _ragged_paged(7, [3001], 12, 4, 64, 16)
    q = q * 6  # sharp scores: chunks with very different maxima
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for window in (None, 1000, 2999):
            out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125, window)
            ref = _reference(q, k_cache, v_cache, tables, lens, 0.125, window)
            torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("d", [8, 36, 40, 80])
def test_head_sizes_off_the_vector_width(d):
    # 36 is no multiple of any vector width (the scalar accumulation path and the one-row score pass);
    # 8 is one vector of the eight-row score pass; 40 and 80 are multiples of 8, and 40 is none of 16.
    q, k_cache, v_cache, tables, lens = _ragged_paged(d, [5, 40, 300], 6, 2, d, 16)
    out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, d**-0.5, None)
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, lens, d**-0.5, None),
                               atol=2e-5, rtol=2e-5)


def test_fused_kv_write_lands_before_the_rows_are_read():
    """new_kv writes each sequence's newest token, which that same call must attend to."""
    bs, kvh, d = 16, 4, 64
    lens = [1, 17, 32, 200]
    q, k_cache, v_cache, tables, lens_t = _ragged_paged(11, lens, 12, kvh, d, bs)
    pos = lens_t - 1
    slots = tables[torch.arange(len(lens)), pos // bs] * bs + pos % bs
    k_new, v_new = torch.randn(len(lens), kvh, d) * 3, torch.randn(len(lens), kvh, d) * 3
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    expect_k.view(-1, kvh, d)[slots] = k_new
    expect_v.view(-1, kvh, d)[slots] = v_new
    out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens_t, 0.125, None, new_kv=(k_new, v_new, slots))
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    torch.testing.assert_close(out.double(), _reference(q, expect_k, expect_v, tables, lens_t, 0.125, None),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", _CACHE_DTYPES, ids=_CACHE_IDS)
@pytest.mark.parametrize("cap", [None, 2.0], ids=["uncapped", "soft-capped"])
@pytest.mark.parametrize("native", [True, False], ids=["native-fused-write", "torch"])
def test_backend_forward_on_a_decode_step_writes_the_cache_and_attends(native, cap, dtype):
    """The step's float32 rows land in the cache (rounded to nearest even in a half one, the same
    bits on both paths) and the output is the float64 attention over the cache as written."""
    from noria.worker.attention import AttentionMetadata, LayerAttention, TorchAttentionBackend

    bs, kvh, heads, d = 16, 2, 8, 64
    lens = [3, 16, 17, 90]
    q, k_cache, v_cache, tables, lens_t = _ragged_paged(5, lens, heads, kvh, d, bs)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    b = len(lens)
    pos = lens_t - 1
    slots = tables[torch.arange(b), pos // bs] * bs + pos % bs
    k_new, v_new = torch.randn(b, kvh, d), torch.randn(b, kvh, d)
    meta = AttentionMetadata(
        positions=pos, slot_mapping=slots, query_start_loc=torch.arange(b + 1), seq_lens=lens_t,
        block_tables=tables, block_size=bs, query_lens_host=[1] * b, seq_lens_host=lens,
        query_start_host=list(range(b + 1)),
    )
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    expect_k.view(-1, kvh, d)[slots] = k_new.to(dtype)
    expect_v.view(-1, kvh, d)[slots] = v_new.to(dtype)
    backend = TorchAttentionBackend(native=native)
    backend.prepare(meta)
    out = backend.forward(LayerAttention(heads, kvh, d, d**-0.5, logits_soft_cap=cap), q, k_new, v_new, k_cache,
                          v_cache, meta)
    assert out.dtype == torch.float32
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    ref = _reference(q, expect_k, expect_v, tables, lens_t, d**-0.5, None, cap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    if cap is not None:  # the cap moves the outputs far past the tolerance
        uncapped = _reference(q, expect_k, expect_v, tables, lens_t, d**-0.5, None)
        assert (ref - uncapped).abs().max() > 1e-2


@pytest.mark.parametrize("bs", [4, 8, 12, 24])
@pytest.mark.parametrize("threads", [1, 2])
def test_score_rows_in_groups_of_eight_at_block_and_window_edges(bs, threads):
    """The score pass takes K rows eight at a time inside a tile (one block, at most 16 rows): blocks of 4 and 12
    rows leave groups of fewer than eight, windows start groups mid-block, and prefetches run past the end."""
    lens = [1, 7, 8, 9, 15, 16, 17, 23, 24, 25, 100, 513, 1200]
    q, k_cache, v_cache, tables, lens_t = _ragged_paged(bs * 10 + threads, lens, 12, 4, 64, bs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for window in (None, 5, 13, 301):
            out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens_t, 0.125, window)
            ref = _reference(q, k_cache, v_cache, tables, lens_t, 0.125, window)
            torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("batch", [16, 24, 31])
def test_w1_tail_shapes_split_across_two_threads(batch):
    """W1's tail: 16-31 decodes of 256-2048 tokens (12 query / 4 KV heads, head size 64), split-K over 2 threads."""
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(256, 2049, (batch,), generator=g).tolist()
    q, k_cache, v_cache, tables, lens_t = _ragged_paged(batch, lens, 12, 4, 64, 16)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = cpu_kernels.paged_decode(q * 4, k_cache, v_cache, tables, lens_t, 0.125, None)
    finally:
        torch.set_num_threads(before)
    ref = _reference(q * 4, k_cache, v_cache, tables, lens_t, 0.125, None)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def _causal_reference(q, k_cache, v_cache, tables, query_lens, seq_lens, scale, window, cap=None):
    """Float64 attention of each sequence's new tokens: the query at position p sees keys
    max(0, p - window + 1) .. p of its sequence, read from the (already written) cache."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    h = q.shape[1]
    out, start = torch.zeros(q.shape, dtype=torch.float64), 0
    for i, (n, length) in enumerate(zip(query_lens, seq_lens, strict=True)):
        pos = torch.arange(length)
        k = k_cache[tables[i][pos // bs], pos % bs].double()
        v = v_cache[tables[i][pos // bs], pos % bs].double()
        for j in range(n):
            p = length - n + j
            lo = max(0, p - window + 1) if window else 0
            for head in range(h):
                kh = head // (h // kvh)
                s = _capped((k[lo : p + 1, kh] @ q[start + j, head].double()) * scale, cap)
                out[start + j, head] = torch.softmax(s, 0) @ v[lo : p + 1, kh]
        start += n
    return out


@pytest.mark.parametrize("dtype", _CACHE_DTYPES, ids=_CACHE_IDS)
@pytest.mark.parametrize("cap", [None, 2.0], ids=["uncapped", "soft-capped"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("rows_max_len", [512, 0], ids=["token-rows", "sdpa"])
def test_backend_forward_on_a_mixed_prefill_step(window, rows_max_len, cap, dtype, monkeypatch):
    """Decodes, a fresh prompt, a chunk after a cached prefix and a one-token-context
    prompt in one step: both prefill paths (every token a native decode row, and one
    SDPA per sequence, or the soft-capped attention where SDPA cannot cap) write the
    step's K/V and match the float64 causal reference over the cache as written (in a
    half cache rounded: a fresh prompt on SDPA attends to its keys rounded too, as a later
    step reads them)."""
    from noria.worker.attention import AttentionMetadata, LayerAttention, TorchAttentionBackend

    monkeypatch.setattr(TorchAttentionBackend, "ROWS_MAX_LEN", rows_max_len)
    torch.manual_seed(11)
    bs, kvh, heads, d, nb = 16, 2, 6, 64, 64
    query_lens, seq_lens = [1, 37, 20, 1, 5], [40, 37, 70, 17, 6]
    tables = torch.stack([torch.randperm(nb)[:5] for _ in query_lens])
    k_cache, v_cache = torch.randn(nb, bs, kvh, d).to(dtype), torch.randn(nb, bs, kvh, d).to(dtype)
    t = sum(query_lens)
    positions = torch.cat([torch.arange(s - n, s) for n, s in zip(query_lens, seq_lens, strict=True)])
    seq_index = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    slots = tables[seq_index, positions // bs] * bs + positions % bs
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        positions=positions, slot_mapping=slots, query_start_loc=torch.tensor(starts), seq_lens=torch.tensor(seq_lens),
        block_tables=tables, block_size=bs, query_lens_host=query_lens, seq_lens_host=seq_lens,
        query_start_host=starts,
    )
    q, k_new, v_new = torch.randn(t, heads, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    expect_k.view(-1, kvh, d)[slots] = k_new.to(dtype)
    expect_v.view(-1, kvh, d)[slots] = v_new.to(dtype)
    backend = TorchAttentionBackend(native=True)
    backend.prepare(meta)
    assert (meta.backend_data.token_tables is not None) == (rows_max_len > 0)
    out = backend.forward(LayerAttention(heads, kvh, d, d**-0.5, window, cap), q, k_new, v_new, k_cache, v_cache,
                          meta)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    ref = _causal_reference(q, expect_k, expect_v, tables, query_lens, seq_lens, d**-0.5, window, cap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    if cap is not None:
        uncapped = _causal_reference(q, expect_k, expect_v, tables, query_lens, seq_lens, d**-0.5, window)
        assert (ref - uncapped).abs().max() > 1e-2


# The x86 levels built beside -march=native: AVX2 (x86-64-v3) has 8-float vectors where an AVX-512
# host's native build has 16, and F16C's float16 conversions; the baseline (SSE2) has 4-float
# vectors and neither, so its float16 conversions are the portable bit manipulation.
_MARCH = {"avx2": "x86-64-v3", "sse2": "x86-64"}


def _isa_build(isa):
    """paged_decode.c built for `isa` (a key of _MARCH) instead of -march=native."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"{isa} is an x86 instruction set")
    flags = [f"-march={_MARCH[isa]}" if f == "-march=native" else f for f in cpu_kernels._FLAGS]
    dll = native_build.build(cpu_kernels._SRC, flags)
    if dll is None:
        pytest.skip(f"no compiler for the {isa} build")
    return cpu_kernels.bind(dll)


def _avx2_build():
    return _isa_build("avx2")


@pytest.mark.parametrize("cap", [1.0, 5.0, 50.0])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("threads", [1, 2])
def test_soft_capped_paged_decode_matches_float64_reference(isa, window, cap, threads, monkeypatch):
    """Scores spread over about ±10 (queries scaled up): caps of 1 and 5 squash most of them, 50 a few;
    split-K (two threads over the long sequences) merges capped partials; head sizes 64 (its own
    compiled copy) and 80 (the generic one); scores of both signs and near zero."""
    if isa == "avx2":
        dll = _avx2_build()
        monkeypatch.setattr(cpu_kernels, "load", lambda: dll)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for d, heads, kvh in ((64, 8, 2), (80, 4, 4)):
            lens = [1, 15, 16, 17, 100, 333]
            q, k_cache, v_cache, tables, lens_t = _ragged_paged(d + int(cap), lens, heads, kvh, d, 16)
            q = q * 10
            out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens_t, d**-0.5, window, soft_cap=cap)
            ref = _reference(q, k_cache, v_cache, tables, lens_t, d**-0.5, window, cap)
            torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
            uncapped = _reference(q, k_cache, v_cache, tables, lens_t, d**-0.5, window)
            assert (ref - uncapped).abs().max() > 1e-3, "the cap must change these outputs"
    finally:
        torch.set_num_threads(before)


def _kernel(isa, monkeypatch):
    """paged_decode's build for `isa`: this host's -march=native one, or one of _MARCH in its place."""
    if isa != "native":
        dll = _isa_build(isa)
        monkeypatch.setattr(cpu_kernels, "load", lambda: dll)


@pytest.mark.parametrize("dtype", _HALF, ids=_HALF_IDS)
@pytest.mark.parametrize("isa", ["native", "avx2", "sse2"])
@pytest.mark.parametrize("threads", [1, 2])
def test_half_cache_matches_float64_reference_of_the_rounded_kv(isa, threads, dtype, monkeypatch):
    """A bfloat16 or float16 cache: the step's float32 rows written in the same call, rounded as
    torch rounds, then every score, softmax and sum over the widened K/V within float32 rounding of
    float64 on those same values; ragged lengths, GQA groups of 1-8 (and 3, with 15 heads), head
    sizes 64 and 128 (their own compiled copies), 80 (the generic one) and 34 (off every vector
    width: the scalar V path and the score pass's scalar tail), windows, soft caps, and a
    2,100-token sequence split across chunks."""
    _kernel(isa, monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for heads, kvh, d, bs in ((12, 4, 64, 16), (8, 1, 128, 8), (15, 5, 80, 32), (6, 2, 34, 16), (4, 4, 64, 16)):
            lens = [1, 15, 16, 17, 100, 333, 2100]
            q, k32, v32, tables, lens_t = _ragged_paged(heads * 7 + d, lens, heads, kvh, d, bs)
            q = q * 4  # sharp enough that chunks of one sequence have different maxima
            pos = lens_t - 1
            slots = tables[torch.arange(len(lens)), pos // bs] * bs + pos % bs
            k_new, v_new = torch.randn(len(lens), kvh, d) * 3, torch.randn(len(lens), kvh, d) * 3
            for window in (None, 37):
                for cap in (None, 5.0):
                    k_cache, v_cache = k32.to(dtype), v32.to(dtype)
                    assert cpu_kernels.fits(heads, d, k_cache)
                    expect_k, expect_v = k_cache.clone(), v_cache.clone()
                    expect_k.view(-1, kvh, d)[slots] = k_new.to(dtype)
                    expect_v.view(-1, kvh, d)[slots] = v_new.to(dtype)
                    out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens_t, d**-0.5, window,
                                                   new_kv=(k_new, v_new, slots), soft_cap=cap)
                    assert out.dtype == torch.float32
                    assert torch.equal(k_cache.view(torch.int16), expect_k.view(torch.int16))
                    assert torch.equal(v_cache.view(torch.int16), expect_v.view(torch.int16))
                    ref = _reference(q, expect_k, expect_v, tables, lens_t, d**-0.5, window, cap)
                    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
            # The reference is on the rounded K/V, not the float32 ones: rounding moves these outputs
            # past the tolerance (float16 keeps 3 more bits than bfloat16: about 8x less).
            unrounded = _reference(q, k32, v32, tables, lens_t, d**-0.5, None)
            assert (_reference(q, k32.to(dtype), v32.to(dtype), tables, lens_t, d**-0.5, None)
                    - unrounded).abs().max() > (1e-3 if dtype == torch.bfloat16 else 1e-4)
    finally:
        torch.set_num_threads(before)


def _as_float32(bits):
    """float32s of the given bit patterns (ints in [0, 2**32))."""
    bits = torch.as_tensor(bits, dtype=torch.int64)
    return ((bits + 2**31) % 2**32 - 2**31).to(torch.int32).view(torch.float32)


def _bf16_rounding_cases():
    """float32 bit patterns where rounding to bf16 can go wrong: ties to even either way (kept half
    odd or even), just under and over a tie, carries into the exponent, the largest floats (to
    infinity), subnormals, signed zeros and infinities, NaNs with payloads only in the low half
    (rounding must not carry them into an infinity), and random bits over every exponent."""
    special = [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x3F80FFFF, 0x3FFFFFFF, 0x7F7FFFFF, 0x7F7F7FFF,
               0x7F7F8000, 0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x00000000, 0x80000000, 0x7F800000,
               0xFF800000, 0xBF808000, 0xBF818000, 0xFF7FFFFF, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,
               0x7F80FFFF, 0x7FFFFFFF]
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**32, (4000,), dtype=torch.int64, generator=g)
    ties = (bits & ~0xFFFF) | 0x8000  # exact halves, their kept parts random
    return _as_float32(torch.cat([torch.tensor(special, dtype=torch.int64), bits, ties]))


def _f16_rounding_cases():
    """float32s where rounding to float16 can go wrong: ties to even either way (kept part odd or
    even, one carrying into the exponent), just under and over a tie; around the top, 65504 (the
    largest float16) to 65520 (the tie with 2**16: to infinity) and beyond; the subnormals, 2**-24
    (the smallest), 2**-25 (the tie with 0: to 0), 3*2**-26 (over it: to 2**-24), ties between
    subnormals, the largest subnormal and the tie up into 2**-14; float32 subnormals, signed zeros
    and infinities; NaNs with payloads only in the 13 bits a float16 drops; and random bits, over
    every exponent and over float16's."""
    special = [0x3F801000, 0x3F803000, 0x3F800FFF, 0x3F801001, 0x3FFFF000, 0x3FFFEFFF, 0xBF801000, 0xBF803000,
               0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x007FFFFF, 0x80000001, 0x00000000, 0x80000000, 0x7F800000,
               0xFF800000, 0x33000001, 0x32FFFFFF, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7F801000,
               0x7F800FFF, 0x7FFFFFFF]
    values = [65504.0, 65519.0, 65519.99609375, 65520.0, 65520.00390625, 65536.0, 1e5, -65504.0, -65520.0,
              2.0**-24, 2.0**-25, 3 * 2.0**-26, 3 * 2.0**-25, 5 * 2.0**-25, 7 * 2.0**-25, 2.0**-14 - 2.0**-24,
              2.0**-14 - 2.0**-25, 2.0**-14, 2.0**-15, 2.0**-14 * (1 + 2.0**-11), -(2.0**-24), -(2.0**-25),
              -3 * 2.0**-26, 1.0, 2.0**15]
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**32, (4000,), dtype=torch.int64, generator=g)
    exponents = torch.randint(100, 144, (4000,), dtype=torch.int64, generator=g)  # 2**-27 .. 2**16
    in_range = (bits & 0x807FFFFF) | exponents << 23
    ties = (in_range & ~0x1FFF) | 0x1000  # exact halves (of normals), their kept parts random
    return torch.cat([_as_float32(special), torch.tensor(values, dtype=torch.float32), _as_float32(bits),
                      _as_float32(in_range), _as_float32(ties)])


@pytest.mark.parametrize("kvh, d", [(2, 64), (1, 60)])  # rows of 128 and 60: 60 leaves 8- and 1-wide tails
@pytest.mark.parametrize("dtype", _HALF, ids=_HALF_IDS)
@pytest.mark.parametrize("isa", ["native", "avx2", "sse2"])
def test_half_rows_are_rounded_as_torch_rounds(isa, dtype, kvh, d, monkeypatch):
    """The rows the kernel writes into a bf16 or float16 cache are `.to(dtype)` of the float32 rows,
    bit for bit; a NaN stays a NaN (torch itself writes different NaN bits on different paths)."""
    _kernel(isa, monkeypatch)
    bs = 16
    values = _bf16_rounding_cases() if dtype == torch.bfloat16 else _f16_rounding_cases()
    rows = -(-values.numel() // (kvh * d))
    flat = torch.zeros(rows * kvh * d)
    flat[: values.numel()] = values
    k_new = flat.view(rows, kvh, d)
    v_new = -k_new
    nb = -(-rows // bs) + 1
    slots = torch.randperm(nb * bs - 1)[:rows]  # scattered, never the last slot
    k_cache = torch.zeros(nb, bs, kvh, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    cpu_kernels.paged_decode(torch.randn(1, 2, d), k_cache, v_cache, torch.tensor([[nb - 1]]), torch.tensor([bs]),
                             0.1, None, new_kv=(k_new, v_new, slots))
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        got = cache.view(-1, kvh, d)[slots]
        want = new.to(dtype)
        nan = torch.isnan(new)
        assert nan.any() and torch.equal(torch.isnan(got), nan)
        assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
        assert torch.isinf(got).sum() > 4  # the cases cover the infinities and the carries into them
        if dtype == torch.float16:  # and the subnormals, which must not be flushed to zero
            assert (got.view(torch.int16)[~nan] & 0x7C00 == 0).sum() > 100
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots] = True
    assert not k_cache.view(-1, kvh, d)[~written].any()  # nothing else written


@pytest.mark.parametrize("d", [64, 35])  # V widened a vector at a time, and (35: no multiple of 4) one by one
@pytest.mark.parametrize("isa", ["native", "avx2", "sse2"])
def test_every_float16_widens_exactly(isa, d, monkeypatch):
    """Each of the 65,536 float16 bit patterns, as a V row of a one-token context (softmax weight
    exactly 1), comes out as the float32 of its value: normals, subnormals, infinities; NaNs as
    NaNs (a zero's sign is not kept: the sum starts at +0)."""
    _kernel(isa, monkeypatch)
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    b = -(-patterns.numel() // d)
    v_cache = torch.zeros(b * d, dtype=torch.float16)
    v_cache[: patterns.numel()] = patterns
    v_cache = v_cache.view(b, 1, 1, d)  # one block of one token per sequence
    k_cache = torch.zeros_like(v_cache)
    out = cpu_kernels.paged_decode(torch.randn(b, 1, d), k_cache, v_cache, torch.arange(b).view(b, 1),
                                   torch.ones(b, dtype=torch.int64), d**-0.5, None)
    got, want = out.view(-1)[: patterns.numel()], patterns.float()
    nan = torch.isnan(want)
    assert nan.sum() == 2 * 1023 and torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], want[~nan])  # == compares values: +0 equals -0
    assert torch.equal(got.abs()[~nan].view(torch.int32), want.abs()[~nan].view(torch.int32))

"""The native CPU decode kernel against a float64 reference and the torch path."""

from __future__ import annotations

import platform

import pytest
import torch

from noria.worker import cpu_kernels, native_build


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


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-gather"])
def test_both_decode_paths_of_the_torch_backend_agree_with_the_reference(native):
    from noria.worker.attention import AttentionMetadata, LayerAttention, TorchAttentionBackend

    torch.manual_seed(1)
    bs, d, nb, heads, kvh = 16, 64, 40, 12, 4
    lens = torch.tensor([1, 16, 17, 70])
    tables = torch.stack([torch.randperm(nb)[:5] for _ in lens])
    k_cache, v_cache = torch.randn(nb, bs, kvh, d), torch.randn(nb, bs, kvh, d)
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


@pytest.mark.parametrize("cap", [None, 2.0], ids=["uncapped", "soft-capped"])
@pytest.mark.parametrize("native", [True, False], ids=["native-fused-write", "torch"])
def test_backend_forward_on_a_decode_step_writes_the_cache_and_attends(native, cap):
    from noria.worker.attention import AttentionMetadata, LayerAttention, TorchAttentionBackend

    bs, kvh, heads, d = 16, 2, 8, 64
    lens = [3, 16, 17, 90]
    q, k_cache, v_cache, tables, lens_t = _ragged_paged(5, lens, heads, kvh, d, bs)
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
    expect_k.view(-1, kvh, d)[slots] = k_new
    expect_v.view(-1, kvh, d)[slots] = v_new
    backend = TorchAttentionBackend(native=native)
    backend.prepare(meta)
    out = backend.forward(LayerAttention(heads, kvh, d, d**-0.5, logits_soft_cap=cap), q, k_new, v_new, k_cache,
                          v_cache, meta)
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


@pytest.mark.parametrize("cap", [None, 2.0], ids=["uncapped", "soft-capped"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("rows_max_len", [512, 0], ids=["token-rows", "sdpa"])
def test_backend_forward_on_a_mixed_prefill_step(window, rows_max_len, cap, monkeypatch):
    """Decodes, a fresh prompt, a chunk after a cached prefix and a one-token-context
    prompt in one step: both prefill paths (every token a native decode row, and one
    SDPA per sequence, or the soft-capped attention where SDPA cannot cap) write the
    step's K/V and match the float64 causal reference."""
    from noria.worker.attention import AttentionMetadata, LayerAttention, TorchAttentionBackend

    monkeypatch.setattr(TorchAttentionBackend, "ROWS_MAX_LEN", rows_max_len)
    torch.manual_seed(11)
    bs, kvh, heads, d, nb = 16, 2, 6, 64, 64
    query_lens, seq_lens = [1, 37, 20, 1, 5], [40, 37, 70, 17, 6]
    tables = torch.stack([torch.randperm(nb)[:5] for _ in query_lens])
    k_cache, v_cache = torch.randn(nb, bs, kvh, d), torch.randn(nb, bs, kvh, d)
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
    expect_k.view(-1, kvh, d)[slots] = k_new
    expect_v.view(-1, kvh, d)[slots] = v_new
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


def _avx2_build():
    """paged_decode.c built for AVX2 (x86-64-v3) instead of -march=native: its vectors are 8 floats
    wide where an AVX-512 host's native build has 16, so both widths run on such a host."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX2 is an x86 instruction set")
    flags = ["-march=x86-64-v3" if f == "-march=native" else f for f in cpu_kernels._FLAGS]
    dll = native_build.build(cpu_kernels._SRC, flags)
    if dll is None:
        pytest.skip("no compiler for the AVX2 build")
    return cpu_kernels.bind(dll)


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

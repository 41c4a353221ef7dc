"""The native CPU decode kernel against a float64 reference and the torch path."""

from __future__ import annotations

import pytest
import torch

from noria.worker import cpu_kernels


def _reference(q, k_cache, v_cache, tables, lens, scale, window):
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
            s = (k[lo:, kh] @ q[i, head]) * scale
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

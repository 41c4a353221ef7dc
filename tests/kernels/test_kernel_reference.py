"""The torch reference (the tests' oracle) against a deliberately naive element-by-element
computation, on a small paged scene."""

from __future__ import annotations

import math

import torch

from noria.kernels import reference
from noria.kernels.instances import AttentionConfig
from noria.kernels.scenes import make_scene


def naive_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    qsl: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    heads = query.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s in range(len(seq_lens)):
        n = int(qsl[s + 1] - qsl[s])
        for i in range(n):
            t = int(qsl[s]) + i
            pos = int(seq_lens[s]) - n + i
            for h in range(heads):
                kh = h // (heads // kvh)
                first = 0 if window is None else max(0, pos - window + 1)
                rows = [(int(tables[s][p // bs]), p % bs) for p in range(first, pos + 1)]
                scores = [
                    scale * float(query[t, h].double() @ k_cache[b, o, kh].double())
                    for b, o in rows
                ]
                if soft_cap is not None:
                    scores = [soft_cap * math.tanh(x / soft_cap) for x in scores]
                top = max(scores)
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights)
                for (b, o), w in zip(rows, weights, strict=True):
                    out[t, h] += w / total * v_cache[b, o, kh].double()
    return out


def test_prefill_reference_matches_naive() -> None:
    cfg = AttentionConfig("float32", 64, 16)
    scene = make_scene(cfg, [1, 15, 17, 40, 0], num_kv_heads=2, seed=3)
    q_lens = [1, 15, 6, 3, 0]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), 4, 64, generator=torch.Generator().manual_seed(4))
    args = (query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, 0.3)
    got = reference.paged_attention_prefill(*args)
    assert torch.allclose(got, naive_prefill(*args), rtol=1e-10, atol=1e-10)


def test_windowed_capped_reference_matches_naive() -> None:
    """Sliding windows (one token, across a block edge, longer than the context) and the logit
    soft-cap against the element-by-element loop; the cap and the window both matter here."""
    cfg = AttentionConfig("float32", 64, 16)
    scene = make_scene(cfg, [1, 15, 17, 40, 0], num_kv_heads=2, seed=3)
    q_lens = [1, 15, 6, 3, 0]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = 4 * torch.randn(int(qsl[-1]), 4, 64, generator=torch.Generator().manual_seed(4))
    args = (query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, 0.3)
    plain = reference.paged_attention_prefill(*args)
    for window, cap in ((1, None), (7, None), (100, None), (None, 2.0), (7, 2.0)):
        got = reference.paged_attention_prefill(*args, window=window, soft_cap=cap)
        assert torch.allclose(got, naive_prefill(*args, window, cap), rtol=1e-10, atol=1e-10)
        assert (window == 100) == torch.allclose(got, plain, rtol=1e-10, atol=1e-10), (window, cap)


def test_decode_reference_is_prefill_with_one_token_each() -> None:
    cfg = AttentionConfig("float32", 64, 32)
    scene = make_scene(cfg, [0, 1, 31, 32, 33, 100], num_kv_heads=1, seed=5)
    query = torch.randn(6, 4, 64, generator=torch.Generator().manual_seed(6))
    decode = reference.paged_attention_decode(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, 0.2
    )
    qsl = torch.arange(7, dtype=torch.int32)
    prefill = reference.paged_attention_prefill(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, 0.2
    )
    assert torch.allclose(decode[1:], prefill[1:], rtol=1e-12, atol=1e-12)
    assert torch.equal(decode[0], torch.zeros(4, 64, dtype=torch.float64))  # empty context


def test_reshape_and_cache_reference_skips_negative_slots() -> None:
    k = torch.zeros(2, 4, 1, 8)
    v = torch.zeros(2, 4, 1, 8)
    key = torch.arange(3 * 8, dtype=torch.float32).view(3, 1, 8) + 1
    reference.reshape_and_cache(key, -key, k, v, torch.tensor([5, -1, 0]))
    assert torch.equal(k[1, 1, 0], key[0, 0]) and torch.equal(k[0, 0, 0], key[2, 0])
    assert torch.equal(v[1, 1, 0], -key[0, 0])
    assert int((k != 0).any(-1).sum()) == 2

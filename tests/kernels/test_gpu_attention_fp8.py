"""The fp8 (e4m3) KV cache kernels on a GPU (bin/gpu-session's test phase; skipped elsewhere,
where tests/kernels/test_attention_fp8.py runs them under the emulator): every fp8 instance's
decode (single and split) and prefill against the float64 reference over the dequantized cache,
and the cache write bit for bit against the torch path's quantization."""

from __future__ import annotations

import pytest
import torch

from noria.kernels import ops, reference
from noria.kernels.instances import AttentionConfig, fp8_configs
from noria.kernels.scenes import TORCH_DTYPES, assert_matches, edge_lengths, make_scene

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
SCALE = 0.37
K_SCALE, V_SCALE = 0.02, 0.01


def fp8_caches(cfg: AttentionConfig, lens: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """(k8, v8, tables, seq_lens) on the device and (k, v) dequantized in float64 on the host."""
    scene = make_scene(AttentionConfig(cfg.dtype, cfg.head_dim, cfg.block_size), lens, 2, seed)
    k8 = reference.fp8_quantize(scene.k_cache.float(), K_SCALE)
    v8 = reference.fp8_quantize(scene.v_cache.float(), V_SCALE)
    dev = tuple(t.to(CUDA) for t in (k8, v8, scene.block_tables, scene.seq_lens))
    return (*dev, reference.fp8_dequantize(k8, K_SCALE), reference.fp8_dequantize(v8, V_SCALE),
            scene.block_tables, scene.seq_lens)


@pytest.mark.parametrize("cfg", fp8_configs(), ids=repr)
@pytest.mark.parametrize("split", [False, True])
def test_fp8_decode(cfg: AttentionConfig, split: bool) -> None:
    lens = edge_lengths(cfg.block_size, 3001)
    k8, v8, tables, seq_lens, k, v, host_tables, host_lens = fp8_caches(cfg, lens, seed=1)
    g = torch.Generator().manual_seed(2)
    query = torch.randn(len(lens), 8, cfg.head_dim, generator=g).to(TORCH_DTYPES[cfg.dtype])
    expected = reference.paged_attention_decode(query, k, v, host_tables, host_lens, SCALE)
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=CUDA)
    ops.paged_attention_decode(out, query.to(CUDA), k8, v8, tables, seq_lens, SCALE, max_seq_len=max(lens),
                               split=split, k_scale=K_SCALE, v_scale=V_SCALE)
    assert_matches(out.cpu(), expected, cfg.dtype)


@pytest.mark.parametrize("cfg", fp8_configs(), ids=repr)
def test_fp8_prefill(cfg: AttentionConfig) -> None:
    bs = cfg.block_size
    batch = [(1, 1), (bs + 1, bs + 1), (2 * bs + 5, 7), (2000, 40), (3 * bs, 1), (0, 0)]
    k8, v8, tables, seq_lens, k, v, host_tables, host_lens = fp8_caches(cfg, [c for c, _ in batch], seed=3)
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor([q for _, q in batch]).cumsum(0)
    g = torch.Generator().manual_seed(4)
    query = torch.randn(int(qsl[-1]), 8, cfg.head_dim, generator=g).to(TORCH_DTYPES[cfg.dtype])
    expected = reference.paged_attention_prefill(query, k, v, host_tables, host_lens, qsl, SCALE)
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=CUDA)
    ops.paged_attention_prefill(out, query.to(CUDA), k8, v8, tables, seq_lens, qsl.to(CUDA), SCALE,
                                k_scale=K_SCALE, v_scale=V_SCALE)
    assert_matches(out.cpu(), expected, cfg.dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_cache_write(dtype: str) -> None:
    """Saturation, ties to even and subnormals as torch's conversion (-ftz does not flush them)."""
    g = torch.Generator().manual_seed(5)
    tokens, kv_heads, d = 64, 2, 128
    key = (torch.randn(tokens, kv_heads, d, generator=g) * 300).to(TORCH_DTYPES[dtype])
    value = (torch.randn(tokens, kv_heads, d, generator=g) * 0.01).to(TORCH_DTYPES[dtype])
    slots = torch.randperm(4 * 16, generator=g)[:tokens]
    k_cache = torch.zeros(4, 16, kv_heads, d, dtype=reference.FP8)
    v_cache = k_cache.clone()
    k_cache_d, v_cache_d = k_cache.to(CUDA), v_cache.to(CUDA)
    ops.reshape_and_cache(key.to(CUDA), value.to(CUDA), k_cache_d, v_cache_d, slots.to(CUDA), k_scale=0.7, v_scale=0.3)
    reference.reshape_and_cache(key, value, k_cache, v_cache, slots, 0.7, 0.3)
    assert torch.equal(k_cache_d.cpu().view(torch.uint8), k_cache.view(torch.uint8))
    assert torch.equal(v_cache_d.cpu().view(torch.uint8), v_cache.view(torch.uint8))

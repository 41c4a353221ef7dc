"""The kernels' contracts on a real GPU, through CuPy and torch's current stream. conftest
collects this module only when CUDA is available; every dtype x head size x block size runs.
"""

from __future__ import annotations

import pytest
import torch

from noria.kernels import ops, reference
from noria.kernels.instances import AttentionConfig, all_configs
from noria.kernels.scenes import TORCH_DTYPES, Scene, assert_matches, edge_lengths, make_scene

CUDA = torch.device("cuda")
SCALE = 0.37


def on_gpu(scene: Scene) -> tuple[torch.Tensor, ...]:
    return tuple(
        t.to(CUDA) for t in (scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens)
    )


@pytest.mark.parametrize("cfg", all_configs(), ids=repr)
@pytest.mark.parametrize("split", [False, True])
def test_decode(cfg: AttentionConfig, split: bool) -> None:
    lens = edge_lengths(cfg.block_size, 3001)
    scene = make_scene(cfg, lens, num_kv_heads=2, seed=1)
    g = torch.Generator().manual_seed(2)
    query = torch.randn(len(lens), 8, cfg.head_dim, generator=g).to(TORCH_DTYPES[cfg.dtype])
    expected = reference.paged_attention_decode(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, SCALE
    )
    k, v, tables, seq_lens = on_gpu(scene)
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=CUDA)
    ops.paged_attention_decode(
        out, query.to(CUDA), k, v, tables, seq_lens, SCALE, max_seq_len=max(lens), split=split
    )
    assert_matches(out.cpu(), expected, cfg.dtype)


@pytest.mark.parametrize("cfg", all_configs(), ids=repr)
def test_prefill(cfg: AttentionConfig) -> None:
    bs = cfg.block_size
    batch = [(1, 1), (bs + 1, bs + 1), (2 * bs + 5, 7), (2000, 40), (3 * bs, 1), (0, 0)]
    scene = make_scene(cfg, [c for c, _ in batch], num_kv_heads=2, seed=3)
    q_lens = torch.tensor([q for _, q in batch])
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    g = torch.Generator().manual_seed(4)
    query = torch.randn(int(qsl[-1]), 8, cfg.head_dim, generator=g).to(TORCH_DTYPES[cfg.dtype])
    expected = reference.paged_attention_prefill(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, SCALE
    )
    k, v, tables, seq_lens = on_gpu(scene)
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=CUDA)
    ops.paged_attention_prefill(out, query.to(CUDA), k, v, tables, seq_lens, qsl.to(CUDA), SCALE)
    assert_matches(out.cpu(), expected, cfg.dtype)


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_reshape_and_cache_and_swap(dtype: str) -> None:
    t = TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(5)
    k_cache = torch.full((16, 16, 2, 128), float("nan"), dtype=t)
    v_cache = k_cache.clone()
    key = torch.randn(20, 2, 128, generator=g).to(t)
    value = torch.randn(20, 2, 128, generator=g).to(t)
    slots = torch.randperm(256, generator=g)[:20]
    slots[::4] = -1
    reference.reshape_and_cache(key, value, k_cache, v_cache, slots)
    k_gpu = torch.full(k_cache.shape, float("nan"), dtype=t, device=CUDA)
    v_gpu = k_gpu.clone()
    ops.reshape_and_cache(key.to(CUDA), value.to(CUDA), k_gpu, v_gpu, slots.to(CUDA))
    assert torch.equal(k_gpu.cpu().nan_to_num(7.0), k_cache.nan_to_num(7.0))
    # Swap every cache out to pinned CPU memory and back in, one launch per direction.
    cpu = [torch.zeros(k_cache.shape, dtype=t).pin_memory() for _ in range(2)]
    mapping = torch.tensor([[i, 15 - i] for i in range(16)])
    ops.copy_blocks([k_gpu, v_gpu], cpu, mapping)
    torch.cuda.synchronize()
    assert torch.equal(cpu[0][15 - 3].nan_to_num(7.0), k_cache[3].nan_to_num(7.0))
    back = [torch.empty_like(k_gpu) for _ in range(2)]
    ops.copy_blocks(cpu, back, mapping[:, [1, 0]])
    assert torch.equal(back[1].cpu().nan_to_num(7.0), v_cache.nan_to_num(7.0))

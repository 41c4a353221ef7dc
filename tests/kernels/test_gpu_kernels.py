"""The kernels' contracts on a real GPU, through CuPy and torch's current stream. conftest
collects this module only when CUDA is available; every dtype x head size x block size runs.
"""

from __future__ import annotations

import numpy as np
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


@pytest.mark.parametrize("cfg", all_configs(), ids=repr)
def test_window_and_soft_cap(cfg: AttentionConfig) -> None:
    """kernels.contracts' sliding-window and soft-capped checks (every key before a window
    poisoned) on the device: split-K decode and prefill, every configuration."""
    from noria.kernels import contracts
    from noria.kernels.backends import CupyBackend

    be = CupyBackend()
    kw = {"window": contracts.WINDOW, "soft_cap": contracts.SOFT_CAP}
    contracts.check_decode(cfg, be, CUDA, 3001, split=True, **kw)
    contracts.check_decode(cfg, be, CUDA, 3001, split=False, **kw)
    contracts.check_prefill(cfg, be, CUDA, 2000, **kw)


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


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("hidden", [4096, 37], ids=["aligned", "odd"])
def test_fused_elementwise(dtype: str, hidden: int) -> None:
    """fused_ops.cu on the device: 16-byte and one-element instances against float64."""
    from test_fused_ops import _qkv_case

    from noria.kernels import fused_ops

    t = TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g).to(t)
    res = torch.randn(5, hidden, generator=g).to(t)
    w = (1 + 0.5 * torch.randn(hidden, generator=g)).to(t)
    expected, expected_sum = reference.add_rms_norm(x, res, w, 1e-5)
    res_gpu = res.to(CUDA)
    out = fused_ops.add_rms_norm(x.to(CUDA), res_gpu, w.to(CUDA), 1e-5)
    assert_matches(out.cpu(), expected, dtype)
    assert torch.equal(res_gpu.cpu(), expected_sum)
    gate_up = torch.randn(5, 2 * hidden, generator=g).to(t)
    assert_matches(fused_ops.silu_and_mul(gate_up.to(CUDA)).cpu(), reference.silu_and_mul(gate_up), dtype)
    heads, kv_heads, d = 8, 2, 128
    qkv, cos, sin = _qkv_case(dtype, 7, heads, kv_heads, d, 0, 3)
    k_cache = torch.full((4, 16, kv_heads, d), float("nan"), dtype=t, device=CUDA)
    v_cache = k_cache.clone()
    slots = torch.tensor([3, -1, 17, 40, 63, -1, 0])
    c2, s2 = cos[:, 0], sin[:, 0]
    exp_q = reference.rotary_neox(qkv[:, : heads * d].view(7, heads, d), c2, s2)
    exp_k = reference.rotary_neox(qkv[:, heads * d : (heads + kv_heads) * d].view(7, kv_heads, d), c2, s2)
    q, k, v = fused_ops.rotary_qkv_cache(qkv.to(CUDA), cos.to(CUDA), sin.to(CUDA), k_cache, v_cache,
                                         slots.to(CUDA), heads)
    assert_matches(q.cpu(), exp_q, dtype)
    assert_matches(k.cpu(), exp_k, dtype)
    flat_k, flat_v = k_cache.view(-1, kv_heads, d).cpu(), v_cache.view(-1, kv_heads, d).cpu()
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], k.cpu()[keep]) and torch.equal(flat_v[slots[keep]], v.cpu()[keep])
    assert int(torch.isnan(flat_k).any(dim=(1, 2)).sum()) == flat_k.shape[0] - int(keep.sum())


# ---- tensor_core.cuh on the device: the emulator's model of each instruction must agree ----


def _gpu_launch(name: str, grid: int, block: int, args: tuple) -> None:
    """Runs a probe kernel (tests/kernels/tensor_core_probe_kernels.cu) through CuPy: numpy
    arrays go to the device and come back in place, numpy scalars go by value."""
    import cupy
    from test_emu_tensor_core import PROBES

    from noria.kernels.options import compile_options

    module = cupy.RawModule(code=PROBES.read_text(), options=compile_options())
    dev = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    module.get_function(name)((grid,), (block,), tuple(dev))
    cupy.cuda.Device().synchronize()
    for a, d in zip(args, dev, strict=True):
        if isinstance(a, np.ndarray):
            np.copyto(a, d.get())


@pytest.mark.parametrize("k", [16, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_mma_fragments_on_the_device(k: int, dtype: torch.dtype) -> None:
    import test_emu_tensor_core as tc

    a, b, c = tc._random_operands(k, dtype, 2, seed=k)
    a_regs = np.zeros((2, 32, k // 4), np.uint32)
    b_regs = np.zeros((2, 32, k // 8), np.uint32)
    c_regs = np.zeros((2, 32, 4), np.float32)
    for w in range(2):
        for lane in range(32):
            a_regs[w, lane] = tc._pack(tc._bits(a[w]), tc._a_coords(lane, k))
            b_regs[w, lane] = tc._pack(tc._bits(b[w]), tc._b_coords(lane, k))
            c_regs[w, lane] = [float(c[w, r, col]) for r, col in tc._c_coords(lane)]
    args = (a_regs, b_regs, c_regs, None, np.int32(dtype == torch.bfloat16))
    d_gpu = np.full((2, 32, 4), np.nan, np.float32)
    d_emu = d_gpu.copy()
    name = "mma_k16" if k == 16 else "mma_k8"
    _gpu_launch(name, 2, 32, (*args[:3], d_gpu, args[4]))
    tc.probes().get_function(name)(2, 32, (*args[:3], d_emu, args[4]))
    expected = a.double() @ b.double() + c.double()
    for w in range(2):
        for lane in range(32):
            want = [float(expected[w, r, col]) for r, col in tc._c_coords(lane)]
            np.testing.assert_allclose(d_gpu[w, lane], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_gpu, d_emu, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
def test_ldmatrix_on_the_device(num: int, trans: bool) -> None:
    import test_emu_tensor_core as tc

    rng = np.random.default_rng(num + 10 * trans)
    tile = rng.integers(0, 65536, (32, 8)).astype(np.uint16)
    row_of_lane = rng.permutation(32).astype(np.int32)
    out = np.zeros((32, 4), np.uint32)
    _gpu_launch("ldmatrix_probe", 1, 32, (tile, row_of_lane, out, np.int32(num), np.int32(trans)))
    assert np.array_equal(
        out[:, :num], tc._ldmatrix_expected(tile, row_of_lane, num, trans)[:, :num]
    )


def test_cp_async_and_tile_on_the_device() -> None:
    import test_emu_tensor_core as tc

    src = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    out = np.full((128, 12), np.nan, np.float32)
    _gpu_launch("cp_async_groups", 1, 128, (src, out))
    assert np.array_equal(out, tc._cp_async_expected(src, 128))
    g = torch.Generator().manual_seed(3)
    for dtype, name in ((torch.bfloat16, "tile_gemm_bf16"), (torch.float16, "tile_gemm_f16")):
        a = torch.randn(16, 16, generator=g).to(dtype)
        b = torch.randn(16, 8, generator=g).to(dtype)
        d = np.full((16, 8), np.nan, np.float32)
        _gpu_launch(name, 1, 32, (tc._bits(a), tc._bits(b), d))
        np.testing.assert_allclose(d, (a.double() @ b.double()).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [c for c in all_configs() if c.dtype != "float32"], ids=repr)
def test_mixed_step(cfg: AttentionConfig) -> None:
    """A mixed step through ops.paged_attention with the worker's host plan, every 16-bit
    config: the tensor-core prefill kernel over the prompts' work list (pinned, asynchronous
    upload) and the decode kernel over decode rows that are not consecutive (gathered)."""
    bs = cfg.block_size
    batch = [(1, 1), (3 * bs, 1), (bs + 1, bs + 1), (2000, 40), (300, 300), (70, 1), (0, 0)]
    scene = make_scene(cfg, [c for c, _ in batch], num_kv_heads=2, seed=3)
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor([q for _, q in batch]).cumsum(0)
    g = torch.Generator().manual_seed(4)
    query = torch.randn(int(qsl[-1]), 8, cfg.head_dim, generator=g).to(TORCH_DTYPES[cfg.dtype])
    expected = reference.paged_attention_prefill(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, SCALE
    )
    k, v, tables, seq_lens = on_gpu(scene)
    plan = ops.plan_step([q for _, q in batch], [c for c, _ in batch], CUDA)
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=CUDA)
    ops.paged_attention(
        out, query.to(CUDA), k, v, tables, seq_lens, qsl.to(CUDA), SCALE, max_query_len=300,
        max_seq_len=2000, plan=plan,
    )
    assert_matches(out.cpu(), expected, cfg.dtype)

"""The kernels' contracts as checks a tool can run on any backend: each check runs one kernel
on a random paged scene (kernels.scenes) and compares it with the float64 torch reference.

`noria doctor` runs them on the GPU (every configuration) and under the CPU emulator (a few);
the pytest suites in tests/kernels run the same comparisons with more edge cases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from noria.kernels import ops, reference
from noria.kernels.backends import KernelBackend
from noria.kernels.instances import AttentionConfig
from noria.kernels.scenes import (
    TORCH_DTYPES,
    assert_matches,
    edge_lengths,
    first_seen_decode,
    first_seen_prefill,
    make_scene,
    poison_outside_windows,
)

SCALE = 0.37
NUM_HEADS = 8
NUM_KV_HEADS = 2  # GQA: four query heads per KV head
# The sliding-window and soft-capped checks: a window that starts inside blocks and key
# tiles (every key before it poisoned, so a read outside the window shows), and a cap that
# the (scaled-up) queries' scores reach well past.
WINDOW = 45
SOFT_CAP = 5.0
CAPPED_QUERY = 3.0


@dataclass
class ContractResult:
    name: str
    error: str | None  # None: the kernel matched the reference


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _to(device: torch.device, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in ts)


def check_decode(
    cfg: AttentionConfig, be: KernelBackend, device: torch.device, long: int, split: bool,
    window: int | None = None, soft_cap: float | None = None,
) -> None:
    lens = edge_lengths(cfg.block_size, long)
    scene = make_scene(cfg, lens, num_kv_heads=NUM_KV_HEADS, seed=1)
    g = torch.Generator().manual_seed(2)
    query = torch.randn(len(lens), NUM_HEADS, cfg.head_dim, generator=g)
    if soft_cap is not None:
        query *= CAPPED_QUERY
    query = query.to(TORCH_DTYPES[cfg.dtype])
    expected = reference.paged_attention_decode(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, SCALE,
        window=window, soft_cap=soft_cap,
    )
    if window is not None:
        scene = poison_outside_windows(scene, first_seen_decode(lens, window))
    k, v, tables, seq_lens, q = _to(device, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, query)
    out = _poisoned(tuple(query.shape), query.dtype, device)
    ops.paged_attention_decode(out, q, k, v, tables, seq_lens, SCALE, max_seq_len=max(lens), split=split,
                               partition_size=_partition(cfg, split, window), window=window,
                               soft_cap=soft_cap, backend=be)
    assert_matches(out.cpu(), expected, cfg.dtype)


def _partition(cfg: AttentionConfig, split: bool, window: int | None) -> int:
    """Split-K partitions: the default, or with a window one or two blocks, so that a window
    still spans several."""
    if not split or window is None:
        return ops.DEFAULT_PARTITION_SIZE
    return cfg.block_size * max(1, 32 // cfg.block_size)


def check_prefill(
    cfg: AttentionConfig, be: KernelBackend, device: torch.device, long: int,
    window: int | None = None, soft_cap: float | None = None,
) -> None:
    bs = cfg.block_size
    # (context, query tokens): a first token, a chunk across a block edge, a prefix hit with a
    # short chunk, a long prompt, a decode row and an empty sequence.
    batch = [(1, 1), (bs + 1, bs + 1), (2 * bs + 5, 7), (long, min(long, 40)), (3 * bs, 1), (0, 0)]
    scene = make_scene(cfg, [c for c, _ in batch], num_kv_heads=NUM_KV_HEADS, seed=3)
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor([q for _, q in batch]).cumsum(0)
    g = torch.Generator().manual_seed(4)
    query = torch.randn(int(qsl[-1]), NUM_HEADS, cfg.head_dim, generator=g)
    if soft_cap is not None:
        query *= CAPPED_QUERY
    query = query.to(TORCH_DTYPES[cfg.dtype])
    expected = reference.paged_attention_prefill(
        query, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, qsl, SCALE,
        window=window, soft_cap=soft_cap,
    )
    if window is not None:
        scene = poison_outside_windows(scene, first_seen_prefill([c for c, _ in batch], [q for _, q in batch], window))
    k, v, tables, seq_lens, q, qsl_d = _to(
        device, scene.k_cache, scene.v_cache, scene.block_tables, scene.seq_lens, query, qsl
    )
    out = _poisoned(tuple(query.shape), query.dtype, device)
    ops.paged_attention_prefill(out, q, k, v, tables, seq_lens, qsl_d, SCALE, window=window, soft_cap=soft_cap,
                                backend=be)
    assert_matches(out.cpu(), expected, cfg.dtype)


def check_cache_and_copies(dtype: str, be: KernelBackend, device: torch.device) -> None:
    """reshape_and_cache into a poisoned cache, then copy_blocks out to CPU memory (pinned when
    the cache is on a GPU, as the worker's swap area is) and back, one launch each way."""
    t = TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(5)
    shape = (16, 16, NUM_KV_HEADS, 128)
    k_ref, v_ref = torch.full(shape, float("nan"), dtype=t), torch.full(shape, float("nan"), dtype=t)
    key = torch.randn(20, NUM_KV_HEADS, 128, generator=g).to(t)
    value = torch.randn(20, NUM_KV_HEADS, 128, generator=g).to(t)
    slots = torch.randperm(shape[0] * shape[1], generator=g)[:20]
    slots[::4] = -1  # not stored
    reference.reshape_and_cache(key, value, k_ref, v_ref, slots)
    k, v = _poisoned(shape, t, device), _poisoned(shape, t, device)
    ops.reshape_and_cache(*_to(device, key, value), k, v, slots.to(device), backend=be)
    same = lambda a, b: torch.equal(a.cpu().nan_to_num(7.0), b.nan_to_num(7.0))  # noqa: E731
    if not (same(k, k_ref) and same(v, v_ref)):
        raise AssertionError("reshape_and_cache: the cache differs from the reference")
    pinned = device.type == "cuda"
    host = [torch.zeros(shape, dtype=t, pin_memory=pinned) for _ in range(2)]
    mapping = torch.tensor([[i, shape[0] - 1 - i] for i in range(shape[0])])
    ops.copy_blocks([k, v], host, mapping, backend=be)
    back = [_poisoned(shape, t, device) for _ in range(2)]
    ops.copy_blocks(host, back, mapping[:, [1, 0]], backend=be)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if not (same(host[0][shape[0] - 1 - 3], k_ref[3]) and same(back[0], k_ref) and same(back[1], v_ref)):
        raise AssertionError("copy_blocks: a swap out and back in does not restore the caches")


def run_contracts(
    configs: Iterable[AttentionConfig],
    be: KernelBackend,
    device: torch.device,
    long: int = 3001,
    on_result: Callable[[ContractResult], None] | None = None,
) -> list[ContractResult]:
    """Every contract for every configuration (decode single-pass and split-K, prefill, each
    also with a sliding window and a logit soft-cap) and the cache kernels per dtype. A failure is recorded, not raised, so that one bad instance
    does not hide the others."""
    results = []
    for name, check in _checks(list(configs), be, device, long):
        try:
            check()
            result = ContractResult(name, None)
        except Exception as e:  # noqa: BLE001 - reported per check, with its type
            result = ContractResult(name, f"{type(e).__name__}: {e}")
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def _checks(
    configs: list[AttentionConfig], be: KernelBackend, device: torch.device, long: int
) -> Iterator[tuple[str, Callable[[], None]]]:
    for cfg in configs:
        tag = f"{cfg.dtype} head {cfg.head_dim} block {cfg.block_size}"
        yield f"decode {tag}", lambda c=cfg: check_decode(c, be, device, long, split=False)
        yield f"decode split-K {tag}", lambda c=cfg: check_decode(c, be, device, long, split=True)
        yield f"prefill {tag}", lambda c=cfg: check_prefill(c, be, device, long)
        yield f"decode window + soft-cap {tag}", lambda c=cfg: check_decode(
            c, be, device, long, split=True, window=WINDOW, soft_cap=SOFT_CAP
        )
        yield f"prefill window + soft-cap {tag}", lambda c=cfg: check_prefill(
            c, be, device, long, window=WINDOW, soft_cap=SOFT_CAP
        )
    for dtype in sorted({c.dtype for c in configs}):
        yield f"reshape_and_cache + copy_blocks {dtype}", lambda d=dtype: check_cache_and_copies(d, be, device)

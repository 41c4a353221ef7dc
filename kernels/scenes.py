"""Random paged-KV scenes for the kernel contracts (tests and `noria doctor`).

A scene is a KV cache plus block tables for a batch of sequences, built to catch indexing
bugs: physical blocks are shuffled, some sequences share their prefix blocks, every cache
slot no sequence owns (and every unused block-table entry's block) holds NaN, so a kernel
that reads past a context or through a stale table entry produces NaN. For sliding windows,
`poison_outside_windows` also poisons what lies before every window, so a kernel that reads
a key no query sees produces NaN too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from noria.kernels.instances import AttentionConfig

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Max |error| of a kernel against the float64 reference, per dtype: a few units in the last
# place of the output type for values of magnitude ~1 (the kernels accumulate in float32).
TOLERANCE = {"float32": (3e-5, 3e-5), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2)}


def edge_lengths(block_size: int, long: int) -> list[int]:
    """Context lengths around block boundaries, plus a long one."""
    return [0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, long]


@dataclass
class Scene:
    cfg: AttentionConfig
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    poison_block: int

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.cfg.dtype]


def make_scene(
    cfg: AttentionConfig,
    lens: list[int],
    num_kv_heads: int,
    seed: int,
    share_prefix: bool = True,
    spare_blocks: int = 3,
) -> Scene:
    g = torch.Generator().manual_seed(seed)
    bs, d = cfg.block_size, cfg.head_dim
    dtype = TORCH_DTYPES[cfg.dtype]
    need = [-(-n // bs) for n in lens]
    # Sequences 0 and the longest share their first full blocks when both have some.
    order = sorted(range(len(lens)), key=lambda s: -lens[s])
    shared_with: dict[int, tuple[int, int]] = {}
    if share_prefix and len(lens) >= 2:
        a, b = order[0], order[1]
        full = min(lens[a], lens[b]) // bs
        if full > 0:
            shared_with[b] = (a, full)
    own = [need[s] - (shared_with[s][1] if s in shared_with else 0) for s in range(len(lens))]
    num_blocks = sum(own) + spare_blocks + 1
    perm = torch.randperm(num_blocks, generator=g).tolist()
    poison_block = perm.pop()
    width = max(need + [1]) + 2  # unused entries past each table row's end
    tables = torch.full((len(lens), width), poison_block, dtype=torch.int32)
    for s in order:  # the longest first, so the prefix it shares is assigned
        start = 0
        if s in shared_with:
            a, full = shared_with[s]
            tables[s, :full] = tables[a, :full]
            start = full
        for i in range(start, need[s]):
            tables[s, i] = perm.pop()
    owned = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for s, n in enumerate(lens):
        owned[tables[s, : n // bs].long()] = True
        if n % bs:
            owned[int(tables[s, n // bs]), : n % bs] = True
    shape = (num_blocks, bs, num_kv_heads, d)
    k = torch.randn(shape, generator=g).to(dtype).masked_fill(~owned[..., None, None], float("nan"))
    v = torch.randn(shape, generator=g).to(dtype).masked_fill(~owned[..., None, None], float("nan"))
    return Scene(cfg, k, v, tables, torch.tensor(lens, dtype=torch.int32), poison_block)


def first_seen_prefill(seq_lens: list[int], query_lens: list[int], window: int) -> list[int]:
    """Per sequence, the first position any of its query tokens sees through a sliding window
    (its context length when it has no query tokens)."""
    return [max(0, n - q - window + 1) if q else n for n, q in zip(seq_lens, query_lens, strict=True)]


def first_seen_decode(seq_lens: list[int], window: int) -> list[int]:
    """Per sequence, the first position its decode query sees through a sliding window."""
    return [max(0, n - window) for n in seq_lens]


def poison_outside_windows(scene: Scene, first_seen: list[int]) -> Scene:
    """A copy of the scene in which every cache slot that no sequence sees (positions before
    first_seen[s] of sequence s, unless another sequence sharing the block sees them) holds NaN
    and every block-table entry of a block wholly before first_seen[s] names the poison block.
    The reference is computed on the clean scene; a kernel run on this one that loads a key or
    a block-table entry before a window produces NaN."""
    bs = scene.cfg.block_size
    k, v, tables = scene.k_cache.clone(), scene.v_cache.clone(), scene.block_tables.clone()
    seen = torch.zeros(k.shape[0], bs, dtype=torch.bool)
    for s, lo in enumerate(first_seen):
        pos = torch.arange(lo, int(scene.seq_lens[s]))
        seen[tables[s, pos // bs].long(), pos % bs] = True
    k[~seen] = float("nan")
    v[~seen] = float("nan")
    for s, lo in enumerate(first_seen):
        tables[s, : lo // bs] = scene.poison_block
    return Scene(scene.cfg, k, v, tables, scene.seq_lens, scene.poison_block)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype_name: str) -> None:
    # Not torch.testing.assert_close: its first call imports torch.distributed (1.5 s).
    atol, rtol = TOLERANCE[dtype_name]
    nan = torch.isnan(actual)
    assert not nan.any(), f"{int(nan.sum())} NaN outputs: unwritten or read poisoned memory"
    a, e = actual.double(), expected.double()
    bad = (a - e).abs() > atol + rtol * e.abs()
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} elements differ (atol {atol}, rtol {rtol}); "
            f"first at {first}: {a[first].item()} vs {e[first].item()}, "
            f"max |diff| {(a - e).abs().max().item():.3g}"
        )

"""The scheduler's block bookkeeping checked against itself (tests and the `blocks_consistent` stat)."""

from __future__ import annotations

from collections.abc import Iterable

from noria.scheduler.kv_cache_manager import KVCacheManager
from noria.scheduler.request import Request


def check_blocks(kv: KVCacheManager, requests: Iterable[Request], held: Iterable[list[int]] = ()) -> str | None:
    """Free + owned blocks add up, and each block's references equal its owners (requests,
    and the transfers a producer holds for consumers: `held`)."""
    problem = kv.pool.check()
    if problem:
        return problem
    owners = [0] * kv.pool.num_blocks
    cpu_owned = 0
    for req in requests:
        for b in req.block_ids:
            owners[b] += 1
        cpu_owned += len(req.swapped_blocks)
    for blocks in held:
        for b in blocks:
            owners[b] += 1
    for b, (refs, own) in enumerate(zip(kv.pool.ref_cnt, owners, strict=True)):
        if refs != own:
            return f"block {b} has {refs} references but {own} owners"
    if cpu_owned + len(kv.cpu_free) != kv.num_cpu_blocks:
        return f"CPU blocks: {cpu_owned} owned + {len(kv.cpu_free)} free != {kv.num_cpu_blocks}"
    return None

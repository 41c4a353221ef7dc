"""What a worker group's arrival and loss do to the scheduler's state: a fresh KV pool of the
group's size, the requests of a lost group sent back to wait, every request failed when none
comes back."""

from __future__ import annotations

import heapq
from collections.abc import Callable

from noria.protocol.client import SchedulerStats
from noria.protocol.config import EngineConfig
from noria.protocol.errors import ErrorCode
from noria.scheduler.kv_cache_manager import KVCacheManager
from noria.scheduler.request import Request, Status


class WorkerGroups:
    """The worker-group half of `Scheduler` (scheduler/scheduler.py), which owns these attributes."""

    config: EngineConfig
    block_size: int
    model_len: int
    max_model_len: int
    token_budget: int
    swap: bool
    kv: KVCacheManager
    stats: SchedulerStats
    requests: dict[int, Request]
    running: list[Request]
    swapped: list[Request]
    waiting: list[tuple[tuple[int, int], int]]
    _worker_drop: list[int]
    _swap_out: list[tuple[int, int]]
    _transfers_after_worker_loss: Callable[[], list[Request]]  # scheduler/kv_transfer.py's
    _forget_drafts: Callable[[], None]  # scheduler/speculation.py's

    def _finish(self, req: Request) -> None:
        raise NotImplementedError

    def reject(self, req_id: int, code: str, message: str) -> None:
        raise NotImplementedError

    def install_kv(self, num_kv_blocks: int, num_cpu_blocks: int, max_model_len: int | None = None) -> None:
        """A fresh, empty KV pool of a worker group's size (nothing may hold blocks: a new
        group starts after `reset_after_worker_loss`). Waiting requests that the new
        capacity cannot hold end with `prompt_too_long`."""
        self.model_len = max_model_len or self.model_len
        # No request can outgrow the whole cache, or it would preempt itself forever.
        bound = num_kv_blocks * self.block_size if num_kv_blocks else self.model_len
        self.max_model_len = min(self.model_len, bound)
        self.token_budget = self.config.resolved_max_num_batched_tokens(self.max_model_len)
        for req in self.requests.values():
            req.set_decode_limit(self.max_model_len)
        self.kv = KVCacheManager(num_kv_blocks, self.block_size, self.config.enable_prefix_caching,
                                 num_cpu_blocks if self.swap else 0)
        self.stats.num_kv_blocks = num_kv_blocks
        self.stats.num_cpu_blocks = num_cpu_blocks if self.swap else 0
        # A pooling request needs no room for an output token.
        for req in [r for r in self.requests.values() if r.num_tokens >= self.max_model_len + r.pooling]:
            self._finish(req)
            self.reject(req.req_id, ErrorCode.PROMPT_TOO_LONG,
                         f"{req.num_tokens} tokens do not fit the new worker group's KV cache "
                         f"({self.max_model_len} tokens at most)")

    def reset_after_worker_loss(self) -> None:
        """The worker group is gone with every KV block it held. Running and swapped requests
        wait again for recompute, keeping every token they have (their outputs included), in
        their priority/arrival order; the KV pool, prefix cache and swap area are dropped, and
        with them the advance of the step in flight (its result is never applied, so no token
        is emitted twice or skipped). Capacity stays as it was until the next group's."""
        for req in self.running + self.swapped + self._transfers_after_worker_loss():
            self.stats.requests_requeued += 1
            self.stats.tokens_recomputed += req.num_computed_tokens
            req.num_preemptions += 1  # so that re-admission does not count its prompt twice
            req.status = Status.WAITING
            heapq.heappush(self.waiting, (req.sort_key, req.req_id))
        for req in self.requests.values():
            req.num_computed_tokens = 0
            req.block_ids, req.num_cached_blocks, req.swapped_blocks = [], 0, []
            req.in_worker = False
            req.num_worker_tokens = len(req.token_ids)  # the tokens on their way are lost with the group
        self.running, self.swapped = [], []
        self._worker_drop, self._swap_out = [], []
        self._forget_drafts()
        self.install_kv(self.kv.pool.num_blocks, self.kv.num_cpu_blocks)

    def fail_all(self, code: str, message: str) -> int:
        """End every request with an error (no worker came back in time); how many ended."""
        reqs = list(self.requests.values())
        for req in reqs:
            self._finish(req)
            self.reject(req.req_id, code, message)
        self.running, self.swapped, self.waiting = [], [], []
        return len(reqs)

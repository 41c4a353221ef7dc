"""The iteration-level scheduler: one StepPlan per step, reconciled by its StepResult.

Each step: running requests first (a decode costs one token, a prompt still in
prefill takes a chunk of what is left of the token budget), preempting the
lowest-priority, latest request when blocks run out; then waiting requests
board in (priority, arrival) order while blocks, the budget and the sequence
cap allow. State advances when a step is planned and is reconciled when its
result arrives.
"""

from __future__ import annotations

import heapq
from bisect import insort

from protocol.config import EngineConfig
from protocol.engine import EngineRequest, RequestUpdate, SchedulerStats
from protocol.errors import ErrorCode
from protocol.step import CachedRequestData, NewRequestData, StepPlan, StepResult
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request, Status


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int) -> None:
        self.config = config
        self.block_size = config.block_size
        # No request can outgrow the whole cache, or it would preempt itself forever.
        self.max_model_len = min(max_model_len, num_kv_blocks * config.block_size)
        self.max_num_seqs = config.max_num_seqs
        self.token_budget = config.resolved_max_num_batched_tokens(self.max_model_len)
        self.chunked_prefill = config.enable_chunked_prefill
        self.kv = KVCacheManager(num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[int, Request] = {}
        self.waiting: list[tuple[tuple[int, int], int]] = []  # heap of (sort_key, req_id)
        self.running: list[Request] = []  # sorted by sort_key
        self.updates: list[RequestUpdate] = []  # pending messages for the frontend
        self._worker_drop: list[int] = []  # requests the worker must forget
        self._arrivals = 0
        self.step_id = 0
        self.stats = SchedulerStats(num_kv_blocks=num_kv_blocks)

    # ---- input -----------------------------------------------------------

    def add_request(self, msg: EngineRequest) -> None:
        n = len(msg.prompt_token_ids)
        if msg.req_id in self.requests:
            return self._reject(msg.req_id, ErrorCode.DUPLICATE_REQUEST, f"request {msg.req_id} is already in flight")
        if n == 0:
            return self._reject(msg.req_id, ErrorCode.INVALID_REQUEST, "prompt is empty")
        if n >= self.max_model_len:
            return self._reject(
                msg.req_id,
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {n} tokens but this engine accepts at most {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len} leaves room for at least one output token)",
            )
        max_tokens = msg.params.max_tokens or self.max_model_len - n
        req = Request(msg, self._arrivals, max_tokens)
        self._arrivals += 1
        self.requests[req.req_id] = req
        heapq.heappush(self.waiting, (req.sort_key, req.req_id))
        self.stats.prompt_tokens += n

    def abort(self, req_ids: list[int]) -> None:
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req)
                self.updates.append(RequestUpdate(rid, [], finish_reason="abort"))
        self.running = [r for r in self.running if r.status == Status.RUNNING]

    def _reject(self, req_id: int, code: str, message: str) -> None:
        self.updates.append(
            RequestUpdate(req_id, [], finish_reason="error", error_code=code, error_message=message)
        )

    # ---- planning --------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._worker_drop)

    def schedule(self) -> StepPlan:
        budget = self.token_budget
        batch: list[tuple[Request, int, list[int]]] = []
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            added = self.kv.allocate_slots(req, num_new)
            while added is None:
                # The victim is the lowest-priority, latest request still unplanned
                # (running is sorted, and everything before i is already planned).
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                added = self.kv.allocate_slots(req, num_new)
            if added is None:
                break
            batch.append((req, num_new, added))
            budget -= num_new
            i += 1

        if not preempted:
            budget = self._admit(budget, batch)

        return self._build_plan(batch)

    def _admit(self, budget: int, batch: list[tuple[Request, int, list[int]]]) -> int:
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.requests.get(waiting[0][1])
            if req is None or req.status != Status.WAITING:
                heapq.heappop(waiting)  # aborted while waiting
                continue
            hits = self.kv.get_computed_blocks(req)
            num_computed = len(hits) * self.block_size
            num_new = req.num_tokens - num_computed
            if not self.chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            added = self.kv.allocate_slots(req, num_new, hits)
            if added is None:
                break
            heapq.heappop(waiting)
            req.status = Status.RUNNING
            req.num_computed_tokens = num_computed
            if req.num_output_tokens == 0:
                self.stats.prefix_cache_queries += req.num_tokens
                self.stats.prefix_cache_hits += num_computed
                req.num_cached_tokens = num_computed
            insort(self.running, req, key=_sort_key)
            batch.append((req, num_new, added))
            budget -= num_new
        return budget

    def _build_plan(self, batch: list[tuple[Request, int, list[int]]]) -> StepPlan:
        new_reqs: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        scheduled: list[tuple[int, int]] = []
        for req, num_new, added in batch:
            if not req.in_worker:
                new_reqs.append(
                    NewRequestData(
                        req.req_id, list(req.token_ids), list(req.block_ids),
                        req.num_computed_tokens, req.params, req.num_prompt_tokens,
                        sorted(req.eos_token_ids),
                    )
                )
                req.in_worker = True
            elif added:
                cached.append(CachedRequestData(req.req_id, added))
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.stats.computed_prompt_tokens += min(num_new, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += num_new
            scheduled.append((req.req_id, num_new))
        self.step_id += 1
        drop, self._worker_drop = self._worker_drop, []
        return StepPlan(self.step_id, scheduled, new_reqs, cached, drop)

    # ---- reconciling -----------------------------------------------------

    def update_from_result(self, result: StepResult) -> None:
        logprobs = result.logprobs
        for j, (rid, tok) in enumerate(zip(result.req_ids, result.token_ids, strict=True)):
            req = self.requests.get(rid)
            if req is None or req.status != Status.RUNNING:
                continue  # aborted or preempted after the step was planned
            req.token_ids.append(tok)
            self.stats.generation_tokens += 1
            lp = logprobs[j] if logprobs is not None else None
            reason = self._stop_reason(req, tok)
            self.updates.append(
                RequestUpdate(
                    rid, [tok], reason, [lp] if lp is not None else None,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
            if reason is not None:
                self._finish(req)
        self.running = [r for r in self.running if r.status == Status.RUNNING]
        self.stats.num_steps += 1

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        # vLLM's order: length caps first, then stop tokens once min_tokens is met.
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        if req.num_output_tokens < req.params.min_tokens:
            return None
        if tok in req.eos_token_ids or tok in req.stop_ids:
            return "stop"
        return None

    # ---- state changes ---------------------------------------------------

    def _preempt(self, req: Request) -> None:
        """Recompute: free the blocks and re-queue at the front of its priority."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self._forget_in_worker(req)
        heapq.heappush(self.waiting, (req.sort_key, req.req_id))
        self.stats.num_preemptions += 1

    def _finish(self, req: Request) -> None:
        # The caller drops finished requests from `running` in one pass.
        req.status = Status.FINISHED
        self.kv.free(req)
        self._forget_in_worker(req)
        del self.requests[req.req_id]

    def _forget_in_worker(self, req: Request) -> None:
        if req.in_worker:
            req.in_worker = False
            self._worker_drop.append(req.req_id)

    # ---- observability ---------------------------------------------------

    def take_updates(self) -> list[RequestUpdate]:
        out, self.updates = self.updates, []
        return out

    def snapshot_stats(self) -> SchedulerStats:
        s = self.stats
        s.num_running = len(self.running)
        s.num_waiting = sum(1 for r in self.requests.values() if r.status == Status.WAITING)
        s.num_swapped = sum(1 for r in self.requests.values() if r.status == Status.SWAPPED)
        s.num_free_blocks = self.kv.num_free_blocks
        s.kv_cache_usage = self.kv.usage()
        return s

    def check_blocks(self) -> str | None:
        """Free + owned blocks add up, and each block's references equal its owners."""
        problem = self.kv.pool.check()
        if problem:
            return problem
        owners = [0] * self.kv.pool.num_blocks
        for req in self.requests.values():
            for b in req.block_ids:
                owners[b] += 1
        for b, (refs, own) in enumerate(zip(self.kv.pool.ref_cnt, owners, strict=True)):
            if refs != own:
                return f"block {b} has {refs} references but {own} owners"
        return None


def _sort_key(req: Request) -> tuple[int, int]:
    return req.sort_key

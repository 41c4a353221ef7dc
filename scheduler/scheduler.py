"""The iteration-level scheduler: one StepPlan per step, reconciled by its StepResult.

Each step: running requests first (a decode costs one token, a prompt still in
prefill takes a chunk of what is left of the token budget), preempting the
lowest-priority, latest request when blocks run out (recompute, or swap to
CPU blocks); then swapped requests come back; then waiting requests board in
(priority, arrival) order while blocks, the budget and the sequence cap allow.
State advances when a step is planned and is reconciled when its result arrives.

Parallel sampling (n > 1) is not a concept here: as in vLLM V1, the frontend sends
each sample as an engine request of its own, and the samples share their prompt's
full blocks through the prefix cache (with caching off, under a hash root of their
own: `KVCacheManager.hash_root`), at the cost of at most a block of extra prefill.

Async scheduling (`async_scheduling`): the process plans step N+1 while the worker
runs step N, counting on one token from every request that samples in N
(`Request.num_worker_tokens`); see `schedule` for who waits instead, and
`update_from_result` for the token of a request that ended in N. With speculation, a step
planned ahead drafts nothing, and one that would draft waits for the result before it.
"""

from __future__ import annotations

import heapq
from bisect import insort
from operator import attrgetter
from typing import Any

import msgspec

from noria.protocol.client import SchedulerStats
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest, EngineSample, RequestUpdate
from noria.protocol.errors import ErrorCode
from noria.protocol.pooling import engine_pooling
from noria.protocol.step import StepPlan
from noria.scheduler.admission import refusal
from noria.scheduler.block_check import check_blocks
from noria.scheduler.kv_transfer import Disaggregation
from noria.scheduler.plan_builder import PlanBuilder
from noria.scheduler.request import Request, SharedParams, Status
from noria.scheduler.results import StepResults
from noria.scheduler.speculation import Speculation
from noria.scheduler.structured_output import StructuredOutputManager, resume
from noria.scheduler.worker_groups import WorkerGroups

_NO_BLOCKS: list[int] = []
_NO_DRAFTS: dict[int, list[int] | int] = {}  # shared, never mutated: "no step drafts"


class Scheduler(WorkerGroups, Disaggregation, Speculation, StepResults):
    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int, num_cpu_blocks: int = 0) -> None:
        """`num_kv_blocks` 0: no worker group yet (requests queue until `install_kv`)."""
        self.grammars = StructuredOutputManager(config.tokenizer or config.model, config.model)  # free until used
        self.config = config
        self.block_size = config.block_size
        self.model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.chunked_prefill = config.enable_chunked_prefill
        self.swap = config.preemption_mode == "swap"
        # Under fcfs (vLLM's default) a request's priority orders nothing, whoever set it.
        self.by_priority = config.scheduling_policy == "priority"
        # A pooling engine's requests compute their prompt and end with its embedding.
        self.pooling = engine_pooling(config.model, config.runner, config.pooling)
        self.stats = SchedulerStats(block_size=config.block_size, kv_cache_dtype=config.kv_cache_dtype,
                                    enable_prefix_caching=config.enable_prefix_caching)
        self.requests: dict[int, Request] = {}
        self.waiting: list[tuple[tuple[int, int], int]] = []  # heap of (sort_key, req_id)
        self.running: list[Request] = []  # sorted by sort_key
        self.swapped: list[Request] = []  # sorted by sort_key
        self.updates: list[RequestUpdate] = []  # pending messages for the frontend
        self._worker_drop: list[int] = []  # requests the worker must forget
        self._swap_out: list[tuple[int, int]] = []
        self._arrivals = 0
        self.step_id = 0
        self._init_transfers()
        self._init_speculation()
        self.install_kv(num_kv_blocks, num_cpu_blocks)

    # ---- input -----------------------------------------------------------

    def add_request(self, msg: EngineRequest) -> None:
        """Queue each sample `msg` carries as a request of its own; they share its parameters."""
        if msg.priority and not self.by_priority:
            msg = msgspec.structs.replace(msg, priority=0)
        shared = SharedParams(msg)
        max_tokens = msg.params.max_tokens or self.max_model_len - len(msg.prompt_token_ids)
        hash_root = self.kv.hash_root(msg.sample_group, msg.cache_salt)
        if msg.kv_transfer_params is not None and msg.more_samples:
            for sample in msg.samples():
                self.reject(sample.req_id, ErrorCode.INVALID_REQUEST, "kv_transfer_params take one sample (n = 1)")
            return
        for sample in msg.samples():
            self._add_sample(msg, sample, shared, max_tokens, hash_root)

    def _add_sample(self, msg: EngineRequest, sample: EngineSample, shared: SharedParams, max_tokens: int,
                    hash_root: bytes | None) -> None:
        rid = sample.req_id
        if rid in self.requests:
            return self.reject(rid, ErrorCode.DUPLICATE_REQUEST, f"request {rid} is already in flight")
        refused = refusal(msg, sample, self.max_model_len, self.token_budget, self.chunked_prefill,
                          self.pooling is not None)
        if refused is not None:
            return self.reject(rid, *refused)
        req = Request(msg, self._arrivals, max_tokens, hash_root, sample, shared)
        if self.pooling is not None:
            req.pooling, req.pools_every_position = True, self.pooling.every_position
        req.set_decode_limit(self.max_model_len)
        self._transfer_of(msg, req)
        self._speculates(req, msg.cache_salt)
        self._arrivals += 1
        self.requests[rid] = req
        self.stats.prompt_tokens += req.num_prompt_tokens
        if msg.params.structured_output is not None:
            try:
                matcher = self.grammars.submit(rid, msg.params.structured_output, msg.eos_token_ids)
            except (TypeError, ValueError, RecursionError) as e:
                # A constraint the frontend should have refused (not JSON): this request fails,
                # never the loop that serves every other (and its resubmission after a restart).
                self._finish(req)
                return self.reject(rid, ErrorCode.INVALID_GRAMMAR, f"structured_output does not compile: {e}")
            if matcher is None:  # queues in `grammars_ready` once its grammar has compiled
                req.status = Status.WAITING_GRAMMAR
                return
            self._with_grammar(req, matcher)
            return
        heapq.heappush(self.waiting, (req.sort_key, rid))

    def grammars_ready(self) -> None:  # queue requests whose grammar compiled, fail those whose did not
        for rid, matcher, error in self.grammars.take_ready():
            req = self.requests.get(rid)
            if req is None or req.status != Status.WAITING_GRAMMAR:
                continue  # aborted while compiling
            if error is None:
                self._with_grammar(req, matcher)
            else:
                self._finish(req)
                self.reject(rid, ErrorCode.INVALID_GRAMMAR, f"structured_output does not compile: {error}")

    def _with_grammar(self, req: Request, matcher: Any) -> None:
        # A request resumed after a scheduler restart brings outputs its new matcher has not seen
        # (those after its reasoning, if the grammar waited for its end).
        outputs = req.token_ids[req.num_prompt_tokens:]
        if req.grammar_wait is not None and req.grammar_wait in outputs:
            outputs = outputs[outputs.index(req.grammar_wait) + 1:]
            req.grammar_wait = None
        elif req.grammar_wait is not None:
            outputs = []
        if not resume(matcher, outputs):
            self._finish(req)
            return self.reject(req.req_id, ErrorCode.INTERNAL, "a resumed request's outputs break its grammar")
        req.matcher, req.status = matcher, Status.WAITING
        req.set_decode_limit(self.max_model_len)
        heapq.heappush(self.waiting, (req.sort_key, req.req_id))

    def abort(self, req_ids: list[int]) -> None:
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req)
                self.updates.append(RequestUpdate(rid, [], finish_reason="abort"))
        self.running = [r for r in self.running if r.status == Status.RUNNING]
        self.swapped = [r for r in self.swapped if r.status == Status.SWAPPED]

    def reject(self, req_id: int, code: str, message: str) -> None:
        self.updates.append(
            RequestUpdate(req_id, [], finish_reason="error", error_code=code, error_message=message)
        )

    # ---- planning --------------------------------------------------------

    def has_work(self) -> bool:
        # Pulls in flight are heard of only in step results: steps go on while any is.
        return bool(self.running or self.waiting or self.swapped or self._worker_drop or self._kv_pulls
                    or self.pulled or self.pulling or self.orphans)

    def schedule(self, ahead: bool = False) -> StepPlan:
        """The next step's plan; `ahead`: planned while another step runs (async scheduling), so
        it drafts nothing and leaves out the requests whose draft that step verifies."""
        budget = self.token_budget
        plan = PlanBuilder(self.stats)
        schedule_one = plan.scheduled.append
        running = self.running
        preempted = False
        bs = self.block_size
        kv = self.kv
        # Speculative decoding; a plan made ahead drafts nothing.
        drafts = self._step_drafts(budget) if self.spec is not None and not ahead else _NO_DRAFTS
        # Only a plan made while a drafted step runs meets a request whose draft is on its way.
        verifying = ahead and bool(self._verifying)
        # A for loop may pop victims off the end: the iterator re-reads the length.
        for req in running:
            if budget <= 0:
                break
            c = req.num_computed_tokens
            k = req.num_worker_tokens
            num_new = k - c
            if num_new == 1:
                if verifying and req.spec_pending:
                    continue  # how many of its draft tokens it keeps is on its way
                if drafts and req.req_id in drafts and self._plan_draft(req, drafts[req.req_id], budget, plan):
                    budget -= req.num_computed_tokens - c
                    continue
                if c % bs and k < req.decode_limit:
                    # Hot path: a plain decode that starts no block. A block it fills is
                    # keyed for prefix hits when the next one starts (`append_slot`): a
                    # digest per block, kept off this path.
                    schedule_one(req.decode_entry)
                    req.num_computed_tokens = c + 1
                    req.num_worker_tokens = k + 1
                    budget -= 1
                    continue
                if k > len(req.token_ids) and k >= req.decode_limit:
                    # Async scheduling: its last token may be on its way, or its grammar
                    # needs the token on its way: it waits for the result.
                    continue
                added: list[int] | None = _NO_BLOCKS if c % bs else kv.append_slot(req)
            else:
                num_new = min(num_new, budget)
                added = kv.allocate_slots(req, num_new)
            if added is None:
                preempted = True
                added = self._preempt_for(req, num_new)
                if added is None:
                    break
            plan.add(req, num_new, added)
            budget -= num_new
        budget = self._join_pulled(budget, plan)

        swap_in: list[tuple[int, int]] = []
        # Never swap in during a step that swapped out: a CPU or device block
        # freed by one must not be reused by the other before the copies run.
        if not preempted:
            budget = self._swap_in(budget, plan, swap_in)
            if not self.swapped:
                budget = self._admit(budget, plan)
        if ahead and self.spec is not None:
            self._count_ahead(plan.scheduled)
        return self._build_plan(plan, swap_in)

    def _preempt_for(self, req: Request, num_new: int) -> list[int] | None:
        """Preempt until `req` gets its blocks; None if `req` itself had to go. The victim is
        the lowest-priority, latest request still unplanned (running is sorted, and every
        planned request is before `req`)."""
        while True:
            victim = self.running.pop()
            self._preempt(victim)
            if victim is req:
                return None
            added = self.kv.allocate_slots(req, num_new)
            if added is not None:
                return added

    def _swap_in(self, budget: int, plan: PlanBuilder, pairs: list[tuple[int, int]]) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.swapped[0]
            if req.num_in_flight:
                break  # preempted while its token was on its way: back once it has arrived
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            got = self.kv.swap_in(req, num_new)
            if got is None:
                break
            self.swapped.pop(0)
            pairs.extend(got)
            req.status = Status.RUNNING
            insort(self.running, req, key=_sort_key)
            self.stats.num_swap_ins += 1
            added = self.kv.allocate_slots(req, num_new)
            assert added is not None, "swap_in reserved room for this step's tokens"
            plan.add(req, num_new, added)
            budget -= num_new
        return budget

    def _admit(self, budget: int, plan: PlanBuilder) -> int:
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.requests.get(waiting[0][1])
            if req is None or req.status != Status.WAITING:
                heapq.heappop(waiting)  # aborted while waiting
                continue
            if req.num_in_flight:
                break  # preempted while its token was on its way: back once it has arrived
            if not plan.has_room_for_params(req, PLAN_PARAMS_BYTES):
                break  # its parameters go with the next plan: no plan grows too large to send in time
            hits = self.kv.get_computed_blocks(req)
            if req.kv_remote is not None:  # its prompt's KV waits at a producer
                boarded = self._admit_remote(req, hits)
                if boarded is False:
                    break
                if boarded:
                    continue
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
            if req.num_output_tokens == 0 and req.num_preemptions == 0:
                self.stats.prefix_cache_queries += req.num_tokens
                self.stats.prefix_cache_hits += num_computed
                req.num_cached_tokens = num_computed
            insort(self.running, req, key=_sort_key)
            plan.add(req, num_new, added)
            budget -= num_new
        return budget

    def _build_plan(self, plan: PlanBuilder, swap_in: list[tuple[int, int]]) -> StepPlan:
        self.step_id += 1
        drop, self._worker_drop = self._worker_drop, []
        swap_out, self._swap_out = self._swap_out, []
        masked = plan.masked
        pulls, release = self._take_transfer_plan()
        step = StepPlan(self.step_id, plan.scheduled, plan.new_requests, plan.cached, drop, swap_out=swap_out,
                        swap_in=swap_in, grammar=self.grammars.fill_bitmask(masked) if masked else None,
                        params=plan.params, kv_pulls=pulls, kv_release=release, drafts=plan.drafts)
        if self.spec is not None:
            self._time_step(step)
        return step

    # ---- state changes ---------------------------------------------------

    def _preempt(self, req: Request) -> None:
        """Swap the request's KV out if asked and there is room, else recompute:
        free its blocks and re-queue it at the front of its priority."""
        self.stats.num_preemptions += 1
        req.num_preemptions += 1
        self._forget_in_worker(req)
        self._forget_export(req)
        pairs = self.kv.swap_out(req) if self.swap and req.block_ids and not req.needs_all_positions else None
        if pairs is not None:
            self._swap_out.extend(pairs)
            req.status = Status.SWAPPED
            insort(self.swapped, req, key=_sort_key)
            self.stats.num_swap_outs += 1
            return
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        heapq.heappush(self.waiting, (req.sort_key, req.req_id))

    def _finish(self, req: Request) -> None:
        # The caller drops finished requests from `running` / `swapped` in one pass.
        self._drop_transfer_state(req)
        req.status = Status.FINISHED
        if req.ngram is not None:
            self._spec_finish(req)
        self.kv.free(req)
        self.kv.free_swapped(req)
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
        s.num_swapped = len(self.swapped)
        s.num_waiting = len(self.requests) - s.num_running - s.num_swapped
        s.num_free_blocks = self.kv.num_free_blocks
        s.kv_cache_usage = self.kv.usage()
        s.kv_transfers_held = len(self.held)
        return s

    def check_blocks(self) -> str | None:
        return check_blocks(self.kv, self.requests.values(), self.held_block_lists())


_sort_key = attrgetter("sort_key")  # (priority, arrival)
# The sampling parameters one plan may carry for the requests it starts, encoded: many
# requests with large parameters (each at most MAX_ENGINE_PARAMS_BYTES) start over several
# steps rather than in one plan that takes the workers seconds to read.
PLAN_PARAMS_BYTES = 16 << 20

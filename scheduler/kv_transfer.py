"""Prefill/decode disaggregation in the scheduler: both roles' bookkeeping (protocol/kv_transfer.py).

Producer. A request with `do_remote_decode` carries a random transfer id to the worker, which
holds the request's prompt blocks under it each time the request samples (so the hold names
the blocks as they are, even after a preemption moved them). When the request ends normally,
the scheduler keeps its blocks (`held`) instead of freeing them and answers with the params a
consumer needs. A `KVRelease` from the consumer, or `abort_request_timeout`, frees them; the
next plan tells the workers (`StepPlan.kv_release`) before any step can reuse a freed block, so
a read answered from a hold always reads the blocks the prompt left.

Consumer. A request with `do_remote_prefill` boards like any other, its own prefix-cache hits
first, but its other prompt blocks are allocated without entering the prefix cache and pulled
(`StepPlan.kv_pulls`) instead of computed, by a thread of each worker rank while the steps go on
(worker/kv_pull_queue.py); meanwhile it is in `pulling`, out of the running list, and its blocks
are its own even if it ends (`orphans`). Its pull's outcome (`StepResult.kv_pulled`, in a later
step's result) puts it in `pulled`: with its KV up to the
last prompt token (the only one computed here: its logits are needed), or, if the pull failed,
with its own hits only, to be computed here. The next plan takes it into the running list.
Either way the producer hears `KVRelease` at once. Blocks enter the prefix cache only once
pulled whole, so no other request ever reads a block the pull did not fill.
"""

from __future__ import annotations

import heapq
import secrets
import time
import uuid
from bisect import insort
from dataclasses import dataclass
from operator import attrgetter

from noria.protocol.client import SchedulerStats
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest, RequestUpdate
from noria.protocol.errors import ErrorCode
from noria.protocol.kv_transfer import KVTransferConfig, KVTransferParams, pullable
from noria.protocol.step import KVPull, KVPulled
from noria.scheduler.kv_cache_manager import KVCacheManager
from noria.scheduler.plan_builder import PlanBuilder
from noria.scheduler.request import Request, Status

_sort_key = attrgetter("sort_key")


@dataclass
class Held:
    block_ids: list[int]
    deadline: float


class Disaggregation:
    """The transfer half of `Scheduler` (scheduler/scheduler.py), which owns these attributes."""

    config: EngineConfig
    kv: KVCacheManager
    stats: SchedulerStats
    block_size: int
    max_num_seqs: int
    running: list[Request]
    waiting: list[tuple[tuple[int, int], int]]
    updates: list[RequestUpdate]

    def _finish(self, req: Request) -> None:
        raise NotImplementedError

    def reject(self, req_id: int, code: str, message: str) -> None:
        raise NotImplementedError

    def _init_transfers(self) -> None:
        tc = self.config.kv_transfer_config
        self.transfer: KVTransferConfig | None = tc
        self.engine_id = (tc.engine_id if tc is not None and tc.engine_id else uuid.uuid4().hex)
        self.held: dict[int, Held] = {}  # producer: transfer id -> the blocks kept for a consumer
        self.kv_endpoints: list[str] = []  # producer: where each worker rank serves them
        self.side_channel: tuple[str, int] | None = None  # producer: (host, port) of KVRelease
        self._kv_release: list[int] = []  # transfer ids the workers must let go of
        self._kv_pulls: list[KVPull] = []  # for the next plan
        self.pulling: dict[int, Request] = {}  # consumer: requests whose pull is planned
        # consumer: the blocks of requests that ended while their pull ran, kept until its outcome
        # arrives (the worker's pull thread may still write them)
        self.orphans: dict[int, list[int]] = {}
        self.pulled: list[Request] = []  # consumer: pulls done, waiting to run
        self.releases: list[tuple[str, int, int]] = []  # consumer: (host, port, transfer id) to tell
        self.clock = time.monotonic

    # ---- requests in -----------------------------------------------------

    def _transfer_of(self, msg: EngineRequest, req: Request) -> None:
        """Give `req` its role in a transfer, as `msg.kv_transfer_params` ask and this engine's
        role allows; params it cannot serve are ignored (vLLM does the same), except that a
        consumer still releases what a producer holds for it."""
        params, tc = msg.kv_transfer_params, self.transfer
        if params is None or tc is None:
            return
        producers = tc.kv_connector_extra_config.producers
        if params.do_remote_decode and tc.produces:
            req.kv_export = secrets.randbits(62) + 1
        elif params.do_remote_prefill and tc.consumes and pullable(params, producers) is None:
            req.kv_remote = params
        elif params.do_remote_prefill and (producers is None or params.remote_host in producers):
            self._release_remote(params)

    def _release_remote(self, params: KVTransferParams) -> None:
        if params.remote_host and params.remote_port and params.remote_transfer_id is not None:
            self.releases.append((params.remote_host, params.remote_port, params.remote_transfer_id))

    # ---- producer --------------------------------------------------------

    def _export(self, req: Request) -> KVTransferParams | None:
        """Keep the prompt blocks of a producer's request that ended normally (call before
        `_finish`, which then frees the others); the params that name them, or None when this
        engine cannot serve them (no worker rank serves blocks)."""
        if not self.kv_endpoints or self.side_channel is None or not req.block_ids:
            return None
        tc = self.transfer
        assert tc is not None
        tid = req.kv_export
        req.kv_export = 0  # its hold is the transfer's now
        num_prompt_blocks = -(-req.num_prompt_tokens // self.block_size)
        remote_blocks = req.block_ids[:num_prompt_blocks]
        self.held[tid] = Held(remote_blocks, self.clock() + tc.kv_connector_extra_config.abort_request_timeout)
        # The blocks past the prompt's (its outputs') go back at once, with the request.
        req.block_ids = req.block_ids[num_prompt_blocks:]
        req.num_cached_blocks = max(0, req.num_cached_blocks - num_prompt_blocks)
        host, port = self.side_channel
        return KVTransferParams(do_remote_prefill=True, remote_engine_id=self.engine_id,
                                remote_block_ids=remote_blocks, remote_host=host, remote_port=port,
                                tp_size=len(self.kv_endpoints), remote_transfer_id=tid,
                                remote_endpoints=list(self.kv_endpoints), remote_block_size=self.block_size)

    def release_transfers(self, transfer_ids: list[int]) -> None:
        """The consumer is done with these (a `KVRelease`): free their blocks."""
        for tid in transfer_ids:
            if self._drop_held(tid):
                self.stats.kv_transfers_released += 1

    def expire_transfers(self) -> int:
        """Free the blocks of transfers no consumer released in time; how many."""
        now = self.clock()
        late = [tid for tid, h in self.held.items() if h.deadline <= now]
        for tid in late:
            self._drop_held(tid)
        self.stats.kv_transfers_expired += len(late)
        return len(late)

    def _drop_held(self, tid: int) -> bool:
        held = self.held.pop(tid, None)
        if held is None:
            return False
        self.kv.pool.release(held.block_ids[::-1])
        self._kv_release.append(tid)
        return True

    def _forget_export(self, req: Request) -> None:
        """The worker's hold for `req` (if it made one) names blocks about to be freed."""
        if req.kv_export:
            self._kv_release.append(req.kv_export)

    # ---- consumer --------------------------------------------------------

    def _admit_remote(self, req: Request, hits: list[int]) -> bool | None:
        """Board `req` to pull what its own cache lacks of its prompt. True: boarded (it is in
        `pulling`); False: no room now; None: nothing to pull or the params do not fit this
        engine (the producer is released; the caller boards it as any request)."""
        params = req.kv_remote
        assert params is not None and params.remote_block_ids is not None and params.remote_endpoints is not None
        bs = self.block_size
        first, last = len(hits), -(-(req.num_prompt_tokens - 1) // bs)  # KV of every prompt token but the last
        fits = (params.remote_block_size == bs and len(params.remote_block_ids) >= last
                and len(params.remote_endpoints) == self.config.tensor_parallel_size
                and req.num_tokens == req.num_prompt_tokens)
        if first >= last or not fits:
            self._done_with_remote(req)
            return None
        added = self.kv.allocate_slots(req, req.num_tokens - first * bs, hits, cache=False)
        if added is None:
            return False
        heapq.heappop(self.waiting)
        req.status = Status.PULLING
        req.num_computed_tokens = first * bs
        if req.num_preemptions == 0:
            self.stats.prefix_cache_queries += req.num_tokens
            self.stats.prefix_cache_hits += first * bs
            req.num_cached_tokens = first * bs
        self.pulling[req.req_id] = req
        assert params.remote_transfer_id is not None
        self._kv_pulls.append(KVPull(req.req_id, params.remote_transfer_id, params.remote_endpoints,
                                     params.remote_block_ids[first:last], req.block_ids[first:last]))
        return True

    def _done_with_remote(self, req: Request) -> None:
        if req.kv_remote is not None:
            self._release_remote(req.kv_remote)
            req.kv_remote = None

    def _pulls_done(self, outcomes: list[KVPulled]) -> None:
        """A step's pulls: each request waits in `pulled` with the KV it has, or fails."""
        tc = self.transfer
        for p in outcomes:
            req = self.pulling.pop(p.req_id, None)
            if req is None:  # it ended while its pull ran: its blocks are free from now on
                orphaned = self.orphans.pop(p.req_id, None)
                if orphaned is not None:
                    self.kv.pool.release(orphaned[::-1])
                continue
            self.stats.kv_pull_seconds += p.seconds
            self.stats.kv_pull_bytes += p.nbytes
            self._done_with_remote(req)
            if p.ok:
                self.stats.kv_pulls_ok += 1
                computed = req.num_prompt_tokens - 1
                self.stats.kv_pull_tokens += computed - req.num_computed_tokens
                req.num_computed_tokens = computed
                if req.hash_root is not None:
                    self.kv.cache_full_blocks(req, computed // self.block_size)
            else:
                self.stats.kv_pulls_failed += 1
                if tc is not None and tc.kv_load_failure_policy == "fail":
                    self._finish(req)
                    self.reject(req.req_id, ErrorCode.KV_TRANSFER_FAILED,
                                f"the prompt's KV could not be pulled from the producer: {p.error}")
                    continue
            self.pulled.append(req)

    def _join_pulled(self, budget: int, plan: PlanBuilder) -> int:
        """Requests whose pull is done run from this step on, before any new request boards."""
        while self.pulled and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.pulled[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            added = self.kv.allocate_slots(req, num_new)
            if added is None:
                break
            self.pulled.pop(0)
            req.status = Status.RUNNING
            insort(self.running, req, key=_sort_key)
            plan.add(req, num_new, added)
            budget -= num_new
        return budget

    def _drop_transfer_state(self, req: Request) -> None:
        """`req` ends: it leaves the pull lists (a pull still unplanned is dropped; the blocks of
        one already planned wait in `orphans` for its outcome, since the worker may be writing
        them) and releases its producer."""
        if self.pulling.pop(req.req_id, None) is not None:
            unplanned = [p for p in self._kv_pulls if p.req_id != req.req_id]
            if len(unplanned) == len(self._kv_pulls):
                self.orphans[req.req_id], req.block_ids = req.block_ids, []
                req.num_cached_blocks = 0
            self._kv_pulls = unplanned
        if req.status == Status.PULLING and req in self.pulled:
            self.pulled.remove(req)
        self._done_with_remote(req)
        self._forget_export(req)

    def _transfers_after_worker_loss(self) -> list[Request]:
        """The worker group is gone, and the holds with it; the requests mid-pull, to requeue."""
        self.held.clear()
        self.orphans.clear()
        self._kv_release, self._kv_pulls = [], []
        back = list(self.pulling.values()) + self.pulled
        self.pulling, self.pulled = {}, []
        for req in back:
            self._done_with_remote(req)
        return back

    def _take_transfer_plan(self) -> tuple[list[KVPull], list[int]]:
        pulls, self._kv_pulls = self._kv_pulls, []
        release, self._kv_release = self._kv_release, []
        return pulls, release

    def take_releases(self) -> list[tuple[str, int, int]]:
        out, self.releases = self.releases, []
        return out

    def held_block_lists(self) -> list[list[int]]:
        """Blocks no request owns that are not free: held for consumers, or mid-pull."""
        return [h.block_ids for h in self.held.values()] + list(self.orphans.values())

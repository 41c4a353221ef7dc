"""Collects one step's plan as the scheduler decides it, request by request.

Each request is written into the plan the moment it is scheduled (it is never
un-scheduled: preemption only takes requests not yet planned), so the plan's lists
come out in batch order without a second pass over the batch. A plain decode adds
only its `(req_id, 1)` pair (the scheduler's hot path appends to `scheduled` itself).
New requests that share their parameters (the samples of one client request) share
one entry of the plan's `params`.
"""

from __future__ import annotations

from typing import Any

from noria.protocol.client import SchedulerStats
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.speculative import Draft
from noria.protocol.step import CachedRequestData, NewRequestData
from noria.scheduler.request import Request


class PlanBuilder:
    __slots__ = ("scheduled", "new_requests", "cached", "masked", "stats", "params", "params_index", "params_bytes",
                 "drafts")

    def __init__(self, stats: SchedulerStats) -> None:
        self.scheduled: list[tuple[int, int]] = []
        self.new_requests: list[NewRequestData] = []
        self.cached: list[CachedRequestData] = []
        self.masked: list[tuple[int, Any]] = []  # (req_id, matcher) of the constrained samples
        self.stats = stats
        self.params: list[EngineSamplingParams] = []
        self.params_index: dict[int, int] = {}  # id() of a SharedParams -> its entry in `params`
        self.params_bytes = 0  # encoded size of `params`
        self.drafts: list[Draft] = []

    def has_room_for_params(self, req: Request, budget: int) -> bool:
        """Whether `req` may start in this plan without its parameters taking the plan past
        `budget` bytes (the first new request always may: each request's are capped smaller)."""
        return (not self.params or req.in_worker or id(req.shared) in self.params_index
                or self.params_bytes + req.shared.nbytes <= budget)

    def add(self, req: Request, num_new: int, added: list[int]) -> None:
        """Schedule `num_new` tokens of `req`, whose block table grew by `added`."""
        c = req.num_computed_tokens
        if not req.in_worker:
            shared = req.shared
            index = self.params_index.get(id(shared))
            if index is None:  # `shared` lives as long as `req`: its id is not reused during the plan
                index = self.params_index[id(shared)] = len(self.params)
                self.params.append(shared.worker_params)
                self.params_bytes += shared.nbytes
            self.new_requests.append(
                NewRequestData(
                    req.req_id, list(req.token_ids), list(req.block_ids), c, index,
                    req.num_prompt_tokens, shared.worker_eos, req.sample_index, req.kv_export,
                )
            )
            req.in_worker = True
        elif added:
            self.cached.append(CachedRequestData(req.req_id, added))
        if c < req.num_prompt_tokens:
            self.stats.computed_prompt_tokens += min(num_new, req.num_prompt_tokens - c)
        req.num_computed_tokens = c = c + num_new
        self.scheduled.append((req.req_id, num_new))
        if c == req.num_worker_tokens:  # it samples in this step
            req.num_worker_tokens = c + 1
            if req.matcher is not None and req.grammar_wait is None:  # (not while it reasons)
                self.masked.append((req.req_id, req.matcher))  # its mask goes with this step

    def add_draft(self, req: Request, draft: list[int] | int, added: list[int], masks: list[Any] = ()) -> None:
        """Schedule a decode of `req` (already in the worker) with `draft` after its last token
        (an int: the worker's draft model proposes that many); it counts every drafted token as
        on its way until the result says which it keeps."""
        if added:
            self.cached.append(CachedRequestData(req.req_id, added))
        n = 1 + (draft if isinstance(draft, int) else len(draft))
        req.num_computed_tokens += n
        req.num_worker_tokens = req.num_computed_tokens + 1
        self.scheduled.append((req.req_id, n))
        self.drafts.append(Draft(req.req_id, [], draft) if isinstance(draft, int) else Draft(req.req_id, draft))
        if masks:  # a constrained request: a mask for each of its k + 1 positions, in order
            self.masked += [(req.req_id, m) for m in masks]

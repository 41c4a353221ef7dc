"""Reconciling a step's result: each sampled token goes to its request, with its stop check.

A token counts for a request still alive that has a token on its way. With async
scheduling that may be a request preempted since the step was planned (its token is as
good as any); a request that ended meanwhile (a stop token seen a step earlier, an abort)
gets none, so a step planned ahead never delivers a token too many.
"""

from __future__ import annotations

from collections.abc import Callable

from noria.protocol.client import Logprob, SchedulerStats
from noria.protocol.engine import RequestUpdate
from noria.protocol.errors import ErrorCode
from noria.protocol.kv_transfer import KVTransferParams
from noria.protocol.step import KVPulled, StepResult
from noria.scheduler.request import Request, Status


class StepResults:
    """The result half of `Scheduler` (scheduler/scheduler.py), which owns these attributes."""

    requests: dict[int, Request]
    running: list[Request]
    swapped: list[Request]
    updates: list[RequestUpdate]  # pending messages for the frontend
    stats: SchedulerStats
    max_model_len: int
    _verifying: list[tuple[Request, int]]  # scheduler/speculation.py's
    _verified: Callable[[StepResult], None]

    def _finish(self, req: Request) -> None:
        raise NotImplementedError

    def _export(self, req: Request) -> KVTransferParams | None:
        raise NotImplementedError

    def _pulls_done(self, outcomes: list[KVPulled]) -> None:
        raise NotImplementedError

    def update_from_result(self, result: StepResult) -> None:
        req_ids, tokens = result.req_ids, result.token_ids
        if len(tokens) != len(req_ids):
            raise ValueError(f"step {result.step_id}: {len(req_ids)} requests but {len(tokens)} tokens")
        logprobs, prompt_logprobs = result.logprobs, result.prompt_logprobs
        discarded_before = self.stats.tokens_discarded
        if logprobs is None and prompt_logprobs is None:
            finished = self._apply_plain(req_ids, tokens)
        else:
            finished = False
            for j, (rid, tok) in enumerate(zip(req_ids, tokens, strict=True)):
                req = self.requests.get(rid)
                if req is None or req.num_in_flight == 0:
                    self.stats.tokens_discarded += 1
                    continue
                req.token_ids.append(tok)
                finished |= self._emit(req, tok, None if logprobs is None else logprobs[j],
                                       None if prompt_logprobs is None else prompt_logprobs[j])
        self.stats.generation_tokens += len(tokens) - (self.stats.tokens_discarded - discarded_before)
        if self._verifying:
            self._verified(result)
        if result.pooled_req_ids or result.pooled:
            finished |= self._apply_pooled(result)
        if result.kv_pulled:
            self._pulls_done(result.kv_pulled)
        if finished:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
            self.swapped = [r for r in self.swapped if r.status is Status.SWAPPED]
        self.stats.num_steps += 1

    def _apply_pooled(self, result: StepResult) -> bool:
        """A pooling engine's embeddings: each ends its request (which frees its blocks), unless
        the request ended after the step was planned (an abort)."""
        if len(result.pooled) != len(result.pooled_req_ids):
            raise ValueError(f"step {result.step_id}: {len(result.pooled_req_ids)} pooled requests but "
                             f"{len(result.pooled)} vectors")
        finished = False
        for rid, vector in zip(result.pooled_req_ids, result.pooled, strict=True):
            req = self.requests.get(rid)
            if req is None or not req.pooling or req.num_in_flight == 0:
                continue
            self.updates.append(RequestUpdate(rid, [], "stop", num_cached_tokens=req.num_cached_tokens,
                                              embedding=vector))
            self._finish(req)
            finished = True
        return finished

    def _apply_plain(self, req_ids: list[int], tokens: list[int]) -> bool:
        """Tokens without logprobs, the per-token hot path: a token that cannot end its
        request (the checks of `Request.stop_reason`) gets its update inline."""
        requests = self.requests
        add_update = self.updates.append
        finished = False
        discarded = 0
        for rid, tok in zip(req_ids, tokens, strict=True):
            req = requests.get(rid)
            if req is None:
                discarded += 1  # it ended after the step was planned
                continue
            token_ids = req.token_ids
            n = len(token_ids) + 1
            if n > req.num_worker_tokens:
                discarded += 1  # no token of its on the way: a new request under an ended one's id
                continue
            token_ids.append(tok)
            if n < req.decode_limit and tok not in req.stop_any:  # decode_limit: max_tokens, max_model_len, no matcher
                add_update(RequestUpdate(rid, [tok], None, None, None, None, req.num_cached_tokens))
            else:
                finished |= self._emit(req, tok, None, None)
        self.stats.tokens_discarded += discarded
        return finished

    def _emit(self, req: Request, tok: int, lp: Logprob | None, prompt_lps: list[Logprob | None] | None) -> bool:
        """The update for a token already appended to `req`; True if it ended the request."""
        reason = req.stop_reason(tok, self.max_model_len)
        err = (ErrorCode.INTERNAL, f"token {tok} breaks the grammar") if reason == "error" else (None, None)
        # A producer's request keeps its blocks for the consumer its answer names.
        kv_params = self._export(req) if req.kv_export and reason in ("stop", "length") else None
        self.updates.append(RequestUpdate(req.req_id, [tok], reason, None if lp is None else [lp], *err,
                                          req.num_cached_tokens, prompt_lps, kv_transfer_params=kv_params))
        if reason is None:
            return False
        self._finish(req)
        return True

"""Speculative decoding in the scheduler (protocol/speculative.py): which decodes carry a draft,
and what a verified step does to their requests.

A drafted decode schedules 1 + k tokens (its last token and the draft) and takes blocks for all
of them, under the same token budget as every other row; its request then counts
`num_computed_tokens` past its known tokens until the result says how many it keeps (one more
than the accepted draft tokens), which rolls it back to them. Only known tokens are ever keyed
for prefix hits (`KVCacheManager` digests `token_ids`, which never hold a draft), so no cached
block holds an unaccepted token; blocks taken for rejected positions stay the request's, the
next tokens' room. A draft never preempts: without blocks for it the request decodes as usual.

Who is drafted: a request with no export (a producer computes prompts), and with a grammar
only by the scheduler's proposers (n-gram, suffix): its draft is cut where the grammar would
reject a token or be complete, and the step carries a mask for each position it samples
(`grammar_draft`), so what the target keeps is what the grammar allows; none while more than
`disable_by_batch_size` requests run. Each
request adapts its draft length to what it accepts: a full acceptance keeps or lengthens it, a
partial one shortens it to the accepted length plus one, and a draft rejected outright sets it
to one and skips the request's next 1, 2, 4, ... 16 lookups (reset by the next acceptance), so a
request whose text does not repeat costs little more than no speculation. And a step drafts at
all only where drafting has delivered more tokens per second than not drafting, for steps of its
batch size on this engine (scheduler/spec_governor.py): where verifying rows is not nearly free
(a large batch on a CPU), speculation turns itself off.
"""

from __future__ import annotations

from typing import Any

from noria.protocol.client import SchedulerStats
from noria.protocol.config import EngineConfig
from noria.protocol.speculative import SpeculativeConfig
from noria.protocol.step import StepPlan, StepResult
from noria.scheduler.kv_cache_manager import KVCacheManager
from noria.scheduler.ngram import NgramIndex
from noria.scheduler.plan_builder import PlanBuilder
from noria.scheduler.request import Request, Status
from noria.scheduler.spec_governor import DraftSwitch
from noria.scheduler.structured_output import grammar_draft
from noria.scheduler.suffix_decoding import SuffixCache, SuffixProposer

MAX_SKIP = 16  # lookups a request sits out after a rejected draft, at most


class Speculation:
    """The speculation half of `Scheduler` (scheduler/scheduler.py), which owns these attributes."""

    config: EngineConfig
    stats: SchedulerStats
    running: list[Request]
    max_model_len: int
    kv: KVCacheManager
    step_id: int  # the last plan's

    def _init_speculation(self) -> None:
        sc = self.config.speculative_config
        self.spec: SpeculativeConfig | None = sc
        self._verifying: list[tuple[Request, int]] = []  # (request, draft length) of the plan in flight
        self.switch = DraftSwitch()
        self.suffixes = SuffixCache(sc) if sc is not None and sc.method == "suffix" else None
        self._timed: dict[int, tuple[int, bool]] = {}  # step id -> (decodes, drafted) of a decode-only step
        self._untimed = False  # the plan being built drafts a request the draft model must catch up

    def _speculates(self, req: Request, tenant: str | None) -> None:
        """Give a new request its proposer, if it may be drafted (`tenant`: its cache salt)."""
        spec = self.spec
        constrained = req.params.structured_output is not None
        # A draft model's or head's tokens are known only on the worker, past the masks the plan carries.
        if spec is not None and not req.kv_export and not req.pooling and not (constrained and spec.on_worker):
            if spec.method == "ngram":
                req.ngram = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
            elif spec.method == "suffix":
                assert self.suffixes is not None
                req.ngram = SuffixProposer(self.suffixes, req.req_id, tenant, req.num_prompt_tokens)
            req.spec_k = spec.num_speculative_tokens

    def _spec_finish(self, req: Request) -> None:
        """A request ends: suffix decoding keeps its response for its tenant's next requests."""
        if isinstance(req.ngram, SuffixProposer):
            req.ngram.finish(req.token_ids)

    def observe_step(self, step_id: int, seconds: float, tokens: int) -> None:
        """Step `step_id` delivered `tokens` tokens in `seconds` (from its plan, or from the last
        result when it was planned while that step ran)."""
        timed = self._timed.pop(step_id, None)
        if timed is not None:
            self.switch.observe(timed[0], timed[1], tokens, seconds)

    def drafts_next(self) -> bool:
        """Whether the next plan would draft: with async scheduling, the process then waits for
        the step in flight instead of planning ahead (a draft follows the tokens it brings)."""
        spec = self.spec
        if spec is None or (spec.disable_by_batch_size is not None and len(self.running) > spec.disable_by_batch_size):
            return False
        decodes = sum(1 for req in self.running if req.num_worker_tokens - req.num_computed_tokens == 1
                      and not req.spec_pending)
        return decodes > 0 and self.switch.would_draft(decodes)

    def _count_ahead(self, scheduled: list[tuple[int, int]]) -> None:
        """A plan made while a step runs drafts nothing; its decodes still count as a step of their
        class for the switch (a plan that schedules none, never sent, counts nothing)."""
        decodes = sum(1 for _, n in scheduled if n == 1)
        if decodes:
            self.switch.skip(decodes)

    def _time_step(self, plan: StepPlan) -> None:
        """Which decode-only steps teach the switch (a prompt's chunk would swamp the figure)."""
        drafted = sum(d.length for d in plan.drafts)
        decodes = len(plan.scheduled)
        only = not plan.new_requests and sum(n for _, n in plan.scheduled) == decodes + drafted
        if only and decodes and not self._untimed:
            self._timed[plan.step_id] = (decodes, bool(drafted))
        if self._untimed and self.switch.trying:
            self.switch.retry()  # the try only caught its request up: the next step tries again
        self._untimed = False

    def _step_drafts(self, budget: int) -> dict[int, list[int] | int]:
        """This step's drafts by request id: each running decode's proposal (a draft model's: how
        many tokens it proposes), if the step drafts ({} when it does not)."""
        spec = self.spec
        assert spec is not None
        if spec.disable_by_batch_size is not None and len(self.running) > spec.disable_by_batch_size:
            return {}
        decodes = [req for req in self.running if req.num_worker_tokens - req.num_computed_tokens == 1]
        if not decodes or not self.switch.choose(len(decodes)):
            return {}
        if self.switch.trying and spec.method == "draft_model":  # one, the one the draft followed latest
            decodes = [max(decodes, key=lambda r: r.spec_last)]
        drafts = {}
        for req in decodes:
            draft = self._draft(req, budget)
            if draft:
                drafts[req.req_id] = draft
        return drafts

    def _draft(self, req: Request, budget: int) -> list[int] | int:
        """The proposal for a decode of `req` within `budget` tokens ([] or 0: none)."""
        if not req.spec_k or not req.in_worker:
            return []
        if req.spec_skip:
            req.spec_skip -= 1
            return []
        tokens = req.token_ids
        # Never past the last token it may produce: the step may keep every draft token and one more.
        k = min(req.spec_k, budget - 1, min(req.length_cap, self.max_model_len) - len(tokens) - 1)
        if req.ngram is not None:
            return req.ngram.propose(tokens, k) if k > 0 else []
        assert self.spec is not None
        # The draft model writes its KV up to the last draft token's position, within its own context.
        return max(0, min(k, (self.spec.max_model_len or self.max_model_len) - len(tokens) + 1))

    def _plan_draft(self, req: Request, draft: list[int] | int, budget: int, plan: PlanBuilder) -> bool:
        """Plan a decode of `req` with `draft` (cut to the budget left), if it gets blocks for it."""
        draft = draft[:budget - 1] if isinstance(draft, list) else min(draft, budget - 1)
        masks: list[Any] = []
        if isinstance(draft, list) and req.params.structured_output is not None:
            draft, masks = grammar_draft(req, draft)
        k = len(draft) if isinstance(draft, list) else draft
        if k <= 0:
            return False
        added = self.kv.allocate_slots(req, 1 + k)
        if added is None:
            return False
        plan.add_draft(req, draft, added, masks)
        self._verifying.append((req, k))
        req.spec_pending = True  # until the result: a plan made meanwhile leaves it out
        lagging = req.spec_last < self.step_id - MAX_SKIP
        if isinstance(draft, int) and lagging and self.spec is not None and self.spec.method == "draft_model":
            # Its draft model catches up over more tokens than a request sitting out lookups
            # leaves (a prompt, a class that did not draft): not a step to time.
            self._untimed = True
        req.spec_last = self.step_id + 1
        return True

    def _verified(self, result: StepResult) -> None:
        """The plan's drafted requests after their result: rolled back to the tokens they keep,
        their draft lengths adapted, the acceptance counted."""
        verifying, self._verifying = self._verifying, []
        kept: dict[int, int] = {}
        for rid in result.req_ids:
            kept[rid] = kept.get(rid, 0) + 1
        stats, max_k = self.stats, self.spec.num_speculative_tokens if self.spec else 1
        per_pos = stats.spec_accepted_per_pos
        if len(per_pos) < max_k:
            per_pos.extend([0] * (max_k - len(per_pos)))
        for req, k in verifying:
            accepted = max(0, min(k, kept.get(req.req_id, 0) - 1))
            stats.spec_drafts += 1
            stats.spec_draft_tokens += k
            stats.spec_accepted_tokens += accepted
            for i in range(accepted):
                per_pos[i] += 1
            req.spec_pending = False
            if req.status is Status.FINISHED:
                continue  # it ended with this step (its blocks are free already)
            n = len(req.token_ids)
            req.num_worker_tokens = n
            # Preempted by a plan made while the step ran (async scheduling): recomputed from
            # scratch, or swapped out with the blocks of every position computed.
            if req.status is not Status.WAITING:
                req.num_computed_tokens = n - 1
            if accepted:
                req.spec_misses = 0
                if not isinstance(req.ngram, SuffixProposer):  # (its lengths follow its own confidence)
                    req.spec_k = min(max_k, k + 1) if accepted == k else accepted + 1
            else:
                if not isinstance(req.ngram, SuffixProposer):
                    req.spec_k = 1
                req.spec_skip = min(MAX_SKIP, 1 << req.spec_misses)
                req.spec_misses += 1

    def _forget_drafts(self) -> None:
        """The steps in flight are lost with their worker group: nothing of them is verified."""
        for req, _ in self._verifying:
            req.spec_pending = False
        self._verifying = []
        self._timed.clear()

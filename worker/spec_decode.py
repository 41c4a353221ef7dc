"""Verifying a step's drafts (speculative decoding, protocol/speculative.py) on the worker.

A drafted request's row is its last token and its draft: k + 1 positions, each sampled as it
would be sampled alone at that output index, with the draft tokens before it counted as output
(penalties, min_tokens, bad words, the seed's per-position noise: `DraftRowState`). It keeps the
sampled tokens up to and including the first that differs from the draft; the KV written for the
draft tokens after that is left behind: `num_computed_tokens` goes back to the tokens kept, and
the next step writes over those slots.

Every rank runs this: rank 0 samples and the ids are broadcast, so every rank keeps the same
tokens. Only rank 0 records them in its sampling states.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from noria.protocol.client import Logprob
from noria.protocol.step import StepPlan, StepResult
from noria.worker.grammar_mask import apply_grammar_bitmask
from noria.worker.logits_processors import LogitsProcessors
from noria.worker.prompt_logprobs import take_complete
from noria.worker.sampler import SamplingState
from noria.worker.step_inputs import RequestState, request_state

# Samples one logits row per state (None on the ranks that do not sample); records nothing.
SampleRows = Callable[[torch.Tensor | None, list[SamplingState | None]],
                      tuple[list[int], list[Logprob | None] | None]]


def take_drafts(plan: StepPlan, requests: dict[int, RequestState], vocab_size: int) -> dict[int, int]:
    """Append each draft to its request's tokens (its row's input ids); {req_id: draft length}.
    Raises ValueError on a draft the worker cannot verify (a plan that disagrees is a bug)."""
    drafted: dict[int, int] = {}
    for draft in plan.drafts:
        state = request_state(requests, draft.req_id, plan.step_id)
        what = f"step {plan.step_id} request {draft.req_id}"
        if not draft.token_ids or draft.req_id in drafted:
            raise ValueError(f"{what}: an empty or second draft")
        if state.num_computed_tokens != len(state.token_ids) - 1:
            raise ValueError(f"{what}: a draft after {state.num_computed_tokens} of {len(state.token_ids)} "
                             "tokens computed (only a decode is drafted)")
        if not all(0 <= t < vocab_size for t in draft.token_ids):
            raise ValueError(f"{what}: draft token ids outside the vocabulary [0, {vocab_size})")
        drafted[draft.req_id] = len(draft.token_ids)
        state.token_ids.extend(draft.token_ids)
    return drafted


class DraftRowState:
    """The sampling state of a drafted request at draft position j: its own, with the first j
    draft tokens counted as outputs. Sampling reads it; the request's own state records what
    is kept."""

    __slots__ = ("params", "seed", "greedy", "generator", "min_tokens_stop_ids", "prompt_mask", "output_counts",
                 "processors", "num_outputs")

    def __init__(self, base: SamplingState, before: list[int]) -> None:
        self.params, self.seed, self.greedy, self.generator = base.params, base.seed, base.greedy, base.generator
        self.min_tokens_stop_ids, self.prompt_mask = base.min_tokens_stop_ids, base.prompt_mask
        self.num_outputs = base.num_outputs + len(before)
        self.output_counts = base.output_counts
        if base.output_counts is not None:
            ids = torch.tensor(before, dtype=torch.long, device=base.output_counts.device)
            self.output_counts = base.output_counts.index_add(0, ids, torch.ones(len(before),
                                                                                   device=ids.device))
        self.processors: LogitsProcessors | None = base.processors
        if base.processors is not None and base.processors.keep:  # bad words read the latest outputs
            self.processors = copy.copy(base.processors)
            self.processors.recent = (base.processors.recent + before)[-base.processors.keep:]

    @property
    def min_tokens_active(self) -> bool:
        return self.num_outputs < self.params.min_tokens and bool(self.min_tokens_stop_ids)

    def record(self, token_id: int) -> None:
        raise AssertionError("a draft position's state records nothing")


def verify(plan: StepPlan, logits: torch.Tensor | None, requests: list[RequestState], drafted: dict[int, int],
           sample_rows: SampleRows) -> StepResult:
    """Sample every row of the step's sampling requests (a drafted one has k + 1, in order), keep
    each drafted request's accepted run, roll its state back to it; the step's result."""
    rows: list[SamplingState | None] = []
    row_req_ids: list[int] = []
    drafts: list[list[int]] = []
    for state in requests:
        k = drafted.get(state.req_id, 0)
        draft = state.token_ids[len(state.token_ids) - k:] if k else []
        drafts.append(draft)
        base = state.sampling
        rows.append(base)
        rows.extend(DraftRowState(base, draft[:j]) if base is not None else None  # type: ignore[misc]
                    for j in range(1, k + 1))
        row_req_ids += [state.req_id] * (k + 1)
    if plan.grammar is not None and logits is not None:  # a constrained draft has a mask per position
        apply_grammar_bitmask(logits, plan.grammar, row_req_ids)
    sampled, logprobs = sample_rows(logits, rows)
    out_ids: list[int] = []
    out_tokens: list[int] = []
    out_logprobs: list[Logprob | None] | None = [] if logprobs is not None else None
    prompt_lps = take_complete(requests)
    out_prompt: list[list[Logprob | None] | None] | None = [] if prompt_lps is not None else None
    i = 0
    for n, (state, draft) in enumerate(zip(requests, drafts, strict=True)):
        k = len(draft)
        if k:
            del state.token_ids[len(state.token_ids) - k:]
        a = 0
        while a < k and sampled[i + a] == draft[a]:
            a += 1
        kept = sampled[i:i + a + 1]
        state.token_ids.extend(kept)
        state.num_computed_tokens = len(state.token_ids) - 1
        if state.sampling is not None:
            for token in kept:
                state.sampling.record(token)
        out_ids += [state.req_id] * len(kept)
        out_tokens += kept
        if out_logprobs is not None and logprobs is not None:
            out_logprobs += logprobs[i:i + a + 1]
        if out_prompt is not None and prompt_lps is not None:
            out_prompt += [prompt_lps[n]] + [None] * a
        i += k + 1
    return StepResult(step_id=plan.step_id, req_ids=out_ids, token_ids=out_tokens, logprobs=out_logprobs,
                      prompt_logprobs=out_prompt)

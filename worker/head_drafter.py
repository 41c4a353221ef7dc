"""What the worker's drafting heads share (an EAGLE-3 head, worker/eagle3.py; a checkpoint's MTP
layer, worker/mtp.py): a layer over the target's own hidden states, run at the start of the step
that verifies its proposals (worker/spec_decode.py verifies).

The head's position q reads the token at q + 1 beside what the target computed at q (its
`features`: the residual stream at layers the head names, kept by the target's forward pass
while it runs, `CausalLM.capture`). So once the target's step has run
and its tokens are sampled and verified, every position it computed whose next token is now
known (a prompt chunk's every one; a decode's, or a verified row's up to and including the last
kept token) goes through the head in one batched pass (`stepped`), which writes the head's KV
there and leaves each request's output at its last such position, n - 2 for a request of n
tokens: its next pass's hidden state. A proposal of k tokens then takes the argmax of that
output's logits (the first token), and runs the head k - 1 more times, each over the previous
proposal at the next position beside the previous output. The KV those passes write lies past
the request's computed tokens; the next `stepped` writes over the positions the target computes.

Unlike the draft model, the head runs over every computed token, drafted or not: it cannot
catch up later, because the target's hidden states are gone once the step is over. That is
one layer over the step's tokens, a fraction of the target's cost, and it is what makes every
block the target computed hold the head's KV too, so that prefix-cache hits need no
bookkeeping. A request's output is kept while the worker lets go of it (a swap out and back in
rebuilds its worker state without computing anything); one without an output at n - 2 is
proposed its last token repeated: a guess, which verification keeps only where the target
agrees.

It runs on the first tensor-parallel rank (the stream is whole on every rank after each
layer's all_reduce), and propose_drafts broadcasts its proposals.
"""

from __future__ import annotations

from typing import Protocol

import torch

from noria.worker.attention import AttentionBackend, AttentionMetadata
from noria.worker.drafter import PagedDrafter, Span
from noria.worker.kv_cache import KVLayout
from noria.worker.models.causal_lm import CausalLM
from noria.worker.step_inputs import Batch, RequestState


class Head(Protocol):
    def __call__(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                 backend: AttentionBackend, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The head's output over `input_ids` beside `hidden` (a row each): the next pass's hidden state."""
        ...

    def propose(self, hidden: torch.Tensor) -> list[int]:
        """The greedy next token (a target id) after each row of the head's output."""
        ...


class HeadDrafter(PagedDrafter):
    head: Head

    def __init__(self, layout: KVLayout, attention: AttentionBackend, device: torch.device) -> None:
        super().__init__(layout, attention, device)
        # Per request: (the last position the head has run, its output there).
        self.last: dict[int, tuple[int, torch.Tensor]] = {}

    target: CausalLM

    def features(self) -> list[torch.Tensor]:
        """What the head reads of the target's step just run (the target's `captured`, taken), a
        row per token of the step; empty where nothing was kept."""
        kept, self.target.captured = self.target.captured, []
        return kept

    def fuse(self, features: list[torch.Tensor]) -> torch.Tensor:
        """The features of the rows the head runs over, as the hidden state its layer reads."""
        raise NotImplementedError

    def stepped(self, batch: Batch, requests: dict[int, RequestState]) -> None:
        """The head over every position of the step whose next token is known."""
        features = self.features()
        if self.cache is None or not features:
            return
        spans, rows, start_row = [], [], 0
        meta = batch.meta
        for state, q, seq in zip(batch.states, meta.query_lens_host, meta.seq_lens_host, strict=True):
            start, end = seq - q, min(seq, len(state.token_ids) - 1)
            if end > start:
                spans.append(Span(state, start, state.token_ids[start + 1:end + 1]))
                rows.extend(range(start_row, start_row + end - start))
            start_row += q
        if spans:
            if len(rows) < features[0].shape[0]:  # (a plain decode step keeps every row: no gather)
                index = torch.tensor(rows, dtype=torch.long, device=self.device)
                features = [a[index] for a in features]
            input_ids, span_meta, last = self.inputs(spans)
            out = self.head(input_ids, self.fuse(features), span_meta, self.attention, self.layers[0])[last]
            for i, span in enumerate(spans):  # (re-inserted: the dict is in the order of last use)
                self.last.pop(span.state.req_id, None)
                self.last[span.state.req_id] = (span.start + len(span.input_ids) - 1, out[i])
        # A request the worker let go of may come back (swapped out and in): its output is kept
        # until the entries of requests gone outnumber the live ones, the longest unused first.
        gone = [r for r in self.last if r not in requests]
        for req_id in gone[:max(0, len(gone) - len(requests) - 16)]:
            del self.last[req_id]

    def propose(self, wanted: list[tuple[RequestState, int]]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in wanted]
        live = []
        for i, (state, k) in enumerate(wanted):
            entry = self.last.get(state.req_id)
            if entry is not None and entry[0] == len(state.token_ids) - 2:
                live.append(i)
            else:
                proposals[i] = [state.token_ids[-1]] * k
        if not live:
            return proposals
        hidden = torch.stack([self.last[wanted[i][0].req_id][1] for i in live])
        step = 0
        while True:
            for i, token in zip(live, self.head.propose(hidden), strict=True):
                proposals[i].append(token)
            step += 1
            keep = [j for j, i in enumerate(live) if wanted[i][1] > step]
            if not keep:
                return proposals
            live = [live[j] for j in keep]
            spans = [Span(wanted[i][0], len(wanted[i][0].token_ids) - 2 + step, [proposals[i][-1]]) for i in live]
            input_ids, meta, _ = self.inputs(spans)
            hidden = self.head(input_ids, hidden[keep], meta, self.attention, self.layers[0])

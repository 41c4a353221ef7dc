"""The draft model of `--speculative-config '{"method": "draft_model", "model": ...}'`: a second,
smaller checkpoint with the target's tokenizer, which proposes each drafted request's next
tokens at the start of the step that verifies them (worker/spec_decode.py verifies).

Its KV cache is its own tensor (its layers, heads and head size), addressed by the same block
ids as the target's: the scheduler's block accounting is unchanged, a block's bytes are the
two caches' together (`KVLayout.draft_bytes_per_block`, so a fixed KV memory holds fewer
blocks), and swaps move both. A request's `draft_len` says how many of its tokens the draft
has computed. The draft computes only when it drafts: a proposal first runs it over the tokens
since `draft_len` (the prompt at a request's first draft, one or two tokens after a drafted
step, more after steps that did not draft it). So a request that is never drafted (its batch
size does not pay, scheduler/spec_governor.py) costs nothing more than speculation off, and
the switch does not time a step that catches a request up (scheduler/speculation.py).

A prefix-cache hit gives a new request blocks whose target KV is computed, but whose draft KV
is only where the draft computed it too: `full` holds the blocks whose every slot's draft KV
is that of the tokens there (marked when a request's draft has caught up over them, and when
the request is done with), and a block given out to be written, or swapped in, leaves it. A
new request's `draft_len` is its leading blocks in `full`; the draft computes the rest of a
cached prefix itself, writing into its own blocks only.

Proposing k tokens for a request whose last known token is at position n - 1 runs the draft k
times: first over every token it has not computed up to and including that last one, then over
each proposal in turn, each time taking the argmax (greedy proposals: verification samples the
target and keeps a proposal only where the target chose it, the rejection rule for a draft
whose distribution is one token). Every request of the step drafts in the same k batched
passes (a request with a shorter draft drops out of the later ones). The KV the draft wrote
for proposals the target rejected lies past the request's computed tokens: `draft_len` is
always read as at most `num_computed_tokens`, and the next pass writes over it.

One draft per engine, on the first tensor-parallel rank, unsharded (TP 1): it broadcasts the
proposals to the other ranks, which verify their shards of the target over them.
"""

from __future__ import annotations

import logging
from itertools import accumulate

import torch

from noria.protocol.config import EngineConfig
from noria.protocol.step import StepPlan
from noria.worker.attention_select import attention_layers, select_attention_backend
from noria.worker.drafter import PagedDrafter, Span
from noria.worker.kv_cache import KVLayout
from noria.worker.kv_fp8 import apply_scales
from noria.worker.loader import load_model, load_spec
from noria.worker.models.causal_lm import CausalLM
from noria.worker.models.ops import choose_ops
from noria.worker.models.parallel import TensorParallel
from noria.worker.step_inputs import RequestState, request_state

log = logging.getLogger("noria.worker")


class DraftModel(PagedDrafter):
    """The draft checkpoint, its attention backend and (once allocated) its KV cache."""

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 weight_dtype: torch.dtype | None, kv_dtype: torch.dtype) -> None:
        spec_config = config.speculative_config
        assert spec_config is not None and spec_config.model is not None
        self.path = spec_config.model
        self.spec = spec = load_spec(self.path, spec_config.max_model_len)
        self.model = load_model(self.path, spec, device, dtype, TensorParallel(), weight_dtype, config.load_format,
                                config.seed)
        apply_scales((layer.self_attn for layer in self.model.layers), kv_dtype)
        choice = select_attention_backend(device, attention_layers(self.model), dtype, config.block_size,
                                          choice=config.attention_backend, kv_dtype=kv_dtype)
        self.model.use_ops(choose_ops(spec.activation, device, dtype, choice.backend, config.block_size))
        super().__init__(KVLayout(spec.num_layers, config.block_size, self.model.shapes.num_kv_heads, spec.head_dim,
                                  kv_dtype), choice.backend, device)
        self.full: set[int] = set()
        log.info("draft model %s: %d layers, %d KV bytes per block beside the target's", self.path,
                 spec.num_layers, self.layout.bytes_per_block)

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        super().swap(swap_out, swap_in)
        self.full.difference_update(dev for dev, _ in swap_in)

    def added(self, state: RequestState, block_ids: list[int]) -> None:
        """A request new to the worker, with `block_ids`: its draft KV is that of its leading
        cached blocks in `full`; its other blocks are to be written."""
        bs, hits = self.block_size, state.num_computed_tokens // self.block_size
        valid = next((i for i, b in enumerate(block_ids[:hits]) if b not in self.full), hits)
        state.draft_len = valid * bs
        self.full.difference_update(block_ids[hits:])

    def fresh(self, block_ids: list[int]) -> None:
        """Blocks appended to a request: to be written."""
        self.full.difference_update(block_ids)

    def mark(self, state: RequestState) -> None:
        """The request's blocks whose every slot holds the draft KV of its tokens."""
        done = min(state.draft_len, state.num_computed_tokens) // self.block_size
        self.full.update(self.tables.ids[state.row][:done])

    def propose(self, wanted: list[tuple[RequestState, int]]) -> list[list[int]]:
        """k greedy proposals for each (request, k), in order."""
        proposals: list[list[int]] = [[] for _ in wanted]
        live = list(range(len(wanted)))
        spans = []
        for state, _ in wanted:
            start = min(state.draft_len, state.num_computed_tokens)
            spans.append(Span(state, start, state.token_ids[start:]))
        for step in range(max(k for _, k in wanted)):
            for i, span, token in zip(live, spans, self._run(spans), strict=True):
                proposals[i].append(token)
                span.state.draft_len = span.start + len(span.input_ids)
            if not step:  # the blocks it has now computed whole, for prefix-cache hits
                for state, _ in wanted:
                    self.mark(state)
            live = [i for i in live if wanted[i][1] > step + 1]
            spans = [Span(wanted[i][0], wanted[i][0].draft_len, [proposals[i][-1]]) for i in live]
        return proposals

    def _run(self, spans: list[Span]) -> list[int]:
        """One forward pass of the draft over `spans`; the argmax at each span's last token."""
        input_ids, meta, last = self.inputs(spans)
        hidden = self.model(input_ids, meta.positions, meta, self.attention, self.layers)
        scores = self.model.compute_logits(hidden[last])
        assert scores is not None
        return scores.argmax(dim=-1).tolist()


def propose_drafts(plan: StepPlan, draft: PagedDrafter | None, requests: dict[int, RequestState],
                   tp: TensorParallel, device: torch.device) -> None:
    """Fill the token ids of the plan's drafts that the worker proposes (`Draft.propose`): the
    draft model's (or head's) on the first rank, broadcast to the others."""
    wanted = [d for d in plan.drafts if d.propose]
    if not wanted:
        return
    if draft is not None:
        states = [(request_state(requests, d.req_id, plan.step_id), d.propose) for d in wanted]
        for d, tokens in zip(wanted, draft.propose(states), strict=True):
            d.token_ids = tokens
    if tp.size > 1:
        flat = [t for d in wanted for t in d.token_ids] if draft is not None else [0] * sum(d.propose for d in wanted)
        ids = tp.broadcast_from_first(torch.tensor(flat, dtype=torch.long, device=device)).tolist()
        for d, end in zip(wanted, accumulate(d.propose for d in wanted), strict=True):
            d.token_ids = ids[end - d.propose:end]


def load_drafter(config: EngineConfig, device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype | None,
                 kv_dtype: torch.dtype, tp: TensorParallel, target: CausalLM) -> PagedDrafter | None:
    """The engine's proposer on the worker, on its first rank (None: the scheduler proposes, or
    another rank)."""
    sc = config.speculative_config
    if sc is None or not sc.on_worker or not tp.first:
        return None
    if sc.method == "eagle3":
        from noria.worker.eagle3 import Eagle3Drafter

        return Eagle3Drafter(config, device, dtype, weight_dtype, kv_dtype, target)
    if sc.method == "mtp":
        from noria.worker.mtp import MtpDrafter

        return MtpDrafter(config, device, dtype, weight_dtype, kv_dtype, target)
    return DraftModel(config, device, dtype, weight_dtype, kv_dtype)

"""One step's batch: the plan's scheduled rows flattened into the model's inputs, their
attention metadata, the rows that sample and the positions that give prompt logprobs.

There is one builder. The host side (lengths, query starts, sampling rows, prompt-logprob
spans) is the same for every step; only where the tensors come from differs. A decode-only
step (one token per sequence) that fits the persistent DecodeBuffers is staged through them
in one host-to-device copy, padded to its CUDA graph's bucket when a graph replays it; every
other step builds fresh tensors. A replayed step skips `attention.prepare`: the graph's
backend data was fixed at capture (worker/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from noria.protocol.pooling import PoolingSpec
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.step import NewRequestData, StepPlan
from noria.worker.attention import AttentionBackend, AttentionMetadata
from noria.worker.block_table import BlockTables
from noria.worker.cuda_graphs import DecodeBuffers, DecodeGraphs, DecodeInputs, pad_decode
from noria.worker.prompt_logprobs import PromptLogprobs, Span
from noria.worker.sampler import SamplingState


@dataclass(slots=True)
class RequestState:
    req_id: int
    token_ids: list[int]
    num_computed_tokens: int
    row: int  # row in BlockTables
    sampling: SamplingState | None  # rank 0 only: the other ranks do not sample
    prompt_logprobs: PromptLogprobs | None = None  # until they are sent with the first token
    # A pooling engine's carry-over between a prompt's chunks (worker/pooling.py).
    pooled: torch.Tensor | None = None
    num_pooled: int = 0
    # A producer's request: its transfer id, held with the prompt's blocks each time it samples.
    kv_export: int = 0
    num_prompt_tokens: int = 0
    # The tokens a draft model has computed (worker/draft_model.py): at most num_computed_tokens count.
    draft_len: int = 0


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor
    meta: AttentionMetadata
    states: list[RequestState]
    sample_requests: list[RequestState]
    sample_token_index: torch.Tensor  # flat index of each sampling request's last token
    prompt_spans: list[Span]  # positions whose logits give prompt logprobs
    graph_size: int | None = None  # a decode step replaying the CUDA graph of this batch size


@dataclass(slots=True)
class ScheduledRows:
    """The plan's requests in batch order, with each one's new input ids, query length (tokens
    computed this step), context length (tokens computed before), sequence length after the
    step, and the flat index where its rows start (one entry more: the total)."""

    states: list[RequestState]
    input_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]
    seq_lens: list[int]
    query_start: list[int]

    @property
    def decode_only(self) -> bool:
        """One token per sequence."""
        return len(self.input_ids) == len(self.states)


def request_state(requests: dict[int, RequestState], req_id: int, step_id: int) -> RequestState:
    state = requests.get(req_id)
    if state is None:
        raise KeyError(f"step {step_id} refers to request {req_id}, which the worker does not know")
    return state


def check_new_request(new: NewRequestData, plan_params: list[EngineSamplingParams], vocab_size: int,
                      pooling: PoolingSpec | None) -> EngineSamplingParams:
    """A new request's sampling parameters, once its data fits this worker (ValueError: what
    does not, a plan's bug)."""
    what = f"request {new.req_id}"
    if not new.token_ids:
        raise ValueError(f"{what}: no token ids")
    if not 0 <= new.params < len(plan_params):
        raise ValueError(f"{what}: params entry {new.params} outside the plan's {len(plan_params)}")
    if not 0 <= new.num_computed_tokens <= len(new.token_ids):
        raise ValueError(f"{what}: num_computed_tokens {new.num_computed_tokens} outside "
                         f"[0, {len(new.token_ids)}]")
    bad = [t for t in new.token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what}: token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}")
    if pooling is not None and pooling.every_position and new.num_computed_tokens:
        raise ValueError(f"{what}: {pooling.mode} pooling needs every position computed here, but "
                         f"{new.num_computed_tokens} come computed")
    return plan_params[new.params]


def scheduled_rows(plan: StepPlan, requests: dict[int, RequestState], tables: BlockTables,
                   block_size: int) -> ScheduledRows:
    """The plan's rows, checked against what this worker knows (a plan that disagrees is a
    bug, not a step)."""
    bs = block_size
    states: list[RequestState] = []
    input_ids: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    for req_id, n in plan.scheduled:
        state = request_state(requests, req_id, plan.step_id)
        c = state.num_computed_tokens
        if n < 1 or c + n > len(state.token_ids):
            raise ValueError(f"step {plan.step_id}: request {req_id} schedules {n} tokens with "
                             f"{c} of {len(state.token_ids)} computed")
        if c + n > tables.num_blocks[state.row] * bs:
            raise ValueError(f"step {plan.step_id}: request {req_id} needs {-(-(c + n) // bs)} blocks "
                             f"but has {tables.num_blocks[state.row]}")
        states.append(state)
        input_ids.extend(state.token_ids[c : c + n])
        query_lens.append(n)
        context_lens.append(c)
    if len({id(s) for s in states}) != len(states):
        raise ValueError(f"step {plan.step_id}: a request is scheduled twice")
    seq_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    return ScheduledRows(states, input_ids, query_lens, context_lens, seq_lens, [0, *accumulate(query_lens)])


def sample_rows(rows: ScheduledRows, drafted: dict[int, int] | None = None) -> tuple[list[RequestState], list[int]]:
    """The requests whose computed tokens catch up with their known tokens this step, and the
    flat index of each one's last token (whose logits it samples from); a drafted request's
    (`drafted`: its draft's length k) last k + 1 tokens, each sampled (worker/spec_decode.py)."""
    requests: list[RequestState] = []
    index: list[int] = []
    for i, state in enumerate(rows.states):
        if rows.seq_lens[i] == len(state.token_ids):
            requests.append(state)
            end = rows.query_start[i + 1]
            k = drafted.get(state.req_id, 0) if drafted else 0
            index.extend(range(end - 1 - k, end))
    return requests, index


def prompt_spans(rows: ScheduledRows) -> list[Span]:
    """The positions this step computes whose logits give prompt logprobs, per tracking request
    (advances each tracker past them)."""
    spans: list[Span] = []
    for i, state in enumerate(rows.states):
        if state.prompt_logprobs is not None:
            c = rows.context_lens[i]
            first, count = state.prompt_logprobs.span(c, rows.query_lens[i])
            if count:
                spans.append((state.prompt_logprobs, rows.query_start[i] + first - c, first, count))
    return spans


def decode_slots(states: list[RequestState], context_lens: list[int], tables: BlockTables,
                 block_size: int) -> list[int]:
    """The KV slot of each row's one new token, from the rows' block id lists: list lookups
    instead of the half a dozen small tensor operators of the general path."""
    ids, bs = tables.ids, block_size
    return [ids[s.row][c // bs] * bs + c % bs for s, c in zip(states, context_lens, strict=True)]


def build_batch(plan: StepPlan, requests: dict[int, RequestState], tables: BlockTables,
                buffers: DecodeBuffers, graphs: DecodeGraphs | None, attention: AttentionBackend, *,
                block_size: int, null_block: int, device: torch.device, drafted: dict[int, int] | None = None
                ) -> Batch:
    """The batch of `plan` over the runner's request states and block tables; `graphs` (None:
    every step eager) decides whether a decode step is padded to a graph's bucket; `drafted`:
    the draft lengths of the requests whose drafts the step verifies."""
    rows = scheduled_rows(plan, requests, tables, block_size)
    num_seqs = len(rows.states)
    sampled, sample_index = sample_rows(rows, drafted)
    spans = prompt_spans(rows)
    staged = (rows.decode_only and num_seqs <= buffers.max_rows
              and max(rows.context_lens) < buffers.max_cols * block_size)
    size = None
    if staged:
        input_ids, meta, size = _staged_decode(rows, tables, buffers, graphs, block_size, null_block)
    else:
        input_ids, meta = fresh_tensors(rows, tables, block_size, device)
    if size is None:
        attention.prepare(meta)
    if staged and len(sampled) == num_seqs:
        sample_token_index = meta.query_start_loc[:num_seqs]  # 0..B-1, already on the device
    else:
        sample_token_index = torch.tensor(sample_index, dtype=torch.long, device=device)
    return Batch(input_ids, meta, rows.states, sampled, sample_token_index, spans, size)


def _staged_decode(rows: ScheduledRows, tables: BlockTables, buffers: DecodeBuffers,
                   graphs: DecodeGraphs | None, block_size: int, null_block: int
                   ) -> tuple[torch.Tensor, AttentionMetadata, int | None]:
    """A decode-only step's input ids and metadata in the persistent buffers: staged once, one
    copy to the device; padded to its graph's size when one replays it (that size, else None)."""
    bs, states = block_size, rows.states
    num_seqs = len(states)
    size = graphs.bucket(num_seqs) if graphs is not None else None
    # A graph reads every row's table at full width; an eager step only as far as its longest row.
    cols = buffers.max_cols if size is not None else -(-max(rows.seq_lens) // bs)
    inputs = DecodeInputs(rows.input_ids, rows.context_lens, decode_slots(states, rows.context_lens, tables, bs),
                          rows.seq_lens, tables.gather([s.row for s in states], cols))
    if size is not None:
        inputs = pad_decode(inputs, size, null_block, bs)
    views = buffers.stage(inputs)
    meta = AttentionMetadata(
        positions=views.positions[:num_seqs],
        slot_mapping=views.slot_mapping[:num_seqs],
        query_start_loc=views.query_start_loc[: num_seqs + 1],
        seq_lens=views.seq_lens[:num_seqs],
        block_tables=views.block_tables[:num_seqs],
        block_size=bs,
        query_lens_host=rows.query_lens,
        seq_lens_host=rows.seq_lens,
        query_start_host=rows.query_start,
    )
    return views.input_ids[:num_seqs], meta, size


def fresh_tensors(rows: ScheduledRows, tables: BlockTables, block_size: int, device: torch.device
                   ) -> tuple[torch.Tensor, AttentionMetadata]:
    """Any step's input ids and metadata in tensors of its own."""
    bs, states = block_size, rows.states
    block_tables = tables.gather([s.row for s in states], -(-max(rows.seq_lens) // bs))
    if rows.decode_only:
        positions = torch.tensor(rows.context_lens, dtype=torch.long)
        slots = torch.tensor(decode_slots(states, rows.context_lens, tables, bs), dtype=torch.long)
    else:
        q_lens = torch.tensor(rows.query_lens, dtype=torch.long)
        offsets = torch.tensor(rows.context_lens, dtype=torch.long) - torch.tensor(rows.query_start[:-1])
        positions = torch.arange(len(rows.input_ids)) + torch.repeat_interleave(offsets, q_lens)
        seq_index = torch.repeat_interleave(torch.arange(len(states)), q_lens)
        slots = block_tables[seq_index, positions // bs] * bs + positions % bs
    meta = AttentionMetadata(
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        query_start_loc=torch.tensor(rows.query_start, dtype=torch.long, device=device),
        seq_lens=torch.tensor(rows.seq_lens, dtype=torch.long, device=device),
        block_tables=block_tables.to(device),
        block_size=bs,
        query_lens_host=rows.query_lens,
        seq_lens_host=rows.seq_lens,
        query_start_host=rows.query_start,
    )
    return torch.tensor(rows.input_ids, dtype=torch.long, device=device), meta

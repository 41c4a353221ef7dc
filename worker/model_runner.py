"""The step executor: applies a StepPlan to per-request state, runs one forward
pass over the ragged batch and samples.

Per step: forget finished requests, register new ones, extend block tables,
move KV blocks (swap out, swap in), build the flattened batch
and its attention metadata, run the model, sample for requests whose computed
tokens caught up with their known tokens.

Tensor parallelism: every rank runs this same code on the same plans with its
shard of the model (worker/models/parallel.py). Only rank 0 holds sampling
state and samples; it broadcasts the sampled ids so that the other ranks can
extend their token lists, and only its StepResult is sent (worker/process.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import cast

import torch

from noria.protocol.client import Logprob
from noria.protocol.config import EngineConfig
from noria.protocol.model_identity import context_error, model_facts
from noria.protocol.model_shapes import ShardedShapes, tensor_parallel_error
from noria.protocol.pooling import engine_pooling
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.step import CachedRequestData, NewRequestData, StepPlan, StepResult
from noria.worker import native_stack
from noria.worker.attention import AttentionMetadata
from noria.worker.attention_select import attention_layers, select_attention_backend
from noria.worker.block_table import BlockTables
from noria.worker.cuda_graphs import (
    DecodeBuffers,
    DecodeGraphs,
    DecodeInputs,
    DecodeViews,
    capture_sizes,
    graph_metadata,
    pad_decode,
)
from noria.worker.device import resolve_device, resolve_dtype
from noria.worker.grammar_mask import apply_grammar_bitmask
from noria.worker.kv_cache import (
    GraphShapes,
    KVCache,
    KVLayout,
    capacity_line,
    graph_memory_reserve,
    needs_profile,
    num_device_blocks,
    num_swap_blocks,
)
from noria.worker.loader import load_model, load_spec
from noria.worker.memory_profile import profile_memory
from noria.worker.models.moe import expert_sizes
from noria.worker.models.parallel import destroy_tensor_parallel, init_tensor_parallel
from noria.worker.pooling import Pooler
from noria.worker.prompt_logprobs import PromptLogprobs, Span, collect, take_complete
from noria.worker.sampler import Sampler, SamplingState

log = logging.getLogger("noria.worker")


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


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step that ran the model, as step observers see it: per scheduled request (in batch
    order) the tokens it computed this step and its sequence length after them; how many rows
    sampled; the seconds of the forward pass and logits (not sampling, not batch preparation)."""

    query_lens: list[int]
    seq_lens: list[int]
    num_sampled: int
    model_seconds: float


# Called on every rank after each step that ran the model; it must not change the step.
StepObserver = Callable[[StepStats], None]


@dataclass(slots=True)
class _Batch:
    input_ids: torch.Tensor
    meta: AttentionMetadata
    states: list[RequestState]
    sample_requests: list[RequestState]
    sample_token_index: torch.Tensor  # flat index of each sampling request's last token
    prompt_spans: list[Span]  # positions whose logits give prompt logprobs
    graph_size: int | None = None  # a decode step replaying the CUDA graph of this batch size


class ModelRunner:
    """Owns the model, the KV cache and every request's worker-side state.

    Attributes the process loop reports in WorkerReady: `num_kv_blocks` (device
    blocks the scheduler may hand out), `num_cpu_blocks` (swap area),
    `vocab_size`, `max_model_len`, `block_size`.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, dist_init_method: str | None = None) -> None:
        """`dist_init_method` (e.g. tcp://127.0.0.1:PORT) is the torch.distributed
        rendezvous of the tensor-parallel ranks; unused with one rank."""
        self.config = config
        self.rank = rank
        tp_size = config.tensor_parallel_size
        # Ranks on one host share its cores: each takes its share so that N ranks
        # do not oversubscribe them (num_threads, when given, is per rank).
        torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // tp_size))
        torch.manual_seed(config.seed)
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and tp_size > 1:
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        self.spec = s = load_spec(config.model, config.max_model_len)
        # The check `noria serve` makes too; here before joining the other ranks.
        problem = tensor_parallel_error(ShardedShapes(s.num_heads, s.num_kv_heads, s.intermediate_size,
                                                      expert_sizes(s)), tp_size)
        if problem:
            raise ValueError(f"cannot shard {config.model}: {problem}")
        self.tp = init_tensor_parallel(rank, tp_size, dist_init_method, self.device, config.startup_timeout)
        self.dtype = resolve_dtype(config.dtype, self.device, self.spec.checkpoint_dtype)
        self.model = load_model(config.model, self.spec, self.device, self.dtype, self.tp)

        self.vocab_size = self.spec.vocab_size
        self.block_size = config.block_size
        # The scheduler's and the frontend's rule too: rope scaling extends the length (vLLM's).
        facts = model_facts(config.model)
        self.max_model_len = config.max_model_len or facts.max_model_len
        if self.max_model_len > facts.max_model_len:
            raise ValueError(context_error(self.max_model_len, facts))
        # Each rank caches only its own KV heads.
        layout = KVLayout(self.spec.num_layers, self.block_size, self.model.shapes.num_kv_heads,
                          self.spec.head_dim, self.dtype)

        # Per layer, once: kernels where they are built for the shapes, torch elsewhere
        # (--attention-backend); chosen before the profiling pass, which runs on it.
        self.attention_choice = select_attention_backend(self.device, attention_layers(self.model), self.dtype,
                                                         self.block_size, choice=config.attention_backend)
        self.attention = self.attention_choice.backend
        # A pooling engine (--runner pooling) samples nothing: rank 0 pools each completed prompt.
        self.pooling = engine_pooling(config.model, config.runner, config.pooling)
        self.pooler = Pooler(self.pooling) if self.pooling is not None and self.tp.first else None
        self.sampler = Sampler(self.vocab_size, self.device, config.seed) if self.tp.first and not self.pooling else None
        self.requests: dict[int, RequestState] = {}
        # Who wants to know each step's shape and time (e.g. bench/step_log.py); none by default.
        self.step_observers: list[StepObserver] = []

        # Decode steps read their inputs from persistent buffers (the addresses CUDA graphs
        # capture), sized for the largest graph; larger decode steps build their own tensors.
        self.graph_sizes = capture_sizes(config.max_num_seqs, config.cuda_graph_sizes)
        self.decode_buffers = DecodeBuffers(max(self.graph_sizes), -(-self.max_model_len // self.block_size),
                                            self.device)
        self.graphs: DecodeGraphs | None = None

        # Decided before the KV cache is sized, which keeps back what the graphs will take.
        wants_graphs = self._graphs_wanted()
        rank = self.model.shapes
        graph_shapes = GraphShapes(tuple(self.graph_sizes), s.hidden_size, rank.num_heads, rank.num_kv_heads,
                                   s.head_dim, rank.intermediate_size, self.decode_buffers.max_cols,
                                   self.dtype) if wants_graphs else None
        self.graph_reserve = graph_memory_reserve(config, graph_shapes)
        memory = profile_memory(self, layout) if needs_profile(config, self.device) else None
        self.num_kv_blocks = num_device_blocks(config, layout, self.max_model_len, memory, graph_shapes)
        self.num_cpu_blocks = num_swap_blocks(config, layout)
        self.kv_cache = KVCache(layout, self.num_kv_blocks, self.num_cpu_blocks, self.device)
        self._kv_layers = [self.kv_cache.layer(i) for i in range(self.spec.num_layers)]
        # Swaps through the copy_blocks kernel where attention runs on kernels.
        self.kv_cache.block_copier = getattr(self.attention, "copy_blocks", None)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.block_tables = BlockTables(max_blocks, self.kv_cache.null_block)
        if self.tp.first:
            log.info(capacity_line(self.num_kv_blocks, self.block_size, self.max_model_len))
        if self.device.type == "cpu" and self.tp.first:
            # Which layers the native CPU stack runs, and why the others not (the Python path).
            log.info("%s", native_stack.describe(native_stack.coverage(self.model, self._kv_layers)))
        # After the KV cache, which the graphs address.
        if wants_graphs:
            self.graphs = DecodeGraphs(self.decode_buffers, self.graph_sizes)
            try:
                with torch.inference_mode():  # as execute() runs: no autograd state in the graphs
                    self.graphs.capture(self._graph_forward, self.kv_cache.null_block, self.block_size,
                                        reserve=self.graph_reserve)
            except torch.cuda.OutOfMemoryError as e:
                # The KV cache took the memory first; serving eagerly beats not serving.
                log.warning("cuda graphs: off, out of memory while capturing (%s); decode steps run eagerly", e)
                self.graphs = None
                torch.cuda.empty_cache()

    def _graphs_wanted(self) -> bool:
        """CUDA graphs on one CUDA rank, unless --enforce-eager, with an attention backend whose
        decode steps a graph can replay (`graph_safe`: the torch backend's prepare() only takes
        views of the buffers; the kernel backend's prepare_graph() fixes its launches per bucket)."""
        if self.device.type != "cuda" or self.config.enforce_eager or self.pooling is not None:
            return False  # a pooling engine's steps are prefills: nothing for a decode graph
        if self.spec.num_experts:
            # Each MoE layer reads its experts' row counts on the host, which a graph cannot replay.
            log.info("cuda graphs: off (mixture-of-experts layers group their tokens by expert on the host)")
            return False
        if self.tp.size > 1 or not getattr(self.attention, "graph_safe", False):
            log.info("cuda graphs: off (%s)", "tensor parallel" if self.tp.size > 1
                     else f"the {self.attention.name} attention backend runs eagerly")
            return False
        return True

    def _graph_forward(self, size: int, views: DecodeViews) -> torch.Tensor:
        """The decode forward pass a graph of `size` rows captures: every row's block table at
        full width (the lengths on the device bound what each row reads)."""
        assert views.input_ids.shape[0] == size
        meta = graph_metadata(views, self.block_size)
        # A backend that plans launches on the host fixes them per bucket in prepare_graph.
        getattr(self.attention, "prepare_graph", self.attention.prepare)(meta)
        return self.model(views.input_ids, views.positions, meta, self.attention, self._kv_layers)

    # -- public -----------------------------------------------------------------

    def close(self) -> None:
        """Leave the process group (every rank calls this at shutdown)."""
        if self.tp.size > 1:
            destroy_tensor_parallel()

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Raises (KeyError/ValueError with the step and request
        named) on a plan that does not fit the worker's state."""
        for req_id in plan.finished_req_ids:
            self._drop(req_id)
        for new in plan.new_requests:
            self._add(new, plan.params)
        for cached in plan.cached_requests:
            self._update(cached, plan.step_id)
        # The order the protocol fixes (see StepPlan).
        self.kv_cache.swap_out(plan.swap_out)
        self.kv_cache.swap_in(plan.swap_in)
        if not plan.scheduled:
            return StepResult(step_id=plan.step_id, req_ids=[], token_ids=[])

        batch = self._prepare(plan)
        t_model = time.perf_counter()
        if batch.graph_size is not None and self.graphs is not None:
            hidden = self.graphs.replay(batch.graph_size, len(batch.states))
        else:
            hidden = self.model(batch.input_ids, batch.meta.positions, batch.meta, self.attention, self._kv_layers)
        # Advanced only once the forward pass has written the KV.
        for state, seq_len in zip(batch.states, batch.meta.seq_lens_host, strict=True):
            state.num_computed_tokens = seq_len
        # Every rank takes part (the logits are gathered); only rank 0 gets them.
        sampling = bool(batch.sample_requests) and self.pooling is None
        logits = self.model.compute_logits(hidden[batch.sample_token_index]) if sampling else None
        if batch.prompt_spans:
            collect(self.model, hidden, batch.prompt_spans)
        if self.step_observers:
            stats = StepStats(batch.meta.query_lens_host, batch.meta.seq_lens_host, len(batch.sample_requests),
                              time.perf_counter() - t_model)
            for observe in self.step_observers:
                observe(stats)
        if self.pooling is not None:
            ids, vectors = [], []
            if self.pooler is not None:
                meta = batch.meta
                ids, vectors = self.pooler.pool(hidden, batch.states, meta.query_lens_host, meta.seq_lens_host)
            return StepResult(step_id=plan.step_id, req_ids=[], token_ids=[], pooled_req_ids=ids, pooled=vectors)
        if not batch.sample_requests:
            return StepResult(step_id=plan.step_id, req_ids=[], token_ids=[])
        if plan.grammar is not None and logits is not None:  # structured output (rank 0 has the logits)
            apply_grammar_bitmask(logits, plan.grammar, [r.req_id for r in batch.sample_requests])
        tokens, logprobs = self._sample(logits, batch.sample_requests)
        for state, token in zip(batch.sample_requests, tokens, strict=True):
            state.token_ids.append(token)
        return StepResult(
            step_id=plan.step_id,
            req_ids=[r.req_id for r in batch.sample_requests],
            token_ids=tokens,
            logprobs=logprobs,
            prompt_logprobs=take_complete(batch.sample_requests),
        )

    def _sample(self, logits: torch.Tensor | None, requests: list[RequestState]
                ) -> tuple[list[int], list[Logprob | None] | None]:
        """Rank 0 samples; with several ranks it broadcasts the ids to the others."""
        logprobs = None
        if self.sampler is not None:
            assert logits is not None
            states = cast(list[SamplingState], [r.sampling for r in requests])  # set wherever a sampler is
            tokens, logprobs = self.sampler.sample(logits, states)
        else:
            tokens = [0] * len(requests)
        if self.tp.size > 1:
            ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            tokens = self.tp.broadcast_from_first(ids).tolist()
        return tokens, logprobs

    # -- request state ----------------------------------------------------------

    def _add(self, new: NewRequestData, plan_params: list[EngineSamplingParams]) -> None:
        # A request seen before (e.g. preempted and resumed) is rebuilt from scratch.
        self._drop(new.req_id)
        what = f"request {new.req_id}"
        if not new.token_ids:
            raise ValueError(f"{what}: no token ids")
        if not 0 <= new.params < len(plan_params):
            raise ValueError(f"{what}: params entry {new.params} outside the plan's {len(plan_params)}")
        params = plan_params[new.params]
        if not 0 <= new.num_computed_tokens <= len(new.token_ids):
            raise ValueError(f"{what}: num_computed_tokens {new.num_computed_tokens} outside "
                             f"[0, {len(new.token_ids)}]")
        bad = [t for t in new.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what}: token ids outside the vocabulary [0, {self.vocab_size}): {bad[:8]}")
        if self.pooling is not None and self.pooling.every_position and new.num_computed_tokens:
            raise ValueError(f"{what}: {self.pooling.mode} pooling needs every position computed here, but "
                             f"{new.num_computed_tokens} come computed")
        tracker = PromptLogprobs.for_request(new, params)
        self.kv_cache.check_blocks(new.block_ids, what)
        sampling = None
        if self.sampler is not None:
            sampling = SamplingState(params, new.token_ids, new.num_prompt_tokens, new.eos_token_ids,
                                     self.vocab_size, self.device, new.sample_index)
        self.requests[new.req_id] = RequestState(
            req_id=new.req_id,
            token_ids=list(new.token_ids),
            num_computed_tokens=new.num_computed_tokens,
            row=self.block_tables.add(new.block_ids),
            sampling=sampling,
            prompt_logprobs=tracker,
        )

    def _update(self, cached: CachedRequestData, step_id: int) -> None:
        state = self._get(cached.req_id, step_id)
        what = f"step {step_id} request {cached.req_id}"
        self.kv_cache.check_blocks(cached.new_block_ids, what)
        self.block_tables.append(state.row, cached.new_block_ids)

    def _drop(self, req_id: int) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.block_tables.free(state.row)

    def _get(self, req_id: int, step_id: int) -> RequestState:
        state = self.requests.get(req_id)
        if state is None:
            raise KeyError(f"step {step_id} refers to request {req_id}, which the worker does not know")
        return state

    # -- batch construction -----------------------------------------------------

    def _scheduled_inputs(self, plan: StepPlan) -> tuple[list[RequestState], list[int], list[int], list[int]]:
        """The plan's requests in batch order with their new input ids, query and context lengths,
        checked against what this worker knows (a plan that disagrees is a bug, not a step)."""
        bs = self.block_size
        states: list[RequestState] = []
        input_ids: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        for req_id, n in plan.scheduled:
            state = self._get(req_id, plan.step_id)
            c = state.num_computed_tokens
            if n < 1 or c + n > len(state.token_ids):
                raise ValueError(f"step {plan.step_id}: request {req_id} schedules {n} tokens with "
                                 f"{c} of {len(state.token_ids)} computed")
            if c + n > self.block_tables.num_blocks[state.row] * bs:
                raise ValueError(f"step {plan.step_id}: request {req_id} needs {-(-(c + n) // bs)} blocks "
                                 f"but has {self.block_tables.num_blocks[state.row]}")
            states.append(state)
            input_ids.extend(state.token_ids[c : c + n])
            query_lens.append(n)
            context_lens.append(c)
        if len({id(s) for s in states}) != len(states):
            raise ValueError(f"step {plan.step_id}: a request is scheduled twice")
        return states, input_ids, query_lens, context_lens

    def _prepare(self, plan: StepPlan) -> _Batch:
        bs = self.block_size
        states, input_ids, query_lens, context_lens = self._scheduled_inputs(plan)
        if (len(input_ids) == len(states) <= self.decode_buffers.max_rows
                and max(context_lens) < self.decode_buffers.max_cols * bs):
            return self._prepare_decode(states, input_ids, context_lens)
        seq_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
        query_start = [0, *accumulate(query_lens)]
        block_tables = self.block_tables.gather([s.row for s in states], -(-max(seq_lens) // bs))
        num_seqs = len(states)
        if len(input_ids) == num_seqs:  # decode-only: one token per sequence
            # Slots from the rows' block id lists: one tensor instead of six small operators.
            ids = self.block_tables.ids
            positions = torch.tensor(context_lens, dtype=torch.long)
            slots = torch.tensor([ids[s.row][c // bs] * bs + c % bs for s, c in zip(states, context_lens, strict=True)],
                                 dtype=torch.long)
        else:
            q_lens = torch.tensor(query_lens, dtype=torch.long)
            offsets = torch.tensor(context_lens, dtype=torch.long) - torch.tensor(query_start[:-1])
            positions = torch.arange(len(input_ids)) + torch.repeat_interleave(offsets, q_lens)
            seq_index = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
            slots = block_tables[seq_index, positions // bs] * bs + positions % bs

        sample_requests, sample_index = [], []
        for i, state in enumerate(states):
            if seq_lens[i] == len(state.token_ids):
                sample_requests.append(state)
                sample_index.append(query_start[i + 1] - 1)
        spans: list[Span] = []
        for i, state in enumerate(states):
            if state.prompt_logprobs is not None:
                first, count = state.prompt_logprobs.span(context_lens[i], query_lens[i])
                if count:
                    spans.append((state.prompt_logprobs, query_start[i] + first - context_lens[i], first, count))

        dev = self.device
        meta = AttentionMetadata(
            positions=positions.to(dev),
            slot_mapping=slots.to(dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            block_tables=block_tables.to(dev),
            block_size=bs,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            query_start_host=query_start,
        )
        self.attention.prepare(meta)
        return _Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            meta=meta,
            states=states,
            sample_requests=sample_requests,
            sample_token_index=torch.tensor(sample_index, dtype=torch.long, device=dev),
            prompt_spans=spans,
        )

    def _prepare_decode(self, states: list[RequestState], input_ids: list[int], context_lens: list[int]) -> _Batch:
        """A decode-only step (one token per sequence) through the persistent buffers: staged
        once, one copy to the device; padded to its graph's size when one replays it."""
        bs, num_seqs = self.block_size, len(states)
        seq_lens = [c + 1 for c in context_lens]
        size = self.graphs.bucket(num_seqs) if self.graphs is not None else None
        cols = self.decode_buffers.max_cols if size is not None else -(-max(seq_lens) // bs)
        ids = self.block_tables.ids
        # Slots from the rows' block id lists: no tensor operators on the host.
        slots = [ids[s.row][c // bs] * bs + c % bs for s, c in zip(states, context_lens, strict=True)]
        inputs = DecodeInputs(input_ids, context_lens, slots, seq_lens,
                              self.block_tables.gather([s.row for s in states], cols))
        if size is not None:
            inputs = pad_decode(inputs, size, self.kv_cache.null_block, bs)
        views = self.decode_buffers.stage(inputs)
        query_start = list(range(num_seqs + 1))
        meta = AttentionMetadata(
            positions=views.positions[:num_seqs],
            slot_mapping=views.slot_mapping[:num_seqs],
            query_start_loc=views.query_start_loc[: num_seqs + 1],
            seq_lens=views.seq_lens[:num_seqs],
            block_tables=views.block_tables[:num_seqs],
            block_size=bs,
            query_lens_host=[1] * num_seqs,
            seq_lens_host=seq_lens,
            query_start_host=query_start,
        )
        if size is None:
            self.attention.prepare(meta)
        sample_rows = [i for i, s in enumerate(states) if seq_lens[i] == len(s.token_ids)]
        spans: list[Span] = []
        for i, state in enumerate(states):
            if state.prompt_logprobs is not None:
                first, count = state.prompt_logprobs.span(context_lens[i], 1)
                if count:
                    spans.append((state.prompt_logprobs, i + first - context_lens[i], first, count))
        if len(sample_rows) == num_seqs:
            sample_index = views.query_start_loc[:num_seqs]  # 0..B-1, already on the device
        else:
            sample_index = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return _Batch(
            input_ids=views.input_ids[:num_seqs],
            meta=meta,
            states=states,
            sample_requests=[states[i] for i in sample_rows],
            sample_token_index=sample_index,
            prompt_spans=spans,
            graph_size=size,
        )

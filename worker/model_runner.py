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
from typing import cast

import torch

from noria.protocol.client import Logprob
from noria.protocol.config import EngineConfig
from noria.protocol.model_identity import context_error, model_facts
from noria.protocol.model_shapes import sharded_shapes, tensor_parallel_error
from noria.protocol.pooling import engine_pooling
from noria.protocol.quant_fp8 import online_quant
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.step import CachedRequestData, NewRequestData, StepPlan, StepResult
from noria.worker import native_stack
from noria.worker.attention import AttentionBackend
from noria.worker.attention_select import attention_layers, select_attention_backend
from noria.worker.block_table import BlockTables
from noria.worker.cuda_graphs import (
    DecodeBuffers,
    DecodeGraphs,
    DecodeViews,
    capture_graphs,
    capture_sizes,
    decode_forward,
    planned_graphs,
)
from noria.worker.device import choose_dtype, cpu_precision, resolve_device, same_on_every_rank
from noria.worker.draft_model import load_drafter, propose_drafts
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
from noria.worker.kv_fp8 import apply_scales, cache_dtype
from noria.worker.loader import checkpoint_float32_bytes, load_model, load_spec
from noria.worker.memory_profile import profile_memory
from noria.worker.models import quant_kinds
from noria.worker.models.ops import choose_ops
from noria.worker.models.parallel import destroy_tensor_parallel, init_tensor_parallel
from noria.worker.pooling import Pooler
from noria.worker.prompt_logprobs import PromptLogprobs, collect, take_complete
from noria.worker.rank_transfers import RankTransfers
from noria.worker.sampler import Sampler, SamplingState
from noria.worker.score_head import engine_head
from noria.worker.spec_decode import take_drafts, verify
from noria.worker.step_inputs import (
    Batch,
    RequestState,
    build_batch,
    check_new_request,
    request_state,
)

log = logging.getLogger("noria.worker")


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


class ModelRunner:
    """Owns the model, the KV cache and every request's worker-side state. Attributes the process
    loop reports in WorkerReady: `num_kv_blocks` (device blocks the scheduler may hand out),
    `num_cpu_blocks` (swap area), `vocab_size`, `max_model_len`, `block_size`."""

    def __init__(self, config: EngineConfig, rank: int = 0, dist_init_method: str | None = None) -> None:
        """`dist_init_method` (e.g. tcp://127.0.0.1:PORT) is the torch.distributed
        rendezvous of the tensor-parallel ranks; unused with one rank."""
        self.config = config
        self.rank = rank
        self._dist_init_method = dist_init_method
        self.requests: dict[int, RequestState] = {}
        # Who wants to know each step's shape and time (e.g. bench/step_log.py); none by default.
        self.step_observers: list[StepObserver] = []
        self._set_up_process()
        self._load_model()
        self._set_lengths()
        self._choose_attention()
        self._set_up_outputs()
        # Planned before the KV cache is sized, which keeps back what the graphs will take.
        graph_shapes = self._plan_graphs()
        self._allocate_kv_cache(graph_shapes)
        self._log_native_stack()
        if graph_shapes is not None:
            self._capture_graphs()

    def _set_up_process(self) -> None:
        """Threads, seed and this rank's device."""
        config, tp_size = self.config, self.config.tensor_parallel_size
        # Ranks on one host share its cores: each takes its share so that N ranks
        # do not oversubscribe them (num_threads, when given, is per rank).
        torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // tp_size))
        torch.manual_seed(config.seed)
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and tp_size > 1:
            self.device = torch.device("cuda", self.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)

    def _load_model(self) -> None:
        """The model's spec, the tensor-parallel group and this rank's shard of the weights."""
        config, rank, dist_init_method = self.config, self.rank, self._dist_init_method
        tp_size = config.tensor_parallel_size
        # --quantization fp8: the float checkpoint's linear layers get fp8 schemes, quantized at load.
        self.spec = s = online_quant(load_spec(config.model, config.max_model_len), config.quantization)
        # The check `noria serve` makes too; here before joining the other ranks.
        problem = tensor_parallel_error(sharded_shapes(s), tp_size)
        if problem:
            raise ValueError(f"cannot shard {config.model}: {problem}")
        self.tp = init_tensor_parallel(rank, tp_size, dist_init_method, self.device, config.startup_timeout)
        self.transfers = RankTransfers(config, rank, self.tp, self.device)  # started by the WorkerSession
        choice = choose_dtype(config.dtype, self.device, s.dtype, lambda: checkpoint_float32_bytes(config.model))
        choice = same_on_every_rank(choice, self.device, self.tp)
        self.dtype, self.weight_dtype = cpu_precision(choice.dtype, self.device)
        # The KV cache in the model's dtype even where activations are wider (the CPU's bf16 runs):
        # decode attention is bound by the K/V bytes it reads, and bf16 halves them; fp8 (the flag) quarters them.
        self.kv_dtype = cache_dtype(config.kv_cache_dtype, self.weight_dtype or self.dtype)
        line = choice.line(self.weight_dtype)
        if line and self.tp.first:
            log.info("%s", line)
        self.model = load_model(config.model, self.spec, self.device, self.dtype, self.tp, self.weight_dtype,
                                config.load_format, config.seed)
        scales_line = apply_scales((layer.self_attn for layer in self.model.layers), self.kv_dtype)
        if scales_line and self.tp.first:
            log.info("%s", scales_line)
        if s.quantization is not None and self.tp.first:
            log.info("%s", quant_kinds.describe(self.model, s.quantization.describe))
        self.drafter = load_drafter(config, self.device, self.dtype, self.weight_dtype, self.kv_dtype, self.tp,
                                    self.model)

    def _set_lengths(self) -> None:
        """Vocabulary, block size and context length, as the scheduler is told them."""
        self.vocab_size = self.spec.vocab_size
        self.block_size = self.config.block_size
        # The scheduler's and the frontend's rule too: rope scaling extends the length (vLLM's).
        facts = model_facts(self.config.model)
        self.max_model_len = self.config.max_model_len or facts.max_model_len
        if self.max_model_len > facts.max_model_len:
            raise ValueError(context_error(self.max_model_len, facts))

    def _choose_attention(self) -> None:
        """Per layer, once: kernels where they are built for the shapes, torch elsewhere
        (--attention-backend); chosen before the profiling pass, which runs on it."""
        self.attention_choice = select_attention_backend(self.device, attention_layers(self.model), self.dtype,
                                                         self.block_size, choice=self.config.attention_backend,
                                                         kv_dtype=self.kv_dtype)
        self.use_attention(self.attention_choice.backend)

    def use_attention(self, backend: AttentionBackend) -> None:
        """Attention on `backend`, and the layers on the ops that go with it (the CUDA kernels'
        with the kernel backend), both fixed until called again."""
        self.attention = backend
        self.model.use_ops(choose_ops(self.spec.activation, self.device, self.dtype, backend, self.block_size))

    def _set_up_outputs(self) -> None:
        """What rank 0 makes of the hidden states: samples, or (--runner pooling) pooled vectors
        of completed prompts, where nothing is sampled."""
        config = self.config
        self.pooling = engine_pooling(config.model, config.runner, config.pooling)
        head = engine_head(config, self.device) if self.pooling is not None and self.tp.first else None
        self.pooler = Pooler(self.pooling, head) if self.pooling is not None and self.tp.first else None
        self.sampler = Sampler(self.vocab_size, self.device, config.seed) if self.tp.first and not self.pooling else None

    def _plan_graphs(self) -> GraphShapes | None:
        """The decode buffers, and the shapes of the CUDA graphs to capture over them (None:
        decode steps run eagerly); sets `graph_reserve`, what the KV cache leaves them."""
        # Decode steps read their inputs from persistent buffers (the addresses CUDA graphs
        # capture), sized for the largest graph; larger decode steps build their own tensors.
        self.graph_sizes = capture_sizes(self.config.max_num_seqs, self.config.cuda_graph_sizes)
        self.decode_buffers = DecodeBuffers(max(self.graph_sizes), -(-self.max_model_len // self.block_size),
                                            self.device)
        self.graphs: DecodeGraphs | None = None
        shapes = planned_graphs(self.config, self.device, self.spec, self.model.shapes, self.attention,
                                self.tp.size, self.pooling is not None, self.decode_buffers, self.graph_sizes,
                                self.dtype, len(set(self.model.capture)))
        self.graph_reserve = graph_memory_reserve(self.config, shapes)
        return shapes

    def _allocate_kv_cache(self, graph_shapes: GraphShapes | None) -> None:
        """Size the KV cache and swap area (on a GPU after a profiling pass over the worst
        steps, which runs this runner), allocate them and the block tables that index them."""
        config = self.config
        # Each rank caches only its own KV heads.
        layout = KVLayout(self.spec.num_layers, self.block_size, self.model.shapes.num_kv_heads,
                          self.spec.head_dim, self.kv_dtype, self.drafter.layout.bytes_per_block if self.drafter else 0)
        memory = profile_memory(self, layout) if needs_profile(config, self.device) else None
        self.num_kv_blocks = num_device_blocks(config, layout, self.max_model_len, memory, graph_shapes)
        self.num_cpu_blocks = num_swap_blocks(config, layout)
        self.kv_cache = KVCache(layout, self.num_kv_blocks, self.num_cpu_blocks, self.device)
        self._kv_layers = [self.kv_cache.layer(i) for i in range(self.spec.num_layers)]
        # Swaps through the copy_blocks kernel where attention runs on kernels.
        self.kv_cache.block_copier = getattr(self.attention, "copy_blocks", None)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.block_tables = BlockTables(max_blocks, self.kv_cache.null_block)
        if self.drafter is not None:
            self.drafter.allocate(self.num_kv_blocks, self.num_cpu_blocks, self.block_tables)
        if self.tp.first:
            log.info(capacity_line(self.num_kv_blocks, self.block_size, self.max_model_len, self.kv_dtype))

    def _log_native_stack(self) -> None:
        if self.device.type == "cpu" and self.tp.first:
            # Which layers the native CPU stack runs, and why the others not (the Python path).
            log.info("%s", native_stack.describe(native_stack.coverage(self.model, self._kv_layers)))

    def _capture_graphs(self) -> None:
        """After the KV cache, which the graphs address."""
        self.graphs = capture_graphs(self.decode_buffers, self.graph_sizes, self._graph_forward,
                                     self.kv_cache.null_block, self.block_size, self.graph_reserve)

    def _graph_forward(self, size: int, views: DecodeViews) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decode forward pass a graph of `size` rows captures, on the runner's backend then."""
        return decode_forward(self.model, self.attention, self._kv_layers, self.block_size, size, views)

    # -- public -----------------------------------------------------------------

    def close(self) -> None:
        """Leave the process group (every rank calls this at shutdown)."""
        self.transfers.close()
        if self.tp.size > 1:
            destroy_tensor_parallel()

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step, with the KV pulls that ended meanwhile (a step with nothing else to do
        waits a little for one). Raises (KeyError/ValueError with the step and request named)
        on a plan that does not fit the worker's state."""
        result = self._step(plan)
        result.kv_pulled = self.transfers.ended(idle=not plan.scheduled)
        return result

    @torch.inference_mode()
    def _step(self, plan: StepPlan) -> StepResult:
        if plan.kv_release:
            self.transfers.release(plan.kv_release)
        for req_id in plan.finished_req_ids:
            self._drop(req_id)
        for new in plan.new_requests:
            self._add(new, plan.params)
        for cached in plan.cached_requests:
            self._update(cached, plan.step_id)
        # The order the protocol fixes (see StepPlan).
        self.kv_cache.swap_out(plan.swap_out)
        self.kv_cache.swap_in(plan.swap_in)
        if self.drafter is not None:
            self.drafter.swap(plan.swap_out, plan.swap_in)
        if plan.kv_pulls:
            self.transfers.submit(plan.kv_pulls)
        if not plan.scheduled:
            return StepResult(step_id=plan.step_id, req_ids=[], token_ids=[])

        if plan.drafts:  # a draft model's proposals first
            propose_drafts(plan, self.drafter, self.requests, self.tp, self.device)
        drafted = take_drafts(plan, self.requests, self.vocab_size) if plan.drafts else None
        batch = self._prepare(plan, drafted)
        t_model = time.perf_counter()
        if batch.graph_size is not None and self.graphs is not None:
            # The kept layer inputs come out of the graph too (an EAGLE-3 head reads them below).
            hidden, self.model.captured = self.graphs.replay(batch.graph_size, len(batch.states))
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
            result = StepResult(step_id=plan.step_id, req_ids=[], token_ids=[])
        elif drafted:  # speculative decoding: every drafted position sampled, the accepted run kept
            result = verify(plan, logits, batch.sample_requests, drafted, self._sample_rows)
        else:
            result = self._sample(plan, logits, batch.sample_requests)
        if self.drafter is not None:  # (a head reads the step's hidden states and tokens)
            self.drafter.stepped(batch, self.requests)
        self.transfers.hold_exports(batch.sample_requests, self.block_tables.ids, self.block_size)
        return result

    def _sample(self, plan: StepPlan, logits: torch.Tensor | None, requests: list[RequestState]) -> StepResult:
        if plan.grammar is not None and logits is not None:  # structured output (rank 0 has the logits)
            apply_grammar_bitmask(logits, plan.grammar, [r.req_id for r in requests])
        tokens, logprobs = self._sample_rows(logits, [r.sampling for r in requests], record=True)
        for state, token in zip(requests, tokens, strict=True):
            state.token_ids.append(token)
        return StepResult(step_id=plan.step_id, req_ids=[r.req_id for r in requests], token_ids=tokens,
                          logprobs=logprobs, prompt_logprobs=take_complete(requests))

    def _sample_rows(self, logits: torch.Tensor | None, states: list[SamplingState | None], record: bool = False
                     ) -> tuple[list[int], list[Logprob | None] | None]:
        """Rank 0 samples a row per state; with several ranks it broadcasts the ids to the others."""
        logprobs = None
        if self.sampler is not None:
            assert logits is not None
            tokens, logprobs = self.sampler.sample(logits, cast(list[SamplingState], states), record)
        else:
            tokens = [0] * len(states)
        if self.tp.size > 1:
            ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            tokens = self.tp.broadcast_from_first(ids).tolist()
        return tokens, logprobs

    # -- request state ----------------------------------------------------------

    def _add(self, new: NewRequestData, plan_params: list[EngineSamplingParams]) -> None:
        # A request seen before (e.g. preempted and resumed) is rebuilt from scratch.
        self._drop(new.req_id)
        params = check_new_request(new, plan_params, self.vocab_size, self.pooling)
        tracker = PromptLogprobs.for_request(new, params)
        self.kv_cache.check_blocks(new.block_ids, f"request {new.req_id}")
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
            kv_export=new.kv_export_id,
            num_prompt_tokens=new.num_prompt_tokens,
        )
        if self.drafter is not None:
            self.drafter.added(self.requests[new.req_id], new.block_ids)

    def _update(self, cached: CachedRequestData, step_id: int) -> None:
        state = self._get(cached.req_id, step_id)
        what = f"step {step_id} request {cached.req_id}"
        self.kv_cache.check_blocks(cached.new_block_ids, what)
        self.block_tables.append(state.row, cached.new_block_ids)
        if self.drafter is not None:
            self.drafter.fresh(cached.new_block_ids)

    def _drop(self, req_id: int) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            if self.drafter is not None:
                self.drafter.mark(state)
            self.block_tables.free(state.row)

    def _get(self, req_id: int, step_id: int) -> RequestState:
        return request_state(self.requests, req_id, step_id)

    # -- batch construction -----------------------------------------------------

    def _prepare(self, plan: StepPlan, drafted: dict[int, int] | None = None) -> Batch:
        """The step's batch (worker/step_inputs.py), read from the runner's state as it is now:
        the profiling pass swaps in its own KV cache and block tables."""
        return build_batch(plan, self.requests, self.block_tables, self.decode_buffers, self.graphs,
                           self.attention, block_size=self.block_size, null_block=self.kv_cache.null_block,
                           device=self.device, drafted=drafted)

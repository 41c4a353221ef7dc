"""A request as the scheduler sees it: tokens, progress, blocks, status."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from noria.protocol.engine import EngineRequest, EngineSample
from noria.protocol.kv_transfer import KVTransferParams
from noria.protocol.sampling import EngineSamplingParams
from noria.scheduler.ngram import NgramIndex
from noria.scheduler.structured_output import advance
from noria.scheduler.suffix_decoding import SuffixProposer

_SETS: dict[frozenset[int], frozenset[int]] = {}


def _shared(ids: frozenset[int]) -> frozenset[int]:
    """One object per distinct set: the per-token stop check of a thousand requests then
    reads one set that stays in cache instead of a thousand."""
    if len(_SETS) > 4096:  # many distinct stop sets: stop interning rather than grow
        return _SETS.get(ids, ids)
    return _SETS.setdefault(ids, ids)


class SharedParams:
    """What the samples of one engine request share, made once for all of them: the
    parameters, the workers' copy of them (no grammar: the workers get masks) and the
    stop-token sets the per-token check reads, and the workers' copy's encoded size (a
    plan's budget for parameters counts it)."""

    __slots__ = ("params", "worker_params", "eos_token_ids", "worker_eos", "stop_ids", "nbytes")

    def __init__(self, msg: EngineRequest) -> None:
        p = msg.params
        self.params: EngineSamplingParams = p
        self.worker_params = p if p.structured_output is None else msgspec.structs.replace(p, structured_output=None)
        self.eos_token_ids = _shared(frozenset(() if p.ignore_eos else msg.eos_token_ids))
        self.worker_eos = sorted(self.eos_token_ids)
        self.stop_ids = _shared(frozenset(p.stop_token_ids or ()))
        self.nbytes = len(msgspec.msgpack.encode(self.worker_params))


class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED = 3
    WAITING_GRAMMAR = 4  # waits for its structured-output grammar to compile
    PULLING = 5  # holds blocks its prompt's KV is pulled into from a producer (scheduler/kv_transfer.py)


class Request:
    """One sequence. `num_computed_tokens` catches up with `len(token_ids)`;
    prefill, chunked prefill, prefix hits and resumed requests are all that."""

    # What every step reads first, side by side (two cache lines): with a thousand requests
    # running, the planning and result loops are bound by memory, not by the interpreter.
    __slots__ = (
        "req_id", "num_computed_tokens", "num_worker_tokens", "decode_limit", "decode_entry", "token_ids",
        "length_cap", "stop_any", "matcher", "num_cached_tokens", "status", "min_len",
        "num_prompt_tokens", "params", "shared", "sample_index", "eos_token_ids", "stop_ids", "priority",
        "arrival_seq",
        "max_tokens", "block_ids", "block_hashes", "num_cached_blocks", "in_worker",
        "swapped_blocks", "num_preemptions", "sort_key", "hash_root", "grammar_wait", "pooling", "pools_every_position",
        "kv_remote", "kv_export", "ngram", "spec_k", "spec_skip", "spec_misses", "spec_last", "spec_pending",
    )

    def __init__(self, msg: EngineRequest, arrival_seq: int, max_tokens: int, hash_root: bytes | None,
                 sample: EngineSample | None = None, shared: SharedParams | None = None) -> None:
        """One sample of `msg` (default: its first), with what its samples share."""
        sample = sample or EngineSample(msg.req_id, msg.sample_index, msg.output_token_ids)
        shared = shared or SharedParams(msg)
        self.req_id = sample.req_id
        self.sample_index = sample.index
        self.token_ids: list[int] = list(msg.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.token_ids += sample.output_token_ids  # resumed after a scheduler restart: outputs so far
        self.shared = shared
        self.params = shared.params
        self.eos_token_ids = shared.eos_token_ids
        self.stop_ids = shared.stop_ids
        self.priority = msg.priority
        self.arrival_seq = arrival_seq
        self.max_tokens = max_tokens
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained keys (digests) of the full blocks so far
        self.hash_root = hash_root  # its first block's parent key; None: its blocks are never shared
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.in_worker = False  # the worker holds state for it
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.swapped_blocks: list[int] = []  # CPU blocks while swapped out
        self.num_preemptions = 0
        self.matcher: Any = None  # llguidance matcher of a structured-output request
        # The token that ends the reasoning, while the grammar waits for it (the matcher sees
        # and the mask constrains only what follows it); None: the grammar holds.
        self.grammar_wait: int | None = (self.params.reasoning_end_token_id
                                         if self.params.structured_output is not None else None)
        # Lower runs first; later arrivals are preempted first within a priority.
        self.sort_key = (self.priority, self.arrival_seq)
        # Stop conditions as totals of token ids, for the per-token check (scheduler/results.py).
        self.length_cap = self.num_prompt_tokens + max_tokens  # "length" once len(token_ids) reaches it
        self.min_len = self.num_prompt_tokens + self.params.min_tokens  # stop tokens count from here
        self.stop_any = _shared(self.eos_token_ids | self.stop_ids)
        # Tokens the worker will hold once every step planned so far has run: with async
        # scheduling, one more than `token_ids` while a sampled token is on its way.
        self.num_worker_tokens = len(self.token_ids)
        self.decode_limit = 0  # set by `set_decode_limit`
        self.decode_entry = (self.req_id, 1)  # its StepPlan.scheduled pair for a decode, made once
        # A pooling engine's request (`Scheduler.pooling`): it ends with its embedding once its
        # prompt is computed, and generates nothing. `pools_every_position`: mean or cls
        # pooling, which reads hidden states before the last (see `needs_all_positions`).
        self.pooling = False
        self.pools_every_position = False
        # Prefill/decode disaggregation (scheduler/kv_transfer.py): where a consumer's prompt KV
        # waits to be pulled, and a producer's transfer id (0: none).
        self.kv_remote: KVTransferParams | None = None
        self.kv_export = 0
        # Speculative decoding (scheduler/speculation.py): its proposer (None: never drafted), its
        # draft length now, lookups to sit out, drafts rejected outright in a row, and the step
        # that last drafted it.
        self.ngram: NgramIndex | SuffixProposer | None = None
        self.spec_k = 0
        self.spec_skip = 0
        self.spec_misses = 0
        self.spec_last = -1  # the step that last drafted it
        self.spec_pending = False  # its draft is being verified (a plan made meanwhile leaves it out)

    def set_decode_limit(self, max_model_len: int) -> None:
        """Where the hot paths stop for this request (`Scheduler.schedule`, `update_from_result`):
        at the last token it may produce. 0 for a constrained request: it always takes the
        general path, where its matcher sees every token; 0 for a pooling request, which
        produces no token."""
        if self.matcher is not None or self.pooling:
            self.decode_limit = 0
        else:
            self.decode_limit = min(self.length_cap, max_model_len)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_in_flight(self) -> int:
        """Sampled tokens on their way from the worker (async scheduling)."""
        return self.num_worker_tokens - len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logits(self) -> bool:
        """Its prompt logprobs are still due (they come with the first token): every prompt
        position must be computed, so no prefix-cache hits and no swap (worker/prompt_logprobs.py)."""
        return (self.params.prompt_logprobs is not None and self.sample_index == 0
                and len(self.token_ids) == self.num_prompt_tokens)

    @property
    def needs_all_positions(self) -> bool:
        """Every prompt position must be computed by this request, in order, before its result:
        no prefix-cache hits, and a preemption recomputes instead of swapping (the worker's
        running state for it is dropped with it). Prompt logprobs still due, or mean and cls
        pooling (worker/pooling.py)."""
        return self.pools_every_position or self.needs_prompt_logits

    def stop_reason(self, tok: int, max_model_len: int) -> str | None:
        """Why the token just appended ends the request, if it does; vLLM's order: length
        caps first, then stop tokens once min_tokens is met. The matcher sees every token."""
        n = len(self.token_ids)
        grammar = None
        if self.matcher is not None:
            if self.grammar_wait is None:
                grammar = advance(self.matcher, tok)
            elif tok == self.grammar_wait:
                self.grammar_wait = None  # the reasoning ended: the grammar holds from the next token
        if n >= self.length_cap or n >= max_model_len:
            return "length"
        if grammar is not None:
            return grammar  # a complete grammar ends it ("stop") even before min_tokens
        return "stop" if tok in self.stop_any and n >= self.min_len else None

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )

"""Scheduler <-> worker step messages: one StepPlan per iteration, one StepResult back.

The rest of the worker link (registration, heartbeats, the unions each direction
is typed by) is in protocol/worker_link.py.

The worker keeps per-request state (token ids, block table, sampling params)
across steps, so a plan carries only what changed: full data for requests the
worker has not seen, new block ids for the others. Sampling parameters go once per
plan however many samples share them: a new request names its entry in
`StepPlan.params`.
"""

from __future__ import annotations

import msgspec

from noria.protocol.client import Logprob
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.speculative import Draft


class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    """A request the worker has not seen (or must forget and rebuild after preemption).

    `token_ids` holds every token known so far (prompt plus outputs of a resumed
    request); KV of the first `num_computed_tokens` is already in `block_ids`.
    `params` indexes the plan's `params`; `sample_index` is the request's index among
    its client request's samples (its seed: `sample_seed`; prompt logprobs: index 0).
    """

    req_id: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    params: int
    num_prompt_tokens: int
    eos_token_ids: list[int] = []
    sample_index: int = 0
    # A producer's request (prefill/decode disaggregation): once its prompt is computed, the
    # worker holds its prompt blocks under this id for consumers to read (0: none).
    kv_export_id: int = 0


class CachedRequestData(msgspec.Struct, array_like=True, gc=False):
    """Blocks appended to a known request's block table. Entries are only ever appended:
    the scheduler shares only full blocks and never writes one again, so no entry is
    repointed at a private copy (no copy-on-write)."""

    req_id: int
    new_block_ids: list[int]


class GrammarBitmask(msgspec.Struct, array_like=True, gc=False):
    """The tokens each constrained request may sample in this step (structured output).

    Row r is for `req_ids[r]`: ceil(vocab_size / 32) little-endian int32 words, and
    bit t % 32 of word t // 32 set means token t is allowed. Only the requests that
    sample in this step and have a grammar get a row; a drafted one (speculative decoding)
    gets one per position it samples, consecutive, in order (its id repeated).
    """

    req_ids: list[int]
    data: bytes


class KVPull(msgspec.Struct, array_like=True, gc=False):
    """Blocks a consumer's worker rank r reads from `endpoints[r]` (the producer's rank r)
    into its own: `remote_block_ids[i]` lands in `local_block_ids[i]`."""

    req_id: int
    transfer_id: int
    endpoints: list[str]
    remote_block_ids: list[int]
    local_block_ids: list[int]


class KVPulled(msgspec.Struct, array_like=True, gc=False):
    """How a `KVPull` went, on every rank: `ok` only if each rank got all its blocks."""

    req_id: int
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class StepPlan(msgspec.Struct, array_like=True, gc=False, tag="plan"):
    """One iteration.

    `scheduled` pairs (req_id, num_tokens) in batch order; a request samples a
    token when the step brings its computed tokens up to all its known tokens.
    Before the forward pass the worker does, in this order: `swap_out`
    (device_block, cpu_block), then `swap_in` (device_block, cpu_block). The
    scheduler never swaps in during a step that swapped out, so no block freed
    by one of them is reused by the other within the step. First of all the worker lets go
    of the transfers in `kv_release` (their blocks may be reused from this step on), and it
    queues `kv_pulls` to run beside the steps (worker/kv_pull_queue.py): each one's outcome
    comes in the first result after it ends (`StepResult.kv_pulled`), and until then the
    scheduler gives its blocks to no one else.
    """

    step_id: int
    scheduled: list[tuple[int, int]]
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    finished_req_ids: list[int] = []
    swap_out: list[tuple[int, int]] = []
    swap_in: list[tuple[int, int]] = []
    epoch: int = 0  # the worker group's incarnation (set by the scheduler process when it sends)
    grammar: GrammarBitmask | None = None  # masks for this step's constrained samples
    # The sampling parameters of this plan's new requests, each once (samples share one).
    params: list[EngineSamplingParams] = []
    kv_pulls: list[KVPull] = []
    kv_release: list[int] = []  # transfer ids (NewRequestData.kv_export_id) whose blocks are freed
    # Speculative decoding: the tokens proposed for some of this step's decodes (a request's
    # scheduled count is then 1 + its draft's length), verified in this step's forward pass.
    drafts: list[Draft] = []


class StepResult(msgspec.Struct, array_like=True, gc=False, tag="result"):
    """Sampled token ids for the requests that sampled this step, in plan order (or, from a
    pooling engine, the pooled vectors of the requests whose prompt the step completed). A request
    whose draft was verified appears once per token it keeps, consecutively, in output order: its
    accepted draft tokens, then the token sampled after them (`logprobs` likewise)."""

    step_id: int
    req_ids: list[int]
    token_ids: list[int]
    logprobs: list[Logprob | None] | None = None
    error: str | None = None
    epoch: int = 0  # copied from the plan: a result of a lost incarnation is never applied
    # Parallel to req_ids: a request's whole prompt logprobs (first entry None), sent with its
    # first sampled token when it asked for them (worker/prompt_logprobs.py), else None.
    prompt_logprobs: list[list[Logprob | None] | None] | None = None
    # A pooling engine (`--runner pooling`) samples nothing: the requests whose prompt this step
    # completed, each with its pooled hidden state (before normalization) as little-endian
    # float32 bytes, `pooled[i]` for `pooled_req_ids[i]`.
    pooled_req_ids: list[int] = []
    pooled: list[bytes] = []
    kv_pulled: list[KVPulled] = []  # the pulls that ended (on every rank) since the last result

"""Frontend <-> scheduler messages (internal, array-like for speed).

Requests are identified by small integers chosen by the frontend; the
frontend maps them back to (client, request_id). In the scheduler one engine
request is one sequence, but the n samples of a client request cross the link
in one `EngineRequest`: the prompt and the parameters travel once, not n times.
"""

from __future__ import annotations

import msgspec

from noria.protocol.client import Logprob, SchedulerStats
from noria.protocol.kv_transfer import KVTransferParams
from noria.protocol.sampling import EngineSamplingParams


class EngineSample(msgspec.Struct, array_like=True, gc=False):
    """One more sample of an `EngineRequest`: its engine id, its index among the client
    request's samples (its seed is `sample_seed(params.seed, index)`; only index 0
    computes prompt logprobs) and its outputs so far (see `output_token_ids`)."""

    req_id: int
    index: int
    output_token_ids: list[int] = []


class EngineRequest(msgspec.Struct, array_like=True, gc=False, tag="req"):
    """A client request's samples that share a prompt and parameters: the first one's id,
    index and outputs inline, the others in `more_samples`. The scheduler makes each
    sample a request of its own (`samples`)."""

    req_id: int
    prompt_token_ids: list[int]
    params: EngineSamplingParams
    eos_token_ids: list[int]
    priority: int = 0
    # The samples of one client request carry the same group (the frontend's
    # choice): they share prompt blocks even with prefix caching disabled.
    sample_group: int | None = None
    # Output tokens already generated (and delivered) by an earlier scheduler: a request
    # resubmitted after a scheduler restart continues from them. The scheduler counts them
    # as outputs (max_tokens, min_tokens, penalties, the seeded noise's position), so the
    # rest is what an undisturbed run would have produced.
    output_token_ids: list[int] = []
    sample_index: int = 0  # the first sample's index (EngineSample.index)
    more_samples: list[EngineSample] = []
    # Mixed into the key of the first prompt block: requests with different salts (or a
    # salt and none) never share prefix-cache blocks (the client's `cache_salt`).
    cache_salt: str | None = None
    # Prefill/decode disaggregation (protocol/kv_transfer.py): compute the prompt for another
    # engine and keep its blocks (do_remote_decode), or pull its blocks from the producer that
    # computed it (do_remote_prefill). One sample only.
    kv_transfer_params: KVTransferParams | None = None

    def samples(self) -> list[EngineSample]:
        """Every sample this message carries, the first one included."""
        return [EngineSample(self.req_id, self.sample_index, self.output_token_ids), *self.more_samples]


class EngineAbort(msgspec.Struct, array_like=True, gc=False, tag="abort"):
    req_ids: list[int]


class EngineShutdown(msgspec.Struct, array_like=True, gc=False, tag="shutdown"):
    pass


class StatsQuery(msgspec.Struct, array_like=True, gc=False, tag="stats?"):
    """Asks the scheduler to publish its stats now (also sent periodically)."""


FrontendToScheduler = EngineRequest | EngineAbort | EngineShutdown | StatsQuery


class RequestUpdate(msgspec.Struct, array_like=True, gc=False):
    """New tokens for one request; `finish_reason` set on its last update.

    finish_reason: "stop" | "length" | "abort" | "error" (then `error` holds
    "code: message").
    """

    req_id: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None
    error_code: str | None = None
    error_message: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprob | None] | None = None  # with the first token, when asked for
    # A pooling engine's one update for a request: its pooled hidden state (little-endian
    # float32, not normalized), with finish_reason "stop" and no token.
    embedding: bytes | None = None
    # A producer's last update: where the consumer finds the prompt's blocks.
    kv_transfer_params: KVTransferParams | None = None


class EngineOutputs(msgspec.Struct, array_like=True, gc=False, tag="out"):
    updates: list[RequestUpdate]
    stats: SchedulerStats | None = None


class EngineReady(msgspec.Struct, array_like=True, gc=False, tag="ready"):
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int


class EngineDead(msgspec.Struct, array_like=True, gc=False, tag="dead"):
    """Sent by the scheduler when it cannot go on (its workers never came up at start-up);
    every request is lost. A worker lost later is not this: its requests wait for another."""

    reason: str


SchedulerToFrontend = EngineOutputs | EngineReady | EngineDead

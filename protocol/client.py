"""Client-facing messages: msgpack maps with a "type" key (language-neutral).

These are the messages that `noria.Client`, the bridge, and any zmq+msgpack
client in another language exchange with the frontend's ROUTER socket.
The websocket bridge speaks the same shapes as JSON. See docs/protocol.md.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from noria.protocol.sampling import Int64, SamplingParams


class Generate(SamplingParams, kw_only=True, tag="generate", tag_field="type"):
    """Start a request. Exactly one of prompt, messages, prompt_token_ids is given.

    All `SamplingParams` fields sit flat beside the request fields. Five of them may be left
    out to mean "the server's default" (`GENERATION_DEFAULT_FIELDS`: the checkpoint's
    generation_config.json under --generation-config auto, else vLLM's); a field that is
    present, even holding vLLM's default value, is the request's own.

    `max_tokens` left out is generation_config.json's `max_new_tokens`, else vLLM's 16; nil is
    `max_new_tokens` too, else up to the model length (as a null `max_tokens` in vLLM's OpenAI
    server). A server default never asks for more than the room the prompt leaves.
    """

    max_tokens: Int64 | None | UnsetType = UNSET
    temperature: float | UnsetType = UNSET
    top_p: float | UnsetType = UNSET
    top_k: Int64 | UnsetType = UNSET
    min_p: float | UnsetType = UNSET
    repetition_penalty: float | UnsetType = UNSET

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[Int64] | None = None
    priority: Int64 = 0
    add_generation_prompt: bool = True
    # Chat template controls for `messages` (vLLM's fields): `continue_final_message` renders
    # without a generation prompt and leaves the last (assistant) message open for the model
    # to continue (`add_generation_prompt` must then be false); `chat_template` replaces the
    # server's template for this request (a Jinja string; refused unless the server runs with
    # --trust-request-chat-template); `chat_template_kwargs` are extra template variables,
    # e.g. {"enable_thinking": false}.
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Requests with different salts (or a salt and none) never share prefix-cache blocks:
    # one tenant cannot learn from timing what another's prompts began with (vLLM's field).
    cache_salt: str | None = None
    # Prefill/decode disaggregation, as vLLM's NIXL connector spells it (protocol/kv_transfer.py):
    # {"do_remote_decode": true} to a producer; the producer's answer's params to a consumer.
    kv_transfer_params: dict[str, Any] | None = None
    # OpenAI's tool calling, with `messages` only (frontend/tools.py checks them): the tools as
    # OpenAI writes them ({"type": "function", "function": {"name", "parameters", ...}}),
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; None: "auto"
    # with tools, "none" without. The chat template gets the tools (transformers' `tools=`).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # Each sample's first delta carries the prompt as text (`Delta.prompt_text`): OpenAI's
    # `echo` of a token-id prompt needs it, and only the frontend has the tokenizer to spell it.
    return_prompt_text: bool = False

    def own_sampling(self) -> dict[str, Any]:
        """The sampling fields the request set itself (an unset one is the server's default)."""
        return {f: v for f in SamplingParams.__struct_fields__ if (v := getattr(self, f)) is not UNSET}

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The request's parameters; a field it left unset takes `defaults`' value, else vLLM's."""
        return SamplingParams(**{**(defaults or {}), **self.own_sampling()})


# The sampling knobs a `Generate` may leave to the server's defaults (`max_tokens`, with a rule
# of its own, aside).
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


MAX_CACHE_SALT_CHARS = 256


def cache_salt_problem(salt: object) -> str | None:
    """Why `salt` cannot be a request's `cache_salt`, or None if it can (None is no salt)."""
    if salt is None or (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        return None
    return f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"


class Abort(msgspec.Struct, kw_only=True, tag="abort", tag_field="type"):
    request_id: str


class Hello(msgspec.Struct, kw_only=True, tag="hello", tag_field="type"):
    """Asks the server who it is; answered by `Ready`. Also a liveness probe."""

    protocol_version: int = 1
    # The connection speaks for many clients of its own (the bridge) and caps each of them
    # itself: the server's per-connection cap would let one of them lock the others out.
    relay: bool = False


class Logprob(msgspec.Struct, kw_only=True):
    """The sampled token's log-probability and the top-n alternatives.

    The engine fills the ids and numbers; the frontend, which has the tokenizer, adds each
    token's text and exact UTF-8 bytes before a client sees it (`token`, `bytes`, and the
    same per top token). A token whose bytes are not whole UTF-8 characters on their own is
    spelled "bytes:\\xe6\\x9d" (OpenAI's spelling); `bytes` always holds the exact bytes. The
    four are UNSET inside the engine and left out of the map, so readers that predate them
    see the same messages as before.
    """

    token_id: int
    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []
    token: str | UnsetType = UNSET
    bytes: list[int] | UnsetType = UNSET
    top_tokens: list[str] | UnsetType = UNSET
    top_bytes: list[list[int]] | UnsetType = UNSET


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(msgspec.Struct, kw_only=True):
    """One complete tool call of a sample (OpenAI's shape)."""

    id: str  # "call_" + random hex
    function: FunctionCall
    type: str = "function"


class FunctionCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of tool call `index` (OpenAI's streamed shape): its first piece has `id`,
    `type` and `function.name`, the later ones pieces of `function.arguments`."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


class Delta(msgspec.Struct, kw_only=True, tag="delta", tag_field="type"):
    request_id: str
    text: str
    token_ids: list[int]
    index: int = 0
    logprobs: list[Logprob] | None = None
    # Sample 0's first delta, when the request asked for `prompt_logprobs`: one entry
    # per prompt token, the first None (nothing precedes it).
    prompt_logprobs: list[Logprob | None] | None = None
    # With `prompt_logprobs`: each prompt token's text, spelled as `Logprob.token` (the
    # first's too, which has no entry there); left out otherwise.
    prompt_tokens: list[str] | UnsetType = UNSET
    # Each sample's first delta, when the request set `return_prompt_text`: the `prompt` as
    # given, else its token ids decoded with the special tokens (vLLM's echo); left out otherwise.
    prompt_text: str | UnsetType = UNSET
    # With a tool-call parser or tool_choice required / named (`text` is then the content
    # outside the calls) and with a reasoning parser. UNSET fields are left out of the map,
    # so a reader that predates them sees the same messages as before.
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens served from the prefix cache (whole KV blocks, never the last
    # prompt token). Defaults to 0 so that either side may predate the field.
    cached_tokens: int = 0


class Done(msgspec.Struct, kw_only=True, tag="done", tag_field="type"):
    """The one final message of a successful request.

    `finish_reason` is sample 0's; `finish_reasons` lists every sample's when n > 1.
    """

    request_id: str
    finish_reason: str
    usage: Usage
    finish_reasons: list[str] | None = None
    prompt_token_ids: list[int] | None = None
    # Each sample's complete tool calls (by sample index), when any sample made one; left
    # out of the map otherwise (UNSET), as for readers that predate it.
    tool_calls: list[list[ToolCall]] | UnsetType = UNSET
    # Each sample's stop string that ended it (None: it ended otherwise), when one did; left out
    # otherwise. Anthropic's `stop_sequence` (vLLM's `stop_reason`).
    stop_strings: list[str | None] | UnsetType = UNSET
    # A producer's answer (prefill/decode disaggregation): where the prompt's blocks wait.
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET


class Error(msgspec.Struct, kw_only=True, tag="error", tag_field="type", omit_defaults=True):
    """The one final message of a failed request (or a reply to an undecodable message)."""

    request_id: str | None
    code: str
    message: str
    # The request field at fault, where one is (the bridge's OpenAI `param`); left out
    # of the message when None, so readers that predate it see the same map.
    param: str | None = None


class Ready(msgspec.Struct, kw_only=True, tag="ready", tag_field="type"):
    protocol_version: int
    model: str
    max_model_len: int
    vocab_size: int


class SchedulerStats(msgspec.Struct, kw_only=True):
    """The scheduler's gauges and counters (a map on the wire; clients read it
    through `get_stats`, the bridge turns it into Prometheus metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_kv_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    blocks_consistent: bool = True
    # The worker link (docs/protocol.md, "Workers"): is a worker group serving, and if not, why.
    workers_live: bool = True
    worker_status: str = ""
    worker_restarts: int = 0  # worker groups formed again after a loss
    requests_requeued: int = 0  # running or swapped requests sent back to wait by a worker loss
    tokens_recomputed: int = 0  # computed tokens whose KV a worker loss threw away
    seconds_without_worker: float = 0.0  # in all, since the scheduler started
    plan_bytes: int = 0  # encoded step plans sent (one copy per plan, whatever the number of ranks)
    result_bytes: int = 0  # encoded step results received from rank 0
    # Async scheduling: steps planned while the worker ran the one before, and sampled tokens
    # thrown away because their request had ended (a stop a step earlier, or an abort).
    steps_planned_ahead: int = 0
    tokens_discarded: int = 0
    # What the worker group's attention runs on ("kernels" or "torch", --attention-backend)
    # and why not the kernels for some or all layers ("" when nothing fell back); "" before a group.
    attention_backend: str = ""
    attention_reason: str = ""
    # The cache's configuration, for routers that read it (vLLM's `cache_config_info` labels).
    block_size: int = 0
    num_cpu_blocks: int = 0  # swap space in blocks (0 without --preemption-mode swap)
    kv_cache_dtype: str = ""
    enable_prefix_caching: bool = True
    # Prefill/decode disaggregation (--kv-transfer-config). A producer: transfers whose blocks
    # it holds for a consumer now, and those that ended released by the consumer or expired. A
    # consumer: pulls that brought every block and those that failed (the prompt was then
    # computed here, or the request failed), the bytes and prompt tokens pulled, and the time
    # the pulls took in all.
    kv_transfers_held: int = 0
    kv_transfers_released: int = 0
    kv_transfers_expired: int = 0
    kv_pulls_ok: int = 0
    kv_pulls_failed: int = 0
    kv_pull_bytes: int = 0
    kv_pull_tokens: int = 0
    kv_pull_seconds: float = 0.0
    # Speculative decoding (--speculative-config): drafts verified, their tokens, the draft tokens
    # accepted, and per draft position how many drafts had it accepted (vLLM's spec_decode
    # counters).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)


class GetStats(msgspec.Struct, kw_only=True, tag="get_stats", tag_field="type"):
    """Asks for the engine's latest stats; answered by `stats`."""


class Stats(msgspec.Struct, kw_only=True, tag="stats", tag_field="type"):
    stats: SchedulerStats
    num_open_requests: int = 0
    # The server's own state: "ok", "restarting" (its scheduler died and a new one is
    # starting; requests wait) or "draining" (SIGTERM: no new requests); `reason` says why.
    status: str = "ok"
    reason: str = ""
    scheduler_restarts: int = 0  # schedulers started again after one died
    # With --data-parallel-size N: each engine's own stats, in rank order (`stats` is their sum);
    # empty for one engine.
    engines: list[SchedulerStats] = []
    # This server's --data-parallel-rank (balanced from outside), else 0.
    data_parallel_rank: int = 0


class Tokenize(msgspec.Struct, kw_only=True, tag="tokenize", tag_field="type"):
    """Token ids of a text or of chat messages as the chat template renders them; answered
    by `tokenized` (or `error`). Exactly one of prompt, messages. vLLM's /tokenize fields."""

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    # None: true for a prompt (BOS as the tokenizer adds it), false for messages (the
    # template writes the special tokens it wants).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class Tokenized(msgspec.Struct, kw_only=True, tag="tokenized", tag_field="type"):
    request_id: str
    count: int
    max_model_len: int
    tokens: list[int]
    # The tokenizer's own pieces (its vocabulary entries, e.g. "Ġworld"), when asked for.
    token_strs: list[str] | None = None


class Detokenize(msgspec.Struct, kw_only=True, tag="detokenize", tag_field="type"):
    """The text of token ids (special tokens included); answered by `detokenized`."""

    request_id: str
    tokens: list[Int64]


class Detokenized(msgspec.Struct, kw_only=True, tag="detokenized", tag_field="type"):
    request_id: str
    prompt: str


class Embed(msgspec.Struct, kw_only=True, tag="embed", tag_field="type"):
    """One embedding of a text or of token ids, from a server started with `--runner pooling`;
    answered by `embedding` (or `error`). Exactly one of prompt, prompt_token_ids."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[Int64] | None = None
    # Keep the first `dimensions` components and normalize again (Matryoshka); None: all.
    dimensions: Int64 | None = None
    priority: Int64 = 0
    cache_salt: str | None = None
    # "classify": a server whose model classifies (protocol/score.py) answers the per-label
    # probabilities of `prompt`, or of the pair (prompt, text_pair) a cross-encoder scores.
    task: Literal["embed", "classify"] = "embed"
    text_pair: str | None = None


class Embedding(msgspec.Struct, kw_only=True, tag="embedding", tag_field="type"):
    """The one final message of a successful `embed`: float32 values (L2-normalized unless
    the checkpoint says otherwise) and the input's token count (`completion_tokens` 0)."""

    request_id: str
    embedding: list[float]
    usage: Usage
    # A `classify` answer: `embedding` holds one probability (or score) per label, named here;
    # left out of an embedding's map.
    labels: list[str] | UnsetType = UNSET


ClientToServer = Generate | Abort | Hello | GetStats | Tokenize | Detokenize | Embed
ServerToClient = Delta | Done | Error | Ready | Stats | Tokenized | Detokenized | Embedding

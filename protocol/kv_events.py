"""KV-cache events as vLLM publishes them (`--kv-events-config`), for prefix-aware routers.

The wire format is vLLM's (its `vllm.distributed.kv_events` module, after vLLM PR #42892),
so that its subscribers (llm-d's KV-cache indexer, vLLM's example KV-events subscriber)
read noria's stream unchanged:

* a ZMQ PUB socket sends multipart `[topic, seq, payload]`: `seq` an 8-byte big-endian
  counter from 0, `payload` one msgpack-encoded `KVEventBatch`;
* a batch is a positional array `[ts, events, data_parallel_rank]`; each event is a map
  tagged by its class name under "type" (`{"type": "BlockStored", "block_hashes": ...}`);
* an optional ROUTER replay socket answers an 8-byte big-endian start sequence with
  every buffered `[seq, payload]` from there, then `[-1 (8 bytes, signed), b""]`.

Block hashes are ints, as current vLLM publishes them by default
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`): the low 64 bits of the block's key, read
big-endian. noria's keys are its own sha256 chain (scheduler/kv_cache_manager.py, with the
request's `cache_salt` in the first block's), so they match nothing vLLM computes; a router
only needs them to be consistent within one engine's stream, and to chain by parent.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from noria.protocol.validation import json_flag

# The medium vLLM names for the engine's own KV cache, on every device (its CPU backend too);
# a consumer reads it as the tier, and "CPU" means an offloaded copy, which noria has none of:
# swapped requests' CPU blocks are never served from the prefix cache.
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame, with an empty payload


def external_hash(key: bytes) -> int:
    """A block key as published: its last 8 bytes, a big-endian unsigned int (vLLM's conversion)."""
    return int.from_bytes(key[-8:], "big")


class KVEventsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's KVEventsConfig, key for key and with its defaults."""

    enable_kv_cache_events: bool = False
    # None: "zmq" when events are enabled, else "null" (vLLM resolves it the same way).
    publisher: Literal["null", "zmq"] | None = None
    endpoint: Annotated[str, Meta(min_length=1)] = "tcp://*:5557"  # bound if it has * / :: / ipc / inproc, else connected
    replay_endpoint: Annotated[str, Meta(min_length=1)] | None = None  # always bound
    buffer_steps: Annotated[int, Meta(ge=1)] = 10_000  # batches kept for replay
    hwm: Annotated[int, Meta(ge=0)] = 100_000  # PUB send high-water mark: past it batches are dropped
    max_queue_size: Annotated[int, Meta(ge=1)] = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


_FIELDS = msgspec.structs.fields(KVEventsConfig)


def parse_kv_events_config(text: str) -> dict[str, Any]:
    """`--kv-events-config JSON`, checked; ValueError says in one sentence what is wrong."""
    value = json_flag(text, "--kv-events-config", "vLLM's KVEventsConfig keys")
    known = [f.name for f in _FIELDS]
    for key in value:
        if key not in known:
            raise ValueError(f"--kv-events-config has no key {key!r}; it takes {', '.join(known)}")
    for f in _FIELDS:
        if f.name in value:
            try:
                msgspec.convert(value[f.name], f.type)
            except msgspec.ValidationError as e:
                why = 'must be "zmq" or "null"' if f.name == "publisher" else str(e)
                raise ValueError(f"--kv-events-config {f.name}: {why} (got {value[f.name]!r})") from None
    return value


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to the set of cached blocks; encoded as a map tagged "type": <class name>."""


class BlockStored(KVCacheEvent):
    """Full blocks that became cached, in chain order: `token_ids` holds `block_size` ids per hash."""

    block_hashes: list[int]
    parent_block_hash: int | None  # the block before the first one; None: the first is a sequence's first
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one scheduler step, in order."""

    ts: float  # time.time() when the step was planned
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None

"""Prefill/decode disaggregation: `--kv-transfer-config` and the messages that move KV blocks.

The request flow is vLLM's NIXL connector's, so that vllm-router's `--vllm-pd-disaggregation`
drives noria unchanged:

1. the router sends the request to a producer engine with `kv_transfer_params`
   `{"do_remote_decode": true}` (and `max_tokens` 1); the producer computes the prompt, keeps
   its blocks (until the consumer says it has them, or `abort_request_timeout` passes) and
   answers with `kv_transfer_params`: `do_remote_prefill`, `remote_engine_id`,
   `remote_block_ids`, `remote_host`/`remote_port` (its side channel), `tp_size`, and noria's
   own keys (`remote_transfer_id`, `remote_endpoints`, `remote_block_size`);
2. the router sends the original request, with those params, to a consumer engine; its
   scheduler finds what its own prefix cache holds, gives the rest blocks, and each worker
   rank pulls its shard of the missing blocks from the producer's rank of the same index
   (`KVRead` -> `KVBlocks`) straight into its cache; the scheduler then tells the producer's
   side channel (`KVRelease`) and computes only the last prompt token, whose logits it needs.

A pull that fails (the producer gone, the blocks expired, a layout that differs) falls back to
computing the prompt locally (`kv_load_failure_policy` "recompute", the default) or fails the
request ("fail"); it never yields an answer from blocks it did not get whole.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from noria.protocol.validation import json_flag

CONNECTOR = "NoriaConnector"
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


class TransferOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`kv_connector_extra_config`: noria's own knobs."""

    # A producer frees the blocks of a transfer no consumer released after this long (vLLM's
    # VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
    abort_request_timeout: Annotated[float, Meta(gt=0)] = 480.0
    # A consumer gives a pull up after this long without the producer's answer.
    transfer_timeout: Annotated[float, Meta(gt=0)] = 30.0
    # Largest piece of one pull (bytes): the rest comes in more messages.
    chunk_bytes: Annotated[int, Meta(ge=1 << 16)] = 64 << 20
    # The hosts a consumer pulls from and releases to, as `remote_host` and `remote_endpoints`
    # name them (the params come in requests: without a list, a client may name any host);
    # params naming another host are ignored and the prompt is computed here. None: any host.
    producers: list[str] | None = None


class KVTransferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's KVTransferConfig keys; noria reads the connector, the role, where the producer's
    side channel listens (`kv_ip`, `kv_port`) and the failure policy."""

    kv_connector: str = CONNECTOR
    kv_role: KVRole = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: Annotated[int, Meta(ge=1, le=65535)] = 14579
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    kv_connector_extra_config: TransferOptions = msgspec.field(default_factory=TransferOptions)
    # vLLM's keys that mean nothing to this connector, accepted so a vLLM command line works.
    engine_id: str | None = None
    kv_buffer_device: str | None = None
    kv_buffer_size: float | None = None
    kv_rank: int | None = None
    kv_parallel_size: int | None = None
    kv_connector_module_path: str | None = None

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


_FIELDS = [f.name for f in msgspec.structs.fields(KVTransferConfig)]


def parse_kv_transfer_config(text: str) -> dict[str, Any]:
    """`--kv-transfer-config JSON`, checked; ValueError says in one sentence what is wrong."""
    value = json_flag(text, "--kv-transfer-config", "vLLM's KVTransferConfig keys")
    for key in value:
        if key not in _FIELDS:
            raise ValueError(f"--kv-transfer-config has no key {key!r}; it takes {', '.join(_FIELDS)}")
    if value.get("kv_connector", CONNECTOR) != CONNECTOR:
        raise ValueError(f"--kv-transfer-config kv_connector {value['kv_connector']!r}: noria moves KV blocks "
                         f"with its own connector, {CONNECTOR!r}")
    try:
        msgspec.convert(value, KVTransferConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"--kv-transfer-config: {e}") from None
    return value


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`kv_transfer_params` of a request or an answer, as vLLM's NIXL connector spells them."""

    do_remote_decode: bool = False  # to a producer: compute the prompt and keep its blocks
    do_remote_prefill: bool = False  # to a consumer: the prompt's blocks wait at the producer
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None  # the producer's side channel (KVRelease)
    remote_port: int | None = None
    tp_size: int = 1
    # noria's: what a pull names (`KVRead.transfer_id`), where each worker rank of the producer
    # serves its shard, and its block size (a consumer with another cannot use the blocks).
    remote_transfer_id: int | None = None
    remote_endpoints: list[str] | None = None
    remote_block_size: int | None = None


def read_params(raw: object) -> KVTransferParams | None:
    """A request's `kv_transfer_params` (a JSON object, unknown keys ignored as vLLM does);
    ValueError says what is wrong. None or an object asking for nothing: None."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("kv_transfer_params must be an object")
    try:
        params = msgspec.convert(raw, KVTransferParams)
    except msgspec.ValidationError as e:
        raise ValueError(f"kv_transfer_params: {e}") from None
    if params.do_remote_prefill and params.do_remote_decode:
        raise ValueError("kv_transfer_params cannot ask for both do_remote_prefill and do_remote_decode")
    return params if params.do_remote_prefill or params.do_remote_decode else None


def as_json(params: KVTransferParams) -> dict[str, Any]:
    """The answer's `kv_transfer_params`, every key vLLM's router passes on present."""
    return {name: getattr(params, name) for name in _PARAM_FIELDS}


_PARAM_FIELDS = [f.name for f in msgspec.structs.fields(KVTransferParams)]


def pullable(params: KVTransferParams, producers: list[str] | None = None) -> str | None:
    """Why a consumer cannot pull what `params` name (from `producers` only, if given), or None
    when it can try."""
    if not params.remote_endpoints or params.remote_transfer_id is None or params.remote_block_ids is None:
        return "the params name no noria producer (remote_endpoints, remote_transfer_id, remote_block_ids)"
    bad = [e for e in params.remote_endpoints if not _ENDPOINT.fullmatch(e)]
    if bad:
        return f"remote_endpoints must be tcp://HOST:PORT, not {bad[0]!r}"
    if producers is not None:
        hosts = {e[len("tcp://"):].rsplit(":", 1)[0].strip("[]") for e in params.remote_endpoints}
        hosts.add(params.remote_host or "")
        strangers = sorted(h for h in hosts if h not in producers)
        if strangers:
            return f"{strangers[0]!r} is not among kv_connector_extra_config's producers"
    return None


# A producer rank's block server: the only kind of address a consumer connects to on a client's word.
_ENDPOINT = re.compile(r"tcp://[A-Za-z0-9.\-]+:[0-9]{1,5}|tcp://\[[0-9A-Fa-f:.]+\]:[0-9]{1,5}")


# ---- the side channel (consumer scheduler -> producer scheduler) ----------------------------

class KVRelease(msgspec.Struct, array_like=True, tag="kv-release"):
    """The consumer is done with these transfers (pulled, failed or no longer wanted): the
    producer frees their blocks now rather than at the timeout."""

    transfer_ids: list[int]


# ---- the data link (consumer worker rank -> producer worker rank of the same index) -----------

class KVRead(msgspec.Struct, array_like=True, tag="kv-read"):
    """Send these blocks of a held transfer (a subset, in this order). `seq` comes back in the
    answer, so an answer to a read given up on is never taken for a later one's."""

    seq: int
    transfer_id: int
    block_ids: list[int]


class KVLayout(msgspec.Struct, array_like=True, frozen=True):
    """What one rank's block holds: a consumer takes blocks only of its own layout."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str


class KVBlocks(msgspec.Struct, array_like=True, tag="kv-blocks"):
    """The answer to a `KVRead`: the blocks' bytes follow in a second frame, laid out
    [num_layers, 2 (K, V), len(block_ids), block_size, num_kv_heads, head_dim]; `error` set
    (and no data) when the transfer is not held or names other blocks."""

    seq: int
    layout: KVLayout | None
    error: str | None = None


KVDataMessage = KVRead | KVBlocks

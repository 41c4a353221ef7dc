"""Error codes carried by `error` messages; documented in docs/protocol.md."""

from __future__ import annotations


class ErrorCode:
    INVALID_MESSAGE = "invalid_message"  # not decodable, unknown type, wrong field types
    INVALID_REQUEST = "invalid_request"  # decodable but semantically wrong (empty prompt, bad values)
    INVALID_GRAMMAR = "invalid_grammar"  # a structured_output schema, regex or grammar that does not compile
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt (+ max_tokens) exceeds max_model_len
    DUPLICATE_REQUEST = "duplicate_request"  # request_id already in flight on this connection
    OVERLOADED = "overloaded"  # the waiting queue or this connection's in-flight requests are at their cap
    ENGINE_DEAD = "engine_dead"  # the scheduler died
    ENGINE_UNAVAILABLE = "engine_unavailable"  # no worker for --worker-wait seconds; the server keeps running
    SHUTTING_DOWN = "shutting_down"  # the server is draining (SIGTERM): no new requests; at the drain timeout, the rest
    TIMEOUT = "timeout"  # client-side: no answer in time
    ENGINE_UNREACHABLE = "engine_unreachable"  # client-side: connection lost or server silent
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # a pull of a prompt's KV failed under kv_load_failure_policy "fail"
    INTERNAL = "internal_error"


class NoriaError(Exception):
    """An error with one of the `ErrorCode` codes; `param` names the offending field, if one is."""

    def __init__(self, code: str, message: str, *, param: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.param = param


class ParamError(NoriaError, ValueError):
    """A value that is out of range or of the wrong type, named by its field: the bridge
    reports `param` as OpenAI's `param`, and Python callers can catch it as a ValueError."""

    def __init__(self, param: str | None, message: str, code: str = ErrorCode.INVALID_REQUEST) -> None:
        super().__init__(code, message, param=param)

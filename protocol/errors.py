"""Error codes carried by `error` messages; documented in docs/protocol.md."""

from __future__ import annotations


class ErrorCode:
    INVALID_MESSAGE = "invalid_message"  # not decodable, unknown type, wrong field types
    INVALID_REQUEST = "invalid_request"  # decodable but semantically wrong (empty prompt, bad values)
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt (+ max_tokens) exceeds max_model_len
    DUPLICATE_REQUEST = "duplicate_request"  # request_id already in flight on this connection
    ENGINE_DEAD = "engine_dead"  # the scheduler or a worker died
    TIMEOUT = "timeout"  # client-side: no answer in time
    ENGINE_UNREACHABLE = "engine_unreachable"  # client-side: connection lost or server silent
    INTERNAL = "internal_error"


class NoriaError(Exception):
    """An error with one of the `ErrorCode` codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

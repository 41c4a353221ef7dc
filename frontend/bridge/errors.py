"""Errors in OpenAI's shape, with the HTTP status that each noria error code deserves."""

from __future__ import annotations

import msgspec
from aiohttp import web

from noria.frontend.bridge.openai_schema import ErrorBody, ErrorResponse
from noria.frontend.client import ENGINE_UNREACHABLE
from noria.protocol.errors import ErrorCode, NoriaError

# (HTTP status, OpenAI error type) per noria code.
_BY_CODE: dict[str, tuple[int, str]] = {
    ErrorCode.INVALID_MESSAGE: (400, "invalid_request_error"),
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.INVALID_GRAMMAR: (400, "invalid_request_error"),
    ErrorCode.PROMPT_TOO_LONG: (400, "invalid_request_error"),
    ErrorCode.DUPLICATE_REQUEST: (409, "invalid_request_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.ENGINE_DEAD: (503, "service_unavailable_error"),
    ErrorCode.ENGINE_UNAVAILABLE: (503, "service_unavailable_error"),
    ENGINE_UNREACHABLE: (503, "service_unavailable_error"),
    ErrorCode.TIMEOUT: (503, "service_unavailable_error"),
    ErrorCode.SHUTTING_DOWN: (503, "service_unavailable_error"),
}
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> bytes:
    kind = _TYPE_BY_STATUS.get(status, "server_error")
    return msgspec.json.encode(ErrorResponse(error=ErrorBody(message=message, type=kind, param=param, code=code)))


# Seconds an overloaded client is asked to wait (HTTP 429's Retry-After).
RETRY_AFTER = 1


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER)} if status == 429 else None
    return web.Response(status=status, body=error_body(status, message, code, param), content_type="application/json",
                        headers=headers)


def status_of(code: str) -> int:
    return _BY_CODE.get(code, (500, "server_error"))[0]


def from_noria(e: NoriaError) -> web.Response:
    return error_response(status_of(e.code), e.message, e.code, e.param)


# What decoding untrusted JSON raises besides msgspec's own errors: RecursionError for
# nesting deeper than msgspec follows, UnicodeDecodeError (a ValueError) for bytes that
# are not UTF-8.
UNDECODABLE = (msgspec.DecodeError, RecursionError, ValueError)


def undecodable_message(e: BaseException) -> str:
    """One line saying why a message is not JSON the bridge can read."""
    if isinstance(e, RecursionError):
        return "invalid JSON: nested too deeply"
    if isinstance(e, UnicodeDecodeError):
        return f"invalid JSON: not UTF-8 ({e.reason})"
    return f"invalid JSON: {e}"[:500]


def from_decode(e: Exception) -> web.Response:
    """A body that is not JSON (a body that does not fit its type is a BadRequest with its param)."""
    if isinstance(e, msgspec.ValidationError):
        return error_response(400, f"invalid request body: {e}", ErrorCode.INVALID_MESSAGE)
    return error_response(400, f"invalid request body: {undecodable_message(e)}", ErrorCode.INVALID_MESSAGE)


def internal_error(e: BaseException) -> web.Response:
    """The answer to a bug: 500 in OpenAI's shape, saying what failed (the traceback is logged)."""
    return error_response(500, f"internal error: {type(e).__name__}: {e}"[:500], ErrorCode.INTERNAL)


class BadRequest(Exception):
    """A request the bridge rejects before it goes upstream (400 unless told otherwise)."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str = ErrorCode.INVALID_REQUEST) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.code, self.param)

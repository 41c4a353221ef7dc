"""Checking values against msgspec types, with failures named by their field.

msgspec's own errors are text ("... - at `$.top_p`"); callers that must report
which field was wrong (OpenAI's `param`, a CLI flag) get a `ParamError` instead,
found by converting one field at a time against the Struct's own field types.
"""

from __future__ import annotations

import functools
import json
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from noria.protocol.errors import ErrorCode, ParamError

S = TypeVar("S", bound=msgspec.Struct)


@functools.cache
def _fields(cls: type[msgspec.Struct]) -> tuple[msgspec.structs.FieldInfo, ...]:
    return msgspec.structs.fields(cls)


def _problem(name: str, value: Any, type_: Any, e: msgspec.ValidationError) -> str:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    if typing.get_origin(type_) is typing.Literal:
        choices = ", ".join(str(c) for c in typing.get_args(type_))
        return f"{name} must be one of {choices}, got {shown}"
    return f"invalid {name}: {e} (got {shown})"


def check_value(name: str, value: Any, type_: Any, code: str = ErrorCode.INVALID_REQUEST) -> None:
    """Raise a ParamError naming `name` unless msgspec accepts `value` as `type_`."""
    try:
        msgspec.convert(value, type_)
    except msgspec.ValidationError as e:
        raise ParamError(name, _problem(name, value, type_, e), code) from None


@functools.cache
def _checked_twin(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """A Struct with `cls`'s fields, each of its narrower type in `cls.CHECKED` where one is given."""
    checked = getattr(cls, "CHECKED", {})
    return msgspec.defstruct(f"Checked{cls.__name__}", [(f.name, checked.get(f.name, f.type)) for f in _fields(cls)])


def check_fields(obj: msgspec.Struct) -> None:
    """Check every field of a Struct built in Python (its constructor checks nothing)
    against its declared type, or the narrower one its class lists in `CHECKED`."""
    try:  # one conversion when all is well (the common case: about 1 us)
        msgspec.convert(msgspec.structs.asdict(obj), _checked_twin(type(obj)))
        return
    except msgspec.ValidationError as e:
        first = e
    checked = getattr(type(obj), "CHECKED", {})
    for f in _fields(type(obj)):
        check_value(f.encode_name, getattr(obj, f.name), checked.get(f.name, f.type))
    raise ParamError(None, str(first))  # unreachable unless the fields pass one by one


def field_error(cls: type[msgspec.Struct], raw: object, code: str = ErrorCode.INVALID_MESSAGE) -> ParamError | None:
    """The first field of the decoded map `raw` that does not fit `cls` (a missing required
    field included), or None when each field fits on its own."""
    if not isinstance(raw, Mapping):
        return None
    for f in _fields(cls):
        if f.encode_name not in raw:
            if f.required:
                return ParamError(f.encode_name, f"{f.encode_name} is required", code)
            continue
        try:
            check_value(f.encode_name, raw[f.encode_name], f.type, code)
        except ParamError as e:
            return e
    return None


def convert(raw: Mapping[str, Any], cls: type[S], code: str = ErrorCode.INVALID_REQUEST) -> S:
    """`msgspec.convert(raw, cls)`, with a failure raised as a ParamError naming the field."""
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as e:
        raise field_error(cls, raw, code) or ParamError(None, str(e), code) from None


def json_flag(value: object, flag: str, what: str) -> dict[str, Any]:
    """A flag's JSON object (text from the command line, or the dict a Python caller passed);
    ValueError says in one sentence what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{flag} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object of {what}")
    return value

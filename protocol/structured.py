"""Structured output (guided decoding): what a request's text must match.

`StructuredOutput` rides inside `SamplingParams` (and so in the ZMQ `generate` map
and every engine request); the scheduler compiles it with llguidance
(scheduler/structured_output.py). Only msgspec and the standard library here.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from noria.protocol.errors import ParamError

MAX_SPEC_CHARS = 1 << 20  # a schema or grammar larger than this is refused, not compiled
MAX_SPEC_DEPTH = 256  # objects and arrays inside one another in a JSON schema
KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Exactly one of: `json` (a JSON schema, as a map or as JSON text), `regex`,
    `choice` (the output is one of these strings), `grammar` (a Lark grammar, as
    llguidance reads it; a GBNF grammar with `::=` rules is converted), `json_object`
    (any JSON object)."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False


def check_structured(so: StructuredOutput, field: str = "structured_output") -> None:
    """Raise a ParamError (naming `field`) unless exactly one well-formed constraint is given.
    Whether the schema, regex or grammar compiles is only known when it is compiled."""
    given = [k for k in KINDS if getattr(so, k) not in (None, False)]
    if len(given) != 1:
        raise ParamError(field, f"{field} needs exactly one of {', '.join(KINDS)}; got {given or 'none'}")
    if so.choice is not None and (not so.choice or any(not c for c in so.choice)):
        raise ParamError(field, f"{field}.choice must be a non-empty list of non-empty strings")
    if isinstance(so.json, str):
        try:
            schema = json.loads(so.json)
        except (ValueError, RecursionError) as e:
            raise ParamError(field, f"{field}.json is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ParamError(field, f"{field}.json must be a JSON schema (an object), got {type(schema).__name__}")
    else:
        schema = so.json
    # msgpack carries what JSON cannot (bytes, integer keys, NaN); the scheduler writes the
    # schema as JSON text, so such a schema is refused here, for this request alone.
    problem = json_problem(schema)
    if problem is not None:
        raise ParamError(field, f"{field}.json is not a JSON schema: {problem}")
    if len(spec_text(so)) > MAX_SPEC_CHARS:
        raise ParamError(field, f"{field} is larger than {MAX_SPEC_CHARS} characters")


def json_problem(value: Any, max_depth: int = MAX_SPEC_DEPTH) -> str | None:
    """Why `value` is not plain JSON data (objects with string keys, arrays, strings, finite
    numbers, true, false, null), or None. A loop, not recursion: it may nest deeply."""
    todo: list[tuple[Any, int]] = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, dict):
            if depth >= max_depth:
                return f"it nests more than {max_depth} objects and arrays deep"
            for k, x in v.items():
                if not isinstance(k, str):
                    return f"an object key is a {type(k).__name__}, not a string"
                todo.append((x, depth + 1))
        elif isinstance(v, list):
            if depth >= max_depth:
                return f"it nests more than {max_depth} objects and arrays deep"
            todo.extend((x, depth + 1) for x in v)
        elif isinstance(v, float):
            if v != v or v in (float("inf"), float("-inf")):
                return f"{v} is not a JSON number"
        elif v is not None and not isinstance(v, str | int):  # bool is an int
            return f"a {type(v).__name__} value is not JSON"
    return None


def spec_text(so: StructuredOutput) -> str:
    """The constraint as one canonical string: equal constraints share a compiled grammar."""
    if so.json is not None:
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        return "json:" + json.dumps(schema, sort_keys=True, separators=(",", ":"))
    if so.regex is not None:
        return "regex:" + so.regex
    if so.choice is not None:
        return "choice:" + json.dumps(so.choice)
    if so.grammar is not None:
        return "grammar:" + so.grammar
    return "json_object:"

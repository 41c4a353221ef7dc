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
        except ValueError as e:
            raise ParamError(field, f"{field}.json is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ParamError(field, f"{field}.json must be a JSON schema (an object), got {type(schema).__name__}")
    if len(spec_text(so)) > MAX_SPEC_CHARS:
        raise ParamError(field, f"{field} is larger than {MAX_SPEC_CHARS} characters")


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

"""OpenAI's `response_format` and vLLM's `guided_*` fields → one `StructuredOutput`.

Accepted on /v1/completions and /v1/chat/completions: `response_format`
`{"type": "json_object"}` and `{"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}` (`{"type": "text"}` means no constraint); vLLM's
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and
`structured_outputs`. At most one of them; a malformed one is a 400 naming it.
A schema or grammar that does not compile is refused by the engine
(`invalid_grammar`, also a 400).
"""

from __future__ import annotations

from typing import Any

import msgspec

from noria.frontend.bridge.openai_refused import RefusedFields
from noria.protocol.errors import ParamError
from noria.protocol.structured import StructuredOutput, check_structured


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None  # noria always enforces the schema


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredFields(RefusedFields, kw_only=True):
    """The request fields that constrain the output (a base of both endpoints' requests)."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutput | None = None


def structured_output(req: StructuredFields) -> StructuredOutput | None:
    """The request's one constraint, checked; None without one. Raises a ParamError naming
    the request field (the bridge answers 400 with it as `param`)."""
    given: list[tuple[str, StructuredOutput]] = []
    if req.response_format is not None:
        fmt = _response_format(req.response_format)
        if fmt is not None:
            given.append(("response_format", fmt))
    if req.guided_json is not None:
        given.append(("guided_json", StructuredOutput(json=req.guided_json)))
    if req.guided_regex is not None:
        given.append(("guided_regex", StructuredOutput(regex=req.guided_regex)))
    if req.guided_choice is not None:
        given.append(("guided_choice", StructuredOutput(choice=req.guided_choice)))
    if req.guided_grammar is not None:
        given.append(("guided_grammar", StructuredOutput(grammar=req.guided_grammar)))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs))
    if not given:
        return None
    if len(given) > 1:
        names = [name for name, _ in given]
        raise ParamError(names[1], f"only one output constraint may be given, got {', '.join(names)}")
    field, so = given[0]
    check_structured(so, field)
    return so


def _response_format(rf: ResponseFormat) -> StructuredOutput | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput(json_object=True)
    if rf.type == "json_schema":
        if rf.json_schema is None:
            raise ParamError("response_format", "response_format of type json_schema needs a json_schema object")
        if rf.json_schema.schema is None:  # OpenAI's schema is optional: any JSON object then
            return StructuredOutput(json_object=True)
        return StructuredOutput(json=rf.json_schema.schema)
    raise ParamError("response_format",
                     f"response_format.type must be text, json_object or json_schema, got {rf.type!r}")

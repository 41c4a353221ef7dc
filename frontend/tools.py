"""OpenAI tool calling on a `generate` with `messages`: checking `tools` and `tool_choice`,
the JSON schema that tool_choice "required" or a named function runs under, and the
history's assistant `tool_calls` made ready for a chat template.

A bad request is a ParamError naming the field (the bridge's 400 `param`), as vLLM
refuses it: a tool without a name, parameters that are not a JSON schema object, a named
tool_choice that is not among the tools, "auto" on a server without
--enable-auto-tool-choice and --tool-call-parser, a tool_choice other than "none" without
tools.
"""

from __future__ import annotations

import json
from typing import Any

from noria.protocol.errors import ParamError

CHOICES = ("none", "auto", "required")


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    """Check `tools` (OpenAI's `[{"type": "function", "function": {"name", "description",
    "parameters"}}]`) and return their names."""
    names: list[str] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ParamError("tools", f"tools[{i}] must be an object")
        if tool.get("type", "function") != "function":
            raise ParamError("tools", f"tools[{i}].type must be \"function\", got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ParamError("tools", f"tools[{i}].function must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ParamError("tools", f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ParamError("tools", f"tools[{i}].function.parameters must be a JSON schema object, "
                                      f"got {type(params).__name__}")
        if isinstance(params, dict) and "type" in params and params["type"] != "object":
            raise ParamError("tools", f"tools[{i}].function.parameters must describe an object "
                                      f"(type \"object\"), got type {params['type']!r}")
        names.append(name)
    if len(set(names)) != len(names):
        raise ParamError("tools", "tool names must be unique")
    return names


def resolve_choice(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None,
                   auto_enabled: bool) -> str | None:
    """"none", "auto", "required" or the named function's name (None with no tools in play);
    raises a ParamError for a request vLLM refuses."""
    names = tool_names(tools) if tools else []
    implied = choice is None  # then "auto" comes from the tools themselves: they are to blame
    if choice is None:
        choice = "auto" if names else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ParamError("tool_choice", f"tool_choice must be one of {', '.join(CHOICES)} or "
                             f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")
        if choice == "none":
            return None
        if not names:
            raise ParamError("tool_choice", f"tool_choice {choice!r} needs tools")
        if choice == "auto" and not auto_enabled:
            raise ParamError("tools" if implied else "tool_choice", "\"auto\" tool choice (the default with "
                             "tools) requires --enable-auto-tool-choice and "
                                            "--tool-call-parser to be set")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not isinstance(name, str):
        raise ParamError("tool_choice", "a named tool_choice is {\"type\": \"function\", \"function\": "
                                        "{\"name\": ...}}")
    if not names:
        raise ParamError("tool_choice", "tool_choice names a function but no tools are given")
    if name not in names:
        raise ParamError("tool_choice", f"tool_choice names {name!r}, which is not among the tools "
                                        f"({', '.join(names)})")
    return "function:" + name


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    # No parameters: the function takes none, so its arguments are `{}`.
    params = tool["function"].get("parameters")
    return params if params is not None else {"type": "object", "properties": {}, "additionalProperties": False}


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The named function's arguments object: its parameters schema."""
    return next(_parameters(t) for t in tools if t["function"]["name"] == name)


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A non-empty array of calls, each `{"name": one of the tools, "arguments": that
    tool's parameters}`; one call only when `parallel` is false. Each tool's `$defs` move
    to the root under a name of their own, its `$ref`s with them; a tool whose refs point
    into its own parameters (`#`, a recursive schema) has them under the root's `$defs` too,
    so that its `#` still means its parameters, not the array of calls. One pass over each
    tool's schema: the work grows with the tools' size, whatever their number."""
    defs: dict[str, Any] = {}
    options = []
    for i, tool in enumerate(tools):
        own = f"#/$defs/tool{i}"
        root_refs = [False]
        params = _rename_refs(_parameters(tool), f"tool{i}_", own, root_refs)
        for key in ("$defs", "definitions"):
            for name, schema in (params.pop(key, None) or {}).items():
                defs[f"tool{i}_{name}"] = schema
        if root_refs[0]:
            defs[f"tool{i}"] = params
            params = {"$ref": own}
        options.append({"type": "object",
                        "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                       "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _rename_refs(value: Any, prefix: str, own: str, root_refs: list[bool]) -> Any:
    """A copy of `value` whose local `$ref`s point where `required_schema` moves their
    targets: `#/$defs/x` (or `#/definitions/x`) to `#/$defs/{prefix}x`, any other pointer
    into the parameters (`#`, `#/properties/...`) under `own`; `root_refs[0]` is set when
    there was one of those."""
    if isinstance(value, dict):
        out = {k: _rename_refs(v, prefix, own, root_refs) for k, v in value.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            for moved in ("#/$defs/", "#/definitions/"):
                if ref.startswith(moved):
                    out["$ref"] = f"#/$defs/{prefix}{ref[len(moved):]}"
                    break
            else:
                out["$ref"] = own + ref[1:]
                root_refs[0] = True
        return out
    if isinstance(value, list):
        return [_rename_refs(v, prefix, own, root_refs) for v in value]
    return value


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them (as vLLM hands them over): an assistant's
    `tool_calls` arguments as objects rather than JSON text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list) and calls:
            m = dict(m)
            m["tool_calls"] = [_parsed_call(c) for c in calls]
        out.append(m)
    return out


def _parsed_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except (ValueError, RecursionError):  # not JSON, or nested past what the decoder follows
        return call
    return {**call, "function": {**fn, "arguments": args}}

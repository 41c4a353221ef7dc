"""The JSON schema that tool_choice "required" constrains a chat's output to
(frontend/tools.py `required_schema`): every tool keeps its own meaning inside the array of
calls, `$ref`s included, judged by jsonschema on the tool's parameters alone; llguidance
compiles it; and building it costs work in proportion to the tools' size, never their
number squared (it runs on the frontend's helper thread, which every large request shares)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

from noria.frontend import tools as tooling

TREE = {"type": "object", "properties": {"label": {"type": "string"},
                                         "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["label"], "additionalProperties": False}
DEFS = {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
        "type": "object", "properties": {"at": {"$ref": "#/$defs/point"}}, "required": ["at"]}
DRAFT7 = {"definitions": {"unit": {"enum": ["c", "f"]}},
          "type": "object", "properties": {"unit": {"$ref": "#/definitions/unit"}}, "required": ["unit"]}
POINTER = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
           "required": ["a", "b"]}
# Same def name as DEFS, another meaning: the two must not meet at the root.
CLASH = {"$defs": {"point": {"type": "string"}}, "type": "object", "properties": {"at": {"$ref": "#/$defs/point"}},
         "required": ["at"]}
SCHEMAS = {"tree": TREE, "defs": DEFS, "draft7": DRAFT7, "pointer": POINTER, "clash": CLASH}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]

INSTANCES = [
    ("tree", {"label": "a", "children": [{"label": "b", "children": [{"label": "c"}]}]}),
    ("tree", {"label": "a", "children": [{"children": []}]}),  # a child without its label
    ("tree", {"label": "a", "children": [[{"name": "tree", "arguments": {"label": "x"}}]]}),  # a call list as child
    ("defs", {"at": {"x": 1}}),
    ("defs", {"at": "here"}),
    ("draft7", {"unit": "c"}),
    ("draft7", {"unit": "k"}),
    ("pointer", {"a": 1, "b": 2}),
    ("pointer", {"a": 1, "b": "2"}),
    ("clash", {"at": "here"}),
    ("clash", {"at": {"x": 1}}),
]


def _valid(instance, schema) -> bool:
    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError:
        return False
    return True


@pytest.mark.parametrize("name,arguments", INSTANCES)
def test_required_schema_keeps_each_tools_meaning(name, arguments):
    combined = tooling.required_schema(TOOLS, parallel=True)
    want = _valid(arguments, SCHEMAS[name])
    assert _valid([{"name": name, "arguments": arguments}], combined) == want
    # One call's arguments judged by another tool's schema would be a wrong answer too.
    for other, schema in SCHEMAS.items():
        if other != name:
            assert _valid([{"name": other, "arguments": arguments}], combined) == _valid(arguments, schema)
    assert TOOLS[0]["function"]["parameters"] == TREE  # the request's own tools are left as they came


def test_required_schema_compiles(demo_path: Path):
    import llguidance as llg

    tok = llg.LLTokenizer((demo_path / "tokenizer.json").read_text(), eos_token=[2])
    for parallel in (True, False):
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(tooling.required_schema(TOOLS, parallel)))
        matcher = llg.LLMatcher(tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()


def _lines_run(n: int) -> int:
    """Lines of frontend/tools.py executed to build the schema of `n` tools that each have
    `$defs`: a count of work that does not depend on the machine's speed."""
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": DEFS}} for i in range(n)]
    path = tooling.__file__
    count = 0

    def trace(frame, event, _arg):
        nonlocal count
        if frame.f_code.co_filename != path:
            return None
        if event == "line":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        tooling.required_schema(many, parallel=True)
    finally:
        sys.settrace(None)
    return count


def test_required_schema_work_grows_with_the_tools_not_their_square():
    small, large = _lines_run(40), _lines_run(160)
    assert small > 0
    # Four times the tools: four times the work, give or take the fixed part; a pass over
    # every earlier tool's definitions per tool makes it about sixteen.
    assert large < 5 * small, (small, large)


def test_tools_are_counted_and_sized_before_they_are_read(demo_tokenizer, monkeypatch):
    """`--max-tools` and the prompt-size limit refuse a request before its tools are checked
    or turned into a grammar (work that grows faster with them than the size check does),
    naming `tools` when they are at fault; /tokenize's tools are held to the same count."""
    from noria.frontend.chat_output import ChatConfig
    from noria.frontend.prepare import prepare
    from noria.frontend.processor import InputLimits, InputProcessor
    from noria.protocol.client import Generate, Tokenize
    from noria.protocol.errors import ErrorCode, NoriaError, ParamError

    built = []
    original = tooling.required_schema
    monkeypatch.setattr(tooling, "required_schema", lambda *a: built.append(a) or original(*a))
    proc = InputProcessor(demo_tokenizer, [2], 700, 2048, InputLimits(max_prompt_chars=3000, max_tools=3))
    small = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(4)]
    messages = [{"role": "user", "content": "hi"}]

    def refusal(tools, content="hi", choice="required"):
        msg = Generate(request_id="r", messages=[{"role": "user", "content": content}], tools=tools,
                       tool_choice=choice)
        try:
            prepare(msg, proc, None, ChatConfig())
        except NoriaError as e:
            return e
        return None

    e = refusal(small)
    assert isinstance(e, ParamError) and e.param == "tools" and "--max-tools" in e.message
    # One named choice that is not among them: the count is what the answer names.
    e = refusal(small, choice={"type": "function", "function": {"name": "missing"}})
    assert isinstance(e, ParamError) and e.param == "tools"
    wordy = [{"type": "function", "function": {"name": "f", "description": "d" * 4000}}]
    e = refusal(wordy)
    assert isinstance(e, ParamError) and e.param == "tools" and e.code == ErrorCode.PROMPT_TOO_LONG
    e = refusal(small[:1], content="x" * 4000)
    assert isinstance(e, ParamError) and e.param == "messages" and e.code == ErrorCode.PROMPT_TOO_LONG
    assert built == []
    refusal(small[:3])  # within the limits: read (whatever the tiny context then says of the prompt)
    assert len(built) == 1
    with pytest.raises(ParamError) as info:
        proc.tokenize_request(Tokenize(request_id="t", messages=messages, tools=small))
    assert info.value.param == "tools"


def test_history_arguments_too_deep_for_json_stay_text():
    """An assistant call's arguments are handed to the template as an object when they are
    JSON; nested past what json.loads follows, they stay the text they are (they were an
    internal error)."""
    deep = "[" * 5000 + "]" * 5000
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}}]
    out = tooling.template_messages([{"role": "assistant", "content": None, "tool_calls": calls}])
    assert [c["function"]["arguments"] for c in out[0]["tool_calls"]] == [deep, {"a": 1}]

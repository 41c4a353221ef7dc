"""Tool-call and reasoning parsers on fixed texts: the whole text at once gives the calls
and content an independent reading gives (json.loads of each call), and every split of
the text into two or three pieces (every chunk boundary) streams to exactly the same
result: content, reasoning, each call's id and name once, then arguments joining to the
whole call's."""

from __future__ import annotations

import itertools
import json

import pytest

from noria.frontend.chat_output import ChatOutput
from noria.frontend.reasoning import make_reasoning_parser
from noria.frontend.tool_parsers import PARSERS, NamedParser, RequiredParser
from noria.protocol.client import ToolCallDelta


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def run(make, pieces: list[str]):
    """Feed `pieces`; return (content, reasoning, calls as (id, name, args)) from the
    stream, and check the stream's shape against the parser's own complete calls."""
    out: ChatOutput = make()
    content, reasoning, deltas = [], [], []
    for k, piece in enumerate(pieces):
        c, r, d = out.feed(piece, final=k == len(pieces) - 1)
        content.append(c)
        reasoning.append(r)
        deltas += d
    streamed: dict[int, list] = {}
    for d in deltas:
        assert isinstance(d, ToolCallDelta)
        if d.id is not None:  # a call's first piece: id, type and name, once
            assert d.index not in streamed and d.index == len(streamed) and d.type == "function"
            streamed[d.index] = [d.id, d.function.name, d.function.arguments or ""]
        else:
            assert d.function.name is None and d.function.arguments
            streamed[d.index][2] += d.function.arguments
    calls = [(c.id, c.function.name, c.function.arguments) for c in out.calls]
    assert [tuple(v) for _, v in sorted(streamed.items())] == calls
    return "".join(content), "".join(reasoning), calls


def every_split(make, text: str):
    whole = run(make, [text])
    for i in range(len(text) + 1):
        assert run(make, [text[:i], text[i:]]) == whole, (text[:i], text[i:])
    for i in range(0, len(text) + 1, 3):
        for j in range(i, len(text) + 1, 5):
            assert run(make, [text[:i], text[i:j], text[j:]]) == whole
    # one character at a time, with empty pieces between
    assert run(make, [x for ch in text for x in (ch, "")] + [""]) == whole
    return whole


def tools(name: str):
    return lambda: ChatOutput(None, PARSERS[name](_ids()), single_call=False)


WEATHER = '{"city": "Paris \\"Nord\\"", "days": [1, 2], "unit": {"c": true}}'


def test_hermes_calls_and_content_around_them():
    text = (f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
            '<tool_call>{"arguments": {}, "name": "now"}</tool_call> done <tool')
    content, _, calls = every_split(tools("hermes"), text)
    assert content == "Let me look.\n\n done <tool"
    assert calls == [("call_0", "get_weather", WEATHER), ("call_1", "now", "{}")]
    assert json.loads(calls[0][2]) == json.loads(WEATHER)


def test_json_edges_escapes_scalars_and_unicode():
    # An escaped quote before a brace, members that are numbers, a scalar argument.
    args = '{"q": "x\\"}{\\"y", "n": -1.5e3 , "t": "東🙂"}'
    text = f'<tool_call>{{"id": 7 , "name": "f", "arguments": {args} }}</tool_call>' \
           '<tool_call>{"name": "g", "arguments": 12 }</tool_call>'
    content, _, calls = every_split(tools("hermes"), text)
    assert content == "" and calls == [("call_0", "f", args), ("call_1", "g", "12")]
    assert json.loads(args) == {"q": 'x"}{"y', "n": -1500.0, "t": "東🙂"}


def test_hermes_without_a_name_is_content_and_an_open_call_counts():
    content, _, calls = every_split(tools("hermes"), '<tool_call>{"x": 1}</tool_call>ok')
    assert content == '<tool_call>{"x": 1}</tool_call>ok' and calls == []
    content, _, calls = every_split(tools("hermes"), '<tool_call>{"name": "f", "arguments": {"a": [1, ')
    assert content == "" and calls == [("call_0", "f", '{"a": [1, ')]  # cut by max_tokens, as streamed
    content, _, calls = every_split(tools("hermes"), "plain text, no calls < > {}")
    assert content == "plain text, no calls < > {}" and calls == []


def test_llama3_json():
    text = f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "now", "parameters": {{}}}}'
    content, _, calls = every_split(tools("llama3_json"), text)
    assert content == "" and calls == [("call_0", "get_weather", WEATHER), ("call_1", "now", "{}")]
    content, _, calls = every_split(tools("llama3_json"), ' {"name": "f", "parameters": {"q": "a;b"}}')
    assert calls == [("call_0", "f", '{"q": "a;b"}')] and content == ""
    content, _, calls = every_split(tools("llama3_json"), "The answer is {42}.")
    assert content == "The answer is {42}." and calls == []
    content, _, calls = every_split(tools("llama3_json"), '{"answer": 42} is JSON')
    assert content == '{"answer": 42} is JSON' and calls == []


def test_mistral():
    text = f'Sure. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "now", "arguments": {{}}}}]'
    content, _, calls = every_split(tools("mistral"), text)
    assert content == "Sure. " and calls == [("call_0", "get_weather", WEATHER), ("call_1", "now", "{}")]
    content, _, calls = every_split(tools("mistral"), "[TOOL_CALLS] nothing")
    assert content == "[TOOL_CALLS] nothing" and calls == []
    content, _, calls = every_split(tools("mistral"), '[TOOL_CALLS]{"name": "f", "arguments": {"a": 1}}')
    assert content == "" and calls == [("call_0", "f", '{"a": 1}')]


def test_required_and_named_readers():
    make = lambda: ChatOutput(None, RequiredParser(_ids()), single_call=False)  # noqa: E731
    text = '[{"name":"get_weather","arguments":{"city":"x","days":[1]}},{"name":"now","arguments":{}}]'
    content, _, calls = every_split(make, text)
    assert content == "" and calls == [("call_0", "get_weather", '{"city":"x","days":[1]}'), ("call_1", "now", "{}")]
    single = lambda: ChatOutput(None, RequiredParser(_ids()), single_call=True)  # noqa: E731
    assert every_split(single, text)[2] == [("call_0", "get_weather", '{"city":"x","days":[1]}')]
    named = lambda: ChatOutput(None, NamedParser("get_weather", _ids()), single_call=False)  # noqa: E731
    assert every_split(named, '{"city":"x"}') == ("", "", [("call_0", "get_weather", '{"city":"x"}')])


def reasoning(name: str, kwargs=None, tool: str | None = None):
    return lambda: ChatOutput(make_reasoning_parser(name, kwargs), PARSERS[tool](_ids()) if tool else None,
                              single_call=False)


@pytest.mark.parametrize("text, name, expect", [
    ("<think>Hmm, 2+2.</think>\n\nIt is 4.", "qwen3", ("\n\nIt is 4.", "Hmm, 2+2.")),
    ("It is 4, no thinking.", "qwen3", ("It is 4, no thinking.", "")),
    ("A <think>b</think>c", "qwen3", ("A c", "b")),
    ("<think>never closed", "qwen3", ("", "never closed")),
    ("Hmm, 2+2.</think>It is 4.", "deepseek_r1", ("It is 4.", "Hmm, 2+2.")),
    ("\n<think>Hmm.</think>It is 4.", "deepseek_r1", ("It is 4.", "Hmm.")),
    ("all reasoning <think", "deepseek_r1", ("", "all reasoning <think")),
])
def test_reasoning_parsers(text, name, expect):
    content, thought, _ = every_split(reasoning(name), text)
    assert (content, thought) == expect


def test_qwen3_thinking_off_and_tools_after_reasoning():
    assert make_reasoning_parser("qwen3", {"enable_thinking": False}) is None
    text = '<think>I should call f. <tool_call>not yet</tool_call></think>Calling.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    content, thought, calls = every_split(reasoning("qwen3", tool="hermes"), text)
    assert thought == "I should call f. <tool_call>not yet</tool_call>"
    assert content == "Calling." and calls == [("call_0", "f", '{"a": 1}')]

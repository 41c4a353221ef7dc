"""Tool-call and reasoning parsers on fixed texts: the whole text at once gives the calls
and content an independent reading gives (json.loads of each call), and every split of
the text into two or three pieces (every chunk boundary) streams to exactly the same
result: content, reasoning, each call's id and name once, then arguments joining to the
whole call's."""

from __future__ import annotations

import ast
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


def test_mistral_v11_name_args_format():
    # Tokenizer v11+: [TOOL_CALLS]name[ARGS]{...} per call; one without [ARGS] (a tokenizer that
    # drops it) reads the same; the arguments run to the next [TOOL_CALLS] or the end.
    text = f'Checking. [TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]now[ARGS]{{}}[TOOL_CALLS]ping{{"n": 1}}\n'
    content, _, calls = every_split(tools("mistral"), text)
    assert content == "Checking. "
    assert calls == [("call_0", "get_weather", WEATHER), ("call_1", "now", "{}"), ("call_2", "ping", '{"n": 1}')]
    assert json.loads(calls[0][2]) == json.loads(WEATHER)
    # No arguments written (cut by max_tokens): an empty object, as the JSON formats give it.
    assert every_split(tools("mistral"), "[TOOL_CALLS]now[ARGS]")[2] == [("call_0", "now", "{}")]
    # A word after the tag that never reaches [ARGS] or `{` is no call: it stays content.
    for text in ("[TOOL_CALLS]nothing here", "[TOOL_CALLS]almost[ARG", "[TOOL_CALLS]x[TOOL_CALLS]f[ARGS]{}"):
        content, _, calls = every_split(tools("mistral"), text)
        if text.endswith("{}"):
            assert content == "[TOOL_CALLS]x" and calls == [("call_0", "f", "{}")]
        else:
            assert content == text and calls == []
    # The older array format still reads after a v11 call, and the other way round.
    text = '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS][{"name": "g", "arguments": {"b": 2}}]'
    assert every_split(tools("mistral"), text)[2] == [("call_0", "f", '{"a": 1}'), ("call_1", "g", '{"b": 2}')]


def test_pythonic_calls_read_with_ast():
    # Values of every literal kind; strings holding brackets, quotes, commas and escapes;
    # triple quotes; a nested call-looking string. Each call's arguments are json.dumps of
    # the values an independent reading (ast.literal_eval of a dict display) gives.
    args = ('city="Paris (Nord), ]", days=[1, 2], unit={"c": True, \'k\': None}, t=(1.5, -2), '
            "q='it\\'s', doc=\'\'\'a \"b\" ) ]\'\'\', e=\"東🙂\"")
    text = f'[get_weather({args}), now(), f(s="g(x=1)")]'
    content, _, calls = every_split(tools("pythonic"), text)
    reference = eval_kwargs(args)
    assert content == "" and [(c[0], c[1]) for c in calls] == [("call_0", "get_weather"), ("call_1", "now"),
                                                                ("call_2", "f")]
    assert json.loads(calls[0][2]) == json.loads(json.dumps(reference)) and calls[1][2] == "{}"
    assert json.loads(calls[2][2]) == {"s": "g(x=1)"}
    # Leading whitespace, and text after the list, which is content.
    content, _, calls = every_split(tools("pythonic"), ' \n[f(a=1)] Done.')
    assert content == " Done." and calls == [("call_0", "f", '{"a": 1}')]


def eval_kwargs(args: str) -> dict:
    """The keyword arguments `args` spells, read by ast alone (an independent reading)."""
    call = ast.parse(f"f({args})", mode="eval").body
    assert isinstance(call, ast.Call)
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords}


@pytest.mark.parametrize("text", [
    "The answer is [42].",
    "[1, 2, 3]",
    "[Note] see above",
    "[]",
    "[f(1)]",  # a positional argument
    "[f(x=open('/etc/passwd'))]",  # not a literal: never run
    "[f(x=__import__('os').system('true'))]",
    "[f(**{'a': 1})]",
    "[f(x={1, 2})]",  # a set has no JSON form
    "[f(x=1e999)]",  # inf has none either
    "[os.system(x='y')]",  # a dotted name
    "[f(x=1",  # cut off
    "[f(x='a)]",
])
def test_pythonic_text_that_is_no_call_list_is_content(text):
    content, _, calls = every_split(tools("pythonic"), text)
    assert content == text and calls == []


def test_pythonic_content_from_the_first_element_that_is_no_call():
    content, _, calls = every_split(tools("pythonic"), "[f(a=1), g(2), h()]")
    assert calls == [("call_0", "f", '{"a": 1}')] and content == " g(2), h()]"
    # Cut by max_tokens after a complete call: that call stands.
    content, _, calls = every_split(tools("pythonic"), '[f(a="x"), g(b=')
    assert calls == [("call_0", "f", '{"a": "x"}')] and content == " g(b="


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

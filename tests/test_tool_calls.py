"""Tool calling and reasoning against a live `noria serve` (the demo model's weights and
tokenizer with a chat template that renders tools, --enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3): the official `openai` client whole
and streamed, and the ZMQ `Client.chat`.

The model is random, so what it writes is made to matter through constraints: under
tool_choice "required" or a named function every call must name a listed tool with
arguments valid under its schema (checked by jsonschema) whatever the sampler draws; for
"auto" and reasoning, a regex makes the model write a hermes call or a <think> block, and
the parsers must read them back."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from noria import Client, SamplingParams
from noria.frontend.chat_output import ChatConfig, chat_setup
from noria.frontend.inputs import make_generate
from noria.protocol.client import Done
from noria.protocol.errors import ParamError
from noria.protocol.structured import StructuredOutput
from tests.procs import serve_http

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: arguments are {}
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "now": {"type": "object", "additionalProperties": False}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MANY_TOOLS = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(9)]
MODEL = [""]

# Qwen2.5's way of writing tools and calls, on the demo tokenizer's header tokens.
TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\n# Tools\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{%- if m.get('tool_calls') %}{%- for tc in m['tool_calls'] %}"
    "<tool_call>{\"name\": \"{{ tc['function']['name'] }}\", \"arguments\": {{ tc['function']['arguments'] | tojson }}}"
    "</tool_call>{%- endfor %}"
    "{%- elif m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
    "{%- else %}{{ m['content'] }}{%- endif %}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)


@pytest.fixture(scope="module")
def tools_model(demo_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("tools-model") / "m"
    shutil.copytree(demo_path, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def served(tools_model):
    MODEL[0] = str(tools_model)  # the served model's name is its --model
    with serve_http("--model", str(tools_model), "--num-kv-blocks", "256", "--enable-auto-tool-choice",
                    "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--max-tools", "8") as s:
        yield s


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def streamed_calls(chunks) -> tuple[dict[int, dict], list[str]]:
    """Each call from its pieces (id, type and name once, then arguments), and the finish reasons."""
    calls: dict[int, dict] = {}
    finish = []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason:
                finish.append(choice.finish_reason)
            for tc in choice.delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
                else:
                    assert tc.function.name is None
                    calls[tc.index]["arguments"] += tc.function.arguments
    return calls, finish


def test_required_calls_name_listed_tools_with_valid_arguments(served, oai):
    seen = set()
    for seed in range(4):
        kw = dict(model=served.http and MODEL[0], messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=1000,
                  temperature=1.0, seed=seed, n=2)
        whole = oai.chat.completions.create(**kw)
        for c in whole.choices:
            assert c.finish_reason == "tool_calls" and c.message.tool_calls
            assert c.message.content is None
            for tc in c.message.tool_calls:
                assert tc.type == "function" and tc.id.startswith("call_") and len(tc.id) > 12
                check_call(tc.function.name, tc.function.arguments)
                seen.add(tc.function.name)
        streamed, finish = streamed_calls(oai.chat.completions.create(**kw | {"n": 1, "stream": True}))
        first = oai.chat.completions.create(**kw | {"n": 1}).choices[0].message.tool_calls
        assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == \
            [(tc.function.name, tc.function.arguments) for tc in first]  # same seed, same calls
        assert finish == ["tool_calls"]
    assert len(seen) >= 2  # the sampler really chose among the tools
    one = oai.chat.completions.create(model=served.http and MODEL[0], messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=1000, temperature=1.0, seed=1, n=4)
    assert all(len(c.message.tool_calls) == 1 for c in one.choices)


def test_named_function(served, oai):
    choice = {"type": "function", "function": {"name": "add"}}
    for stream in (False, True):
        kw = dict(model=served.http and MODEL[0], messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=200,
                  temperature=1.0, seed=3)
        if stream:
            calls, finish = streamed_calls(oai.chat.completions.create(**kw, stream=True))
            assert list(calls) == [0] and calls[0]["name"] == "add" and finish == ["tool_calls"]
            check_call("add", calls[0]["arguments"])
        else:
            out = oai.chat.completions.create(**kw).choices[0]
            assert out.finish_reason == "tool_calls" and [tc.function.name for tc in out.message.tool_calls] == ["add"]
            check_call("add", out.message.tool_calls[0].function.arguments)


HERMES = r'Sure\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "unit": "c"\}\}</tool_call>'


def test_auto_reads_the_calls_the_model_writes(served, oai):
    kw = dict(model=served.http and MODEL[0], messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=1.0, seed=5,
              extra_body={"guided_regex": HERMES})
    out = oai.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Sure."
    (tc,) = out.message.tool_calls
    assert tc.function.name == "get_weather"
    check_call("get_weather", tc.function.arguments)
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    calls, finish = streamed_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", tc.function.arguments)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Sure." and finish == ["tool_calls"]
    # No call written: plain content, finish "stop"; tool_choice "none" the same.
    for choice in ("auto", "none"):
        plain = oai.chat.completions.create(model=served.http and MODEL[0], messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                            max_tokens=10, extra_body={"guided_regex": "[a-z ]{3,9}"})
        assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls


def test_reasoning_content_whole_and_streamed(served, oai):
    kw = dict(model=served.http and MODEL[0], messages=MESSAGES, max_tokens=200, temperature=1.0, seed=2,
              extra_body={"guided_regex": "<think>[a-z ]{4,20}</think>[a-z]{2,8}"})
    out = oai.chat.completions.create(**kw).choices[0]
    msg = out.message
    assert msg.reasoning_content and "<think>" not in msg.content and "</think>" not in msg.content
    assert 4 <= len(msg.reasoning_content) <= 20 and 2 <= len(msg.content) <= 8
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices) \
        == msg.reasoning_content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    # enable_thinking false: no reasoning parser for the request, the tags stay in the content.
    off = oai.chat.completions.create(**kw | {"extra_body": kw["extra_body"] | {
        "chat_template_kwargs": {"enable_thinking": False}}}).choices[0].message
    assert off.content == f"<think>{msg.reasoning_content}</think>{msg.content}"


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": MANY_TOOLS, "tool_choice": "required"}, "tools"),  # past --max-tools
    # A schema object that llguidance cannot compile: the engine's invalid_grammar names the tools.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 5}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(served, oai, extra, param):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=served.http and MODEL[0], messages=MESSAGES, max_tokens=5, stream=stream, extra_body=extra)
        assert e.value.body["param"] == param, e.value.body


def test_completions_still_refuse_tools(served, oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=served.http and MODEL[0], prompt="Hi", max_tokens=2, extra_body={"tools": TOOLS})
    assert e.value.body["param"] == "tools"


def test_auto_needs_the_server_flags():
    msg = make_generate("r", None, SamplingParams(), messages=MESSAGES, tools=TOOLS)  # tool_choice: auto
    for choice, param in ((None, "tools"), ("auto", "tool_choice")):  # the default blames the tools
        with pytest.raises(ParamError) as e:
            chat_setup(make_generate("r", None, SamplingParams(), messages=MESSAGES, tools=TOOLS,
                                     tool_choice=choice), ChatConfig(reasoning_parser="qwen3"))
        assert e.value.param == param and "--enable-auto-tool-choice" in e.value.message
    assert chat_setup(msg, ChatConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")).choice == "auto"
    none = make_generate("r", None, SamplingParams(), messages=MESSAGES, tools=TOOLS, tool_choice="none")
    assert chat_setup(none, ChatConfig()) is None
    with pytest.raises(ParamError) as e:
        chat_setup(make_generate("r", "text", SamplingParams(), tools=TOOLS), ChatConfig())
    assert e.value.param == "tools"
    named = make_generate("r", None, SamplingParams(), messages=MESSAGES, tools=TOOLS,
                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert chat_setup(named, ChatConfig()).structured == StructuredOutput(json=WEATHER)


def test_zmq_client_chat_with_tools_and_history(served, tools_model):
    from transformers import AutoTokenizer

    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    with Client(served.address, timeout=120) as client:
        out = client.chat(history, SamplingParams(max_tokens=1000, temperature=1.0, seed=7), tools=TOOLS,
                          tool_choice="required")
        sample = out.outputs[0]
        assert sample.finish_reason == "tool_calls" and sample.tool_calls and sample.text == ""
        for tc in sample.tool_calls:
            check_call(tc.function.name, tc.function.arguments)
        # The prompt is the template rendered as transformers renders it with tools= (the
        # history's arguments as objects, as vLLM hands them to templates).
        tok = AutoTokenizer.from_pretrained(str(tools_model))
        parsed = [dict(m) for m in history]
        parsed[1]["tool_calls"] = [{**parsed[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]
        text = tok.apply_chat_template(parsed, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert '"arguments": {"city": "Paris", "unit": "c"}' in text and "# Tools" in text
        assert out.prompt_token_ids == tok(text, add_special_tokens=False)["input_ids"]
        # Streamed over ZMQ: the deltas carry the same calls in pieces.
        pieces: dict[int, list[str]] = {}
        for d in client.stream(None, SamplingParams(max_tokens=1000, temperature=1.0, seed=7), messages=history,
                               tools=TOOLS, tool_choice="required"):
            if isinstance(d, Done):
                assert [(c.function.name, c.function.arguments) for c in d.tool_calls[0]] == \
                    [(c.function.name, c.function.arguments) for c in sample.tool_calls]
                continue
            for tc in d.tool_calls or []:
                if tc.id is not None:
                    pieces[tc.index] = [tc.function.name, ""]
                else:
                    pieces[tc.index][1] += tc.function.arguments
        assert [tuple(v) for _, v in sorted(pieces.items())] == \
            [(tc.function.name, tc.function.arguments) for tc in sample.tool_calls]
        thought = client.chat(MESSAGES, SamplingParams(max_tokens=100, seed=1, structured_output=StructuredOutput(
            regex="<think>[a-z]{3}</think>ok")))
        assert thought.outputs[0].reasoning_content and len(thought.outputs[0].reasoning_content) == 3
        assert thought.outputs[0].text == "ok"


def test_websocket_tools_past_the_limits_fail_alone(served):
    """On one websocket: a request with more tools than --max-tools and one whose tool
    schema nests too deeply get errors naming `tools`; the socket's tool call beside them
    is served."""
    import asyncio

    import websockets

    deep: dict = {"type": "object", "properties": {}}
    node = deep
    for _ in range(400):
        node["properties"]["a"] = {"type": "object", "properties": {}}
        node = node["properties"]["a"]
    nested = [{"type": "function", "function": {"name": "f", "parameters": deep}}]

    async def main() -> dict[str, dict]:
        url = served.http.replace("http://", "ws://") + "/v1/stream"
        async with websockets.connect(url, max_size=None) as ws:
            for rid, tools in (("many", MANY_TOOLS), ("deep", nested), ("ok", TOOLS)):
                await ws.send(json.dumps({"type": "generate", "request_id": rid, "messages": MESSAGES, "tools": tools,
                                          "tool_choice": "required", "max_tokens": 1000, "seed": 1}))
            finals: dict[str, dict] = {}
            while len(finals) < 3:
                m = json.loads(await ws.recv())
                if m["type"] in ("done", "error"):
                    finals[m["request_id"]] = m
            return finals

    finals = asyncio.run(main())
    assert finals["many"]["type"] == "error" and finals["many"]["param"] == "tools", finals["many"]
    assert "--max-tools" in finals["many"]["message"]
    assert finals["deep"]["type"] == "error" and finals["deep"]["param"] == "tools", finals["deep"]
    ok = finals["ok"]
    assert ok["type"] == "done" and ok["finish_reason"] == "tool_calls", ok
    for tc in ok["tool_calls"][0]:
        check_call(tc["function"]["name"], tc["function"]["arguments"])


def test_zmq_tools_and_schemas_json_cannot_spell_fail_alone(served):
    """msgpack carries what JSON cannot: bytes, integer keys, NaN and infinities, in tool
    parameters or a request's own schema. Each such request gets its own 400-class error;
    none reaches the scheduler (one that did stopped it, and its resubmission after every
    restart stopped the next, until the engine was declared dead), and the next request is served."""
    import msgspec
    import zmq

    def tool(params):
        return [{"type": "function", "function": {"name": "f", "parameters": params}}]

    prop = {"type": "object", "properties": {"a": {"type": "number"}}}
    cases = {
        "bytes": {"tools": tool({**prop, "description": b"\xff"}), "tool_choice": "required"},
        "nan": {"tools": tool({**prop, "maximum": float("nan")}), "tool_choice": "required"},
        "inf": {"tools": tool({**prop, "minimum": float("-inf")}), "tool_choice": {"type": "function",
                                                                                 "function": {"name": "f"}}},
        "keys": {"tools": tool({"type": "object", "properties": {1: {"type": "integer"}, "b": {}}}),
                 "tool_choice": "required"},
        "own_schema": {"structured_output": {"json": {"type": "object", "title": b"\x00"}}},
        "own_keys": {"structured_output": {"json": {"type": "object", "properties": {2: {}, "x": {}}}}},
    }
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(served.address)
    try:
        for rid, body in cases.items():
            sock.send(msgspec.msgpack.encode({"type": "generate", "request_id": rid, "messages": MESSAGES,
                                              "max_tokens": 20, **body}))
        got: dict[str, dict] = {}
        while len(got) < len(cases):
            assert sock.poll(120_000), f"no answer for {set(cases) - set(got)}"
            m = msgspec.msgpack.decode(sock.recv())
            if m["type"] in ("done", "error"):
                got[m["request_id"]] = m
        sock.send(msgspec.msgpack.encode({"type": "generate", "request_id": "after", "messages": MESSAGES,
                                          "tools": TOOLS, "tool_choice": "required", "max_tokens": 1000}))
        sock.send(msgspec.msgpack.encode({"type": "get_stats"}))
        while "after" not in got or "stats" not in got:
            assert sock.poll(120_000), "no answer after the bad requests"
            m = msgspec.msgpack.decode(sock.recv())
            if m["type"] != "delta":
                got[m.get("request_id") or m["type"]] = m
    finally:
        sock.close()
    for rid in cases:
        assert got[rid]["type"] == "error" and got[rid]["code"] == "invalid_request", got[rid]
        assert got[rid]["param"] == ("tools" if rid in ("bytes", "nan", "inf", "keys") else "structured_output")
    assert got["after"]["type"] == "done" and got["after"]["finish_reason"] == "tool_calls", got["after"]
    assert got["stats"]["scheduler_restarts"] == 0

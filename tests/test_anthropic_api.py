"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) against a live `noria
serve --api-key` with the official `anthropic` SDK, unmodified: create and stream, tool use
(whole and as input_json_delta), tool_result turns, stop_sequences, thinking blocks through
the reasoning parser, count_tokens against the chat template, both ways of sending the key,
errors in Anthropic's shape, and a client that hangs up mid-stream.

The model is the demo's random one with a template that renders tools (tests/test_tool_calls.py),
so what it writes is made to matter through constraints: tool_choice any / tool run under a
grammar (every call names a listed tool, its input valid under the schema), and vLLM's
guided_regex (an extra the endpoint takes, as chat does) makes it write text, a stop string,
a hermes call or a <think> block for the parsers to read back."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import anthropic
import jsonschema
import openai
import pytest

from tests.procs import engine_idle, scrape_metrics, serve_http, wait_metrics
from tests.test_tool_calls import ADD, TEMPLATE, WEATHER

KEY = "sk-anthropic-test-key"
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
         {"name": "add", "input_schema": ADD}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = r'Sure\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "unit": "c"\}\}</tool_call>'
THINK = "<think>[a-z ]{4,20}</think>[a-z]{2,8}"


@pytest.fixture(scope="module")
def served(demo_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("anthropic-model") / "m"
    shutil.copytree(demo_path, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    with serve_http("--model", str(path), "--num-kv-blocks", "256", "--enable-auto-tool-choice",
                    "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--api-key", KEY) as s:
        yield s, str(path)


@pytest.fixture(scope="module")
def client(served):
    with anthropic.Anthropic(base_url=served[0].http, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(served):
    return served[1]  # the served model's name is its --model


def post(http: str, path: str, body: dict, headers: dict[str, str]) -> tuple[int, dict, str]:
    req = urllib.request.Request(f"{http}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get("Content-Type", "")


def check_input(block) -> None:
    assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name in SCHEMAS
    jsonschema.validate(block.input, SCHEMAS[block.name])


def test_text_stop_sequences_and_max_tokens(client, model):
    regex = {"guided_regex": "[a-z]{3}XYZ[a-z]{3}"}
    whole = client.messages.create(model=model, max_tokens=50, messages=ASK, extra_body=regex)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None
    (text,) = whole.content
    assert text.type == "text" and len(text.text) == 9 and text.text[3:6] == "XYZ"
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) > 5 and whole.usage.output_tokens > 0
    # This SDK's create() no longer names the sampling fields: they go as body fields.
    cut = client.messages.create(model=model, max_tokens=50, messages=ASK, stop_sequences=["XY", "Q"],
                                 extra_body=regex | {"temperature": 0.7, "top_p": 0.9, "top_k": 20})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "XY"
    assert len(cut.content[0].text) == 3 and "X" not in cut.content[0].text
    short = client.messages.create(model=model, max_tokens=2, messages=ASK, extra_body=regex)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    # Streamed: the same text in text_deltas, the same stop in message_delta.
    with client.messages.stream(model=model, max_tokens=50, messages=ASK, extra_body=regex | {"temperature": 0},
                                stop_sequences=["XY"], system="Answer briefly.") as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text and len(streamed) == 3
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "XY"
    greedy = client.messages.create(model=model, max_tokens=50, messages=ASK, extra_body=regex | {"temperature": 0},
                                    stop_sequences=["XY"], system="Answer briefly.")
    assert greedy.content[0].text == streamed and greedy.usage.output_tokens == final.usage.output_tokens
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == \
        greedy.usage.input_tokens + (greedy.usage.cache_read_input_tokens or 0)


def test_tool_use_whole_and_streamed(client, model):
    for seed in range(3):
        kw = dict(model=model, max_tokens=500, messages=ASK, tools=TOOLS, tool_choice={"type": "any"},
                  extra_body={"seed": seed, "temperature": 1.0})
        whole = client.messages.create(**kw)
        assert whole.stop_reason == "tool_use" and whole.content
        for block in whole.content:
            check_input(block)
        events = list(client.messages.create(**kw, stream=True))
        kinds = [e.type for e in events]
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        starts = [e for e in events if e.type == "content_block_start"]
        assert [s.content_block.name for s in starts] == [b.name for b in whole.content]
        assert [s.index for s in starts] == list(range(len(starts)))
        assert [e.index for e in events if e.type == "content_block_stop"] == list(range(len(starts)))
        for s in starts:
            pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == s.index]
            assert all(e.delta.type == "input_json_delta" for e in events if e.type == "content_block_delta")
            assert json.loads("".join(pieces)) == whole.content[s.index].input  # same seed, same call
        assert events[-2].delta.stop_reason == "tool_use" and events[-2].usage.output_tokens == whole.usage.output_tokens
        with client.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in whole.content]
    # The same request on the chat endpoint draws the same calls: it is the request this one means.
    with openai.OpenAI(base_url=f"{client.base_url}".rstrip("/") + "/v1", api_key=KEY, max_retries=0) as oai:
        chat = oai.chat.completions.create(
            model=model, max_tokens=500, messages=ASK, tool_choice="required", seed=2, temperature=1.0,
            tools=[{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}
                    | ({"description": t["description"]} if "description" in t else {})} for t in TOOLS])
    assert [(c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls] == \
        [(b.name, b.input) for b in whole.content]
    one = client.messages.create(model=model, max_tokens=500, messages=ASK, tools=TOOLS,
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"seed": 4})
    assert len(one.content) == 1
    named = client.messages.create(model=model, max_tokens=500, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "add"})
    assert [b.name for b in named.content] == ["add"] and named.stop_reason == "tool_use"
    check_input(named.content[0])
    plain = client.messages.create(model=model, max_tokens=8, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "none"}, extra_body={"guided_regex": "[a-z]{4}"})
    assert plain.stop_reason == "end_turn" and [b.type for b in plain.content] == ["text"]


def test_auto_reads_the_calls_the_model_writes(client, model):
    kw = dict(model=model, max_tokens=200, messages=ASK, tools=TOOLS, tool_choice={"type": "auto"},
              extra_body={"guided_regex": HERMES, "seed": 5})
    whole = client.messages.create(**kw)
    assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["text", "tool_use"]
    assert whole.content[0].text == "Sure."
    check_input(whole.content[1])
    with client.messages.stream(**kw) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "Sure." and final.content[1].input == whole.content[1].input


def history(call_id: str) -> list[dict]:
    return ASK + [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call_id, "content": [{"type": "text", "text": "18 degrees"}]},
            {"type": "text", "text": "And tomorrow?"}]},
    ]


def test_tool_result_turn_and_count_tokens(client, model):
    from transformers import AutoTokenizer

    turn = history("toolu_01")
    out = client.messages.create(model=model, max_tokens=500, messages=turn, tools=TOOLS, system="Be brief.",
                                 tool_choice={"type": "any"})
    assert out.stop_reason == "tool_use"
    for block in out.content:
        check_input(block)
    counted = client.messages.count_tokens(model=model, messages=turn, tools=TOOLS, system="Be brief.")
    assert counted.input_tokens == out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0)
    # What the template renders for the chat messages this conversation means.
    tok = AutoTokenizer.from_pretrained(model)
    chat = [{"role": "system", "content": "Be brief."}, ASK[0],
            {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "toolu_01", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
            {"role": "tool", "tool_call_id": "toolu_01", "content": "18 degrees"},
            {"role": "user", "content": "And tomorrow?"}]
    functions = [{"type": "function", "function": {"name": t["name"], **({"description": t["description"]}
                  if "description" in t else {}), "parameters": t["input_schema"]}} for t in TOOLS]
    text = tok.apply_chat_template(chat, tools=functions, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>18 degrees</tool_response>" in text and '"city": "Paris"' in text
    assert counted.input_tokens == len(tok(text, add_special_tokens=False)["input_ids"])
    assert client.messages.count_tokens(model=model, messages=ASK).input_tokens < counted.input_tokens


def test_thinking_blocks(client, model):
    kw = dict(model=model, max_tokens=200, messages=ASK, extra_body={"guided_regex": THINK, "seed": 2})
    whole = client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in whole.content] == ["thinking", "text"]
    thought, answer = whole.content[0].thinking, whole.content[1].text
    assert 4 <= len(thought) <= 20 and 2 <= len(answer) <= 8 and "<think>" not in answer
    events = list(client.messages.create(**kw, stream=True))
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thought
    assert "".join(d.text for d in deltas if d.type == "text_delta") == answer
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["thinking", "text"]
    # Thinking disabled: the template and the parser are told; the tags stay in the text.
    off = client.messages.create(**kw, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == f"<think>{thought}</think>{answer}"


def test_keys_both_ways_and_errors_in_anthropics_shape(served, model):
    http = served[0].http
    body = {"model": model, "max_tokens": 3, "messages": ASK}
    status, doc, _ = post(http, "/v1/messages", body, {"x-api-key": KEY})
    assert status == 200 and doc["type"] == "message"
    status, doc, _ = post(http, "/v1/messages/count_tokens", {"model": model, "messages": ASK}, {"x-api-key": KEY})
    assert status == 200 and doc["input_tokens"] > 0
    with anthropic.Anthropic(base_url=http, api_key=None, auth_token=None, default_headers={"x-api-key": KEY},
                             max_retries=0) as c:
        assert c.messages.create(model=model, max_tokens=2, messages=ASK).usage.output_tokens == 2
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        status, doc, _ = post(http, "/v1/messages", body, headers)
        assert status == 401 and doc["type"] == "error" and doc["error"]["type"] == "authentication_error", doc
    with anthropic.Anthropic(base_url=http, api_key="wrong", max_retries=0) as c:
        with pytest.raises(anthropic.AuthenticationError) as e:
            c.messages.create(model=model, max_tokens=2, messages=ASK)
        assert e.value.body["error"]["type"] == "authentication_error"
    bad = [
        ({k: v for k, v in body.items() if k != "max_tokens"}, 400, "max_tokens"),
        (body | {"model": "claude-nope"}, 404, "claude-nope"),
        (body | {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "image"),
        (body | {"messages": [{"role": "system", "content": "x"}]}, 400, "role"),
        (body | {"tool_choice": {"type": "sometimes"}}, 400, "tool_choice"),
        (body | {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "missing"}}, 400, "missing"),
        (body | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "web_search"),
        (body | {"temperature": -1}, 400, "temperature"),
        (body | {"stop_sequences": "XY"}, 400, "stop_sequences"),
        (body | {"thinking": {"type": "maybe"}}, 400, "thinking"),
        (body | {"max_tokens": 10**6}, 400, "max_tokens"),
    ]
    for stream in (False, True):
        for doc_in, want, says in bad:
            status, doc, kind = post(http, "/v1/messages", doc_in | {"stream": stream}, {"x-api-key": KEY})
            assert status == want and kind.startswith("application/json"), (doc_in, doc)
            assert set(doc) == {"type", "error"} and doc["type"] == "error", doc
            assert doc["error"]["type"] == ("not_found_error" if want == 404 else "invalid_request_error"), doc
            assert says in doc["error"]["message"], doc
    status, doc, _ = post(http, "/v1/messages/nowhere", body, {"x-api-key": KEY})
    assert status == 404 and doc["error"]["type"] == "not_found_error"
    with anthropic.Anthropic(base_url=http, api_key=KEY, max_retries=0) as c:
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model=model, max_tokens=5, messages=ASK, tools=TOOLS, tool_choice={"type": "any"},
                              extra_body={"guided_regex": "a"})
        assert e.value.body["type"] == "error" and "tool_choice" in e.value.body["error"]["message"]
        with pytest.raises(anthropic.NotFoundError):
            c.messages.count_tokens(model="claude-nope", messages=ASK)


def test_a_client_that_hangs_up_mid_stream_is_aborted(served, client, model):
    http = served[0].http
    before = scrape_metrics(http).get('noria_request_success_total{finish_reason="abort"}', 0)
    with client.messages.stream(model=model, max_tokens=1900, messages=ASK,
                                extra_body={"guided_regex": "[a-z]{1800}"}) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                break  # leaving the block closes the connection
    m = wait_metrics(http, lambda m: engine_idle(m) and m.get(
        'noria_request_success_total{finish_reason="abort"}', 0) > before, timeout=120)
    assert engine_idle(m) and m['noria_request_success_total{finish_reason="abort"}'] > before

"""OpenAI's Responses API against a live `noria serve` on loopback, spoken by the official
`openai` client unmodified: create (whole and streamed: the typed event sequence), parse and
stream with a Pydantic `text_format`, function tools under tool_choice "required" and "auto",
reasoning items, `previous_response_id` chains, the store's per-key isolation, GET, DELETE,
background responses and `/cancel`, and errors naming the Responses field.

The model is the demo's random one with a chat template that renders tools (the tool-calling
tests' setup), so what it writes is made to matter through constraints: under "required" a
call names a listed tool with arguments valid under its schema whatever it samples, and a
regex makes it write a hermes call or a <think> block for the parsers to read back."""

from __future__ import annotations

import time

import openai
import pydantic
import pytest

from tests.procs import serve_http
from tests.test_tool_calls import HERMES, TEMPLATE, check_call

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER,
          "strict": True},
         {"type": "function", "name": "now", "parameters": None, "strict": False}]
ASK = "What is the weather in Paris?"


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=6)
    temp: int = pydantic.Field(ge=-40, le=50)


@pytest.fixture(scope="module")
def served(demo_path, tmp_path_factory):
    import shutil

    path = tmp_path_factory.mktemp("responses-model") / "m"
    shutil.copytree(demo_path, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    with serve_http("--model", str(path), "--num-kv-blocks", "256", "--enable-auto-tool-choice",
                    "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3") as s:
        yield s


def _client(served, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(served):
    with _client(served) as c:
        yield c


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def _text(resp) -> str:
    return "".join(p.text for item in resp.output if item.type == "message" for p in item.content)


def test_create_whole_and_streamed_events(oai, model):
    # The regex ends the answer (the grammar completes) before max_output_tokens does.
    kw = dict(model=model, input=ASK, instructions="Answer briefly.", max_output_tokens=12, temperature=0.0,
              extra_body={"guided_regex": "[a-z]{2,9}"})
    whole = oai.responses.create(**kw)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == model
    assert whole.status == "completed" and whole.instructions == "Answer briefly." and not whole.incomplete_details
    assert whole.output[0].type == "message" and whole.output[0].role == "assistant"
    assert whole.output_text == _text(whole)
    usage = whole.usage
    assert 0 < usage.output_tokens <= 12 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    events = list(oai.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == _text(final) == whole.output_text  # greedy: the same text whole and streamed
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The SDK's own stream helper accumulates the same events into the same response.
    with oai.responses.stream(**kw) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == whole.output_text
    # Cut by max_output_tokens: incomplete, and said so.
    cut = oai.responses.create(model=model, input=ASK, max_output_tokens=3, extra_body={"ignore_eos": True})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output[0].status == "incomplete"
    events = list(oai.responses.create(model=model, input=ASK, max_output_tokens=3, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_function_tools_required_whole_and_streamed(oai, model):
    kw = dict(model=model, input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=300, temperature=1.0,
              parallel_tool_calls=False, extra_body={"seed": 3})
    whole = oai.responses.create(**kw)
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    check_call(call.name, call.arguments)
    events = list(oai.responses.create(**kw, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(added) == 1 and added[0].name == call.name and args == done.arguments == call.arguments
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output[-1].arguments == call.arguments
    # A named function.
    named = oai.responses.create(**kw | {"tool_choice": {"type": "function", "name": "get_weather"}})
    (call,) = [item for item in named.output if item.type == "function_call"]
    assert call.name == "get_weather"
    check_call("get_weather", call.arguments)


def test_auto_tool_choice_and_reasoning_items(oai, model):
    out = oai.responses.create(model=model, input=ASK, tools=TOOLS, max_output_tokens=200, temperature=1.0,
                               extra_body={"seed": 5, "guided_regex": HERMES})
    assert [item.type for item in out.output] == ["message", "function_call"]
    assert out.output_text == "Sure." and out.output[1].name == "get_weather"
    check_call("get_weather", out.output[1].arguments)
    kw = dict(model=model, input=ASK, max_output_tokens=200, temperature=1.0,
              extra_body={"seed": 2, "guided_regex": "<think>[a-z ]{4,20}</think>[a-z]{2,8}"})
    out = oai.responses.create(**kw)
    assert [item.type for item in out.output] == ["reasoning", "message"]
    thought = out.output[0].content[0].text
    assert 4 <= len(thought) <= 20 and "<think>" not in out.output_text and 2 <= len(out.output_text) <= 8
    events = list(oai.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text


def test_parse_and_stream_with_a_pydantic_text_format(oai, model):
    for seed in range(2):
        done = oai.responses.parse(model=model, input="The weather as JSON.", text_format=Weather,
                                   max_output_tokens=200, temperature=1.0, extra_body={"seed": seed})
        assert isinstance(done.output_parsed, Weather)
        assert done.output_parsed == Weather.model_validate_json(done.output_text)
    with oai.responses.stream(model=model, input="JSON.", text_format=Weather, max_output_tokens=200) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Weather)


def test_previous_response_id_keeps_tool_calls_across_turns(served, oai, model):
    first = oai.responses.create(model=model, input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=300,
                                 parallel_tool_calls=False)
    (call,) = [item for item in first.output if item.type == "function_call"]
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    kw = dict(model=model, tools=TOOLS, tool_choice="none", max_output_tokens=6, temperature=0.0)
    chained = oai.responses.create(previous_response_id=first.id, input=answer, **kw)
    assert chained.previous_response_id == first.id
    # The same conversation sent whole: the same prompt token for token, the same greedy answer.
    spelled = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               *answer]
    whole = oai.responses.create(input=spelled, **kw)
    assert chained.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == whole.output_text
    # A third turn continues the chain (the second's output is kept too).
    third = oai.responses.create(previous_response_id=chained.id, input="And tomorrow?", **kw)
    assert third.usage.input_tokens > chained.usage.input_tokens + chained.usage.output_tokens - 1
    # store false: nothing to continue from.
    unstored = oai.responses.create(model=model, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=model, previous_response_id=unstored.id, input="more", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_store_is_per_key_get_and_delete(served, oai, model):
    mine = oai.responses.create(model=model, input="hello", max_output_tokens=3)
    assert oai.responses.retrieve(mine.id).output_text == mine.output_text
    with _client(served, "key-b") as other:
        for attempt in (lambda: other.responses.retrieve(mine.id), lambda: other.responses.delete(mine.id),
                        lambda: other.responses.cancel(mine.id),
                        lambda: other.responses.create(model=model, previous_response_id=mine.id, input="x",
                                                       max_output_tokens=2)):
            with pytest.raises(openai.NotFoundError):
                attempt()
        theirs = other.responses.create(model=model, input="hello", max_output_tokens=3)
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(theirs.id)
        assert other.responses.retrieve(theirs.id).id == theirs.id
    assert oai.responses.retrieve(mine.id).id == mine.id  # the other key's delete did nothing
    oai.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(mine.id)


def _wait_status(client, rid: str, ok: set[str], deadline: float = 120.0):
    end = time.monotonic() + deadline
    while True:
        got = client.responses.retrieve(rid)
        if got.status in ok or time.monotonic() > end:
            return got
        time.sleep(0.05)  # poll interval; the deadline only bounds a hang


def test_background_responses_and_cancel(oai, model):
    quick = oai.responses.create(model=model, input="hi", max_output_tokens=3, background=True)
    assert quick.status == "queued" and quick.background
    done = _wait_status(oai, quick.id, {"completed", "incomplete"})
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens >= 1
    long = oai.responses.create(model=model, input="go on", max_output_tokens=1500, background=True,
                                extra_body={"ignore_eos": True})
    assert _wait_status(oai, long.id, {"in_progress"}).status == "in_progress"
    cancelled = oai.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert oai.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # a synchronous response cannot be cancelled
        oai.responses.cancel(oai.responses.create(model=model, input="hi", max_output_tokens=2).id)


@pytest.mark.parametrize("extra, status, param", [
    ({"tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, 400, "tools"),
    ({"tool_choice": {"type": "function", "name": "missing"}, "tools": TOOLS}, 400, "tool_choice"),
    ({"max_output_tokens": -1}, 400, "max_output_tokens"),
    ({"temperature": -3.0}, 400, "temperature"),
    ({"top_logprobs": 3}, 400, "top_logprobs"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text"),
    ({"previous_response_id": "resp_nothing"}, 404, "previous_response_id"),
    ({"background": True, "stream": True}, 400, "background"),
    ({"model": "no-such-model"}, 404, "model"),
])
def test_errors_name_the_responses_field(oai, model, extra, status, param):
    body = {"model": model, "input": "hi", "max_output_tokens": 2} | extra
    with pytest.raises(openai.APIStatusError) as e:
        oai.post("/responses", body=body, cast_to=object)
    assert e.value.status_code == status and e.value.body["param"] == param, e.value.body


def test_the_store_bounds_each_owner_and_expires():
    from noria.frontend.bridge.responses_schema import Response
    from noria.frontend.bridge.responses_store import ResponseStore, Stored, owner_of

    def stored(i: int) -> Stored:
        return Stored(response=Response(id=f"resp_{i}", created_at=0, model="m", output=[], status="completed",
                                        tools=[], tool_choice="none", parallel_tool_calls=True))

    a, b = owner_of("Bearer a"), owner_of("Bearer b")
    assert a != b and owner_of("") == ""
    store = ResponseStore(owner_entries=3, max_entries=5)
    store.put(b, stored(100))
    for i in range(6):
        store.put(a, stored(i))
    assert [i for i in range(6) if store.get(a, f"resp_{i}")] == [3, 4, 5]  # a's oldest went, not b's
    assert store.get(b, "resp_100") and store.get(a, "resp_100") is None
    for i in range(101, 105):
        store.put(b, stored(i))
    assert len(store) == 5 and store.get(a, "resp_3") is None  # overall bound: the oldest of anyone
    assert store.get(b, "resp_101") is None  # b is held to its own share too
    assert store.delete(a, "resp_104") is None and store.delete(b, "resp_104") is not None
    gone = ResponseStore(ttl=0.0)
    gone.put(a, stored(1))
    assert gone.get(a, "resp_1") is None and gone.bytes == 0

"""Structured output over the wire, against a live `noria serve`: the official `openai`
client (`response_format` json_schema / json_object on chat and completions,
vLLM's `guided_*` extras, `beta.chat.completions.parse` with a Pydantic model,
streams whose deltas concatenate to a valid document, 400s naming the problem),
and the ZMQ `generate` map spoken with plain zmq + msgpack."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import msgspec
import openai
import pydantic
import pytest
import zmq

from noria import Client, SamplingParams
from noria.protocol.client import Delta
from noria.protocol.structured import StructuredOutput
from tests.procs import serve_http

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 6},
                         "temp": {"type": "integer", "minimum": -40, "maximum": 50},
                         "rain": {"type": "boolean"}},
          "required": ["city", "temp", "rain"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "The weather as JSON, please."}]


@pytest.fixture(scope="module")
def served(demo_path):
    with serve_http("--num-kv-blocks", "256") as s:
        yield s


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def _fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_whole_and_streamed(oai, temperature):
    kw = dict(model="demo", messages=MESSAGES, max_tokens=200, temperature=temperature, seed=4,
              response_format=_fmt(SCHEMA))
    whole = oai.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # same seed, same document
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_json_object_and_guided_fields(oai):
    out = oai.completions.create(model="demo", prompt="Hi", max_tokens=300, temperature=0,
                                 extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].text), dict)
    out = oai.completions.create(model="demo", prompt="JSON:", max_tokens=200, n=3, temperature=1.0, seed=9,
                                 extra_body={"guided_json": SCHEMA})
    for c in out.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    out = oai.completions.create(model="demo", prompt="Phone:", max_tokens=40, temperature=1.0, seed=1,
                                 extra_body={"guided_regex": r"\+1 \d{3} \d{4}"})
    assert re.fullmatch(r"\+1 \d{3} \d{4}", out.choices[0].text)
    out = oai.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=20, temperature=1.0, n=4,
                                      extra_body={"guided_choice": ["sunny", "rainy", "snow"]})
    assert all(c.message.content in ("sunny", "rainy", "snow") for c in out.choices)
    out = oai.completions.create(model="demo", prompt="Sum:", max_tokens=40, temperature=1.0, seed=2,
                                 extra_body={"guided_grammar": 'start: N "+" N\nN: /[1-9][0-9]?/'})
    assert re.fullmatch(r"[1-9][0-9]?\+[1-9][0-9]?", out.choices[0].text)
    stream = oai.completions.create(model="demo", prompt="JSON:", max_tokens=200, temperature=0.8, seed=3,
                                    stream=True, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in stream if c.choices)), SCHEMA)


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=6)
    temp: int = pydantic.Field(ge=-40, le=50)
    sky: Literal["clear", "cloudy"]
    alerts: list[Literal["wind", "flood"]] = pydantic.Field(max_length=2)


def test_openai_beta_parse_with_a_pydantic_model(oai):
    for seed in range(3):
        done = oai.beta.chat.completions.parse(model="demo", messages=MESSAGES, max_tokens=200, temperature=1.0,
                                               seed=seed, response_format=Weather)
        msg = done.choices[0].message
        assert isinstance(msg.parsed, Weather)
        assert msg.parsed == Weather.model_validate_json(msg.content)


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema object"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a(b"}, None, "unclosed group"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, None, "nonsense"),
])
def test_bad_constraints_are_400s_naming_the_problem(oai, extra, param, words):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5, stream=stream, extra_body=extra)
        assert words in e.value.body["message"] and e.value.body["param"] == param


def test_zmq_generate_map_and_client_stream(served):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(served.address)
    try:
        sock.send(msgspec.msgpack.encode({"type": "generate", "request_id": "g1", "prompt": "JSON:", "max_tokens": 200,
                                          "temperature": 0.0, "structured_output": {"json": SCHEMA}}))
        sock.send(msgspec.msgpack.encode({"type": "generate", "request_id": "g2", "prompt": "x",
                                          "structured_output": {"regex": "(oops"}}))
        text, ends = "", {}
        while len(ends) < 2:
            assert sock.poll(60_000), "no answer"
            msg = msgspec.msgpack.decode(sock.recv())
            if msg["type"] == "delta":
                text += msg["text"]
            elif msg["type"] in ("done", "error"):
                ends[msg["request_id"]] = msg
    finally:
        sock.close(0)
        ctx.term()
    assert ends["g1"]["type"] == "done" and ends["g1"]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert ends["g2"]["type"] == "error" and ends["g2"]["code"] == "invalid_grammar"
    with Client(served.address) as client:
        params = SamplingParams(max_tokens=200, temperature=1.0, seed=8, structured_output=StructuredOutput(json=SCHEMA))
        streamed = "".join(d.text for d in client.stream("JSON:", params) if isinstance(d, Delta))
        assert streamed == client.generate("JSON:", params).outputs[0].text
    jsonschema.validate(json.loads(streamed), SCHEMA)

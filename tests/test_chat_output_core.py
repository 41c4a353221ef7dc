"""FrontendCore with tools and reasoning, in one process, the engine scripted: the tokens a
model would sample go in as engine updates, and the messages out must carry the content,
the reasoning and the calls, streamed and not (`stream=False` detokenizes once at the end),
with finish_reason "tool_calls", n > 1 each sample on its own; mistral's `[TOOL_CALLS]`
(a special token) is read while EOS stays out of the text."""

from __future__ import annotations

import copy

import pytest

from noria.frontend.chat_output import ChatConfig
from noria.frontend.core import FrontendCore
from noria.frontend.inputs import make_generate
from noria.frontend.outputs import OutputBuilder
from noria.frontend.processor import InputProcessor
from noria.protocol.client import Delta, Done, Error
from noria.protocol.engine import EngineOutputs, EngineRequest, RequestUpdate
from noria.protocol.sampling import SamplingParams

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "Weather?"}]


class ScriptedEngine:
    def __init__(self) -> None:
        self.sent: list[EngineRequest] = []

    def add(self, req: EngineRequest) -> None:
        self.sent.append(req)

    def abort(self, req_ids: list[int]) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(demo_tokenizer):
    tok = copy.deepcopy(demo_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    return tok


def run(tokenizer, config: ChatConfig, text: str, *, stream: bool, n: int = 1, tool_choice=None,
        special: str = ""):
    engine = ScriptedEngine()
    eos = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    core = FrontendCore(engine, InputProcessor(tokenizer, [eos], len(tokenizer), 1024),  # type: ignore[arg-type]
                        chat=config)
    out = OutputBuilder("r", None, n)
    msgs: list = []

    def sink(m) -> None:
        msgs.append(m)
        out.add(m)

    core.submit("r", make_generate("r", None, SamplingParams(n=n, max_tokens=200), messages=MESSAGES, tools=TOOLS,
                                   tool_choice=tool_choice), sink, stream=stream)
    assert not any(isinstance(m, Error) for m in msgs), msgs
    ids = ([tokenizer.convert_tokens_to_ids(special)] if special else []) + \
        tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
    req = engine.sent[0]
    rids = [req.req_id] + [s.req_id for s in req.more_samples]
    for k, t in enumerate(ids):  # one token per step, every sample the same
        last = k == len(ids) - 1
        core.on_outputs(EngineOutputs([RequestUpdate(r, [t], "stop" if last else None) for r in rids]))
    assert isinstance(msgs[-1], Done)
    return out.output(), msgs


@pytest.mark.parametrize("stream", [True, False])
def test_hermes_calls_content_and_reasoning(tokenizer, stream):
    config = ChatConfig(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    text = '<think>Look it up.</think>Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    out, msgs = run(tokenizer, config, text, stream=stream, n=2)
    for sample in out.outputs:
        assert sample.finish_reason == "tool_calls" and sample.text == "Sure. "
        assert sample.reasoning_content == "Look it up."
        (call,) = sample.tool_calls
        assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Oslo"}'
        assert call.id.startswith("call_")
    done = msgs[-1]
    assert done.finish_reasons == ["tool_calls", "tool_calls"] and done.tool_calls[0][0].id != done.tool_calls[1][0].id
    pieces = [tc for m in msgs if isinstance(m, Delta) and m.index == 0 for tc in m.tool_calls or []]
    assert pieces[0].id == done.tool_calls[0][0].id and pieces[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in pieces) == '{"city": "Oslo"}'
    if stream:  # a delta per token: the arguments came in more than one piece
        assert len(pieces) > 2


def test_mistral_reads_its_special_token_and_leaves_eos_out(tokenizer):
    config = ChatConfig(enable_auto_tool_choice=True, tool_call_parser="mistral")
    out, _ = run(tokenizer, config, '[{"name": "get_weather", "arguments": {"a": 1}}]', stream=True,
                 special="[TOOL_CALLS]")
    sample = out.outputs[0]
    assert sample.text == "" and sample.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in sample.tool_calls] == [("get_weather", '{"a": 1}')]
    plain, _ = run(tokenizer, config, "No call here.", stream=True)
    assert plain.outputs[0].text == "No call here." and plain.outputs[0].finish_reason == "stop"


def test_required_and_named_make_a_grammar_and_read_it_back(tokenizer):
    engine = ScriptedEngine()
    core = FrontendCore(engine, InputProcessor(tokenizer, [1], len(tokenizer), 1024))  # type: ignore[arg-type]
    core.submit("a", make_generate("a", None, SamplingParams(max_tokens=50), messages=MESSAGES, tools=TOOLS,
                                   tool_choice="required"), lambda m: None)
    schema = engine.sent[0].params.structured_output.json
    assert schema["type"] == "array" and schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    out, _ = run(tokenizer, ChatConfig(), '[{"name":"get_weather","arguments":{"x":1}}]', stream=False,
                 tool_choice="required")
    assert out.outputs[0].tool_calls[0].function.arguments == '{"x":1}' and out.outputs[0].text == ""
    out, _ = run(tokenizer, ChatConfig(), '{"x":2}', stream=True,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [(c.function.name, c.function.arguments) for c in out.outputs[0].tool_calls] == [("get_weather", '{"x":2}')]

"""Reasoning with constrained output against a live `noria serve --reasoning-parser
deepseek_r1`, on the demo model with `<think>` and `</think>` added to its vocabulary as
single tokens (as reasoning models have them): the grammar of `response_format` or of
tool_choice "required" holds only after `</think>` (vLLM's way), so the reasoning is free
text and the content after it validates.

The model is random: `allowed_token_ids` keeps it to single characters and `</think>`,
so that it ends its reasoning after some tokens; without the grammar waiting, the answer
would be JSON from its first token, `</think>` could never come, and the whole answer
would be reasoning."""

from __future__ import annotations

import json
import shutil

import jsonschema
import numpy as np
import openai
import pytest

from noria import Client, SamplingParams
from noria.protocol.structured import StructuredOutput
from tests.procs import serve_http

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
MESSAGES = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def think_model(demo_path, tmp_path_factory):
    from safetensors.numpy import load_file, save_file
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("think-model") / "m"
    shutil.copytree(demo_path, path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    grow = len(tok) - config["vocab_size"]
    assert grow == 2
    weights = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(0)
    for name, scale in (("model.embed_tokens.weight", 0.02), ("lm_head.weight", 0.5)):
        w = weights[name]
        weights[name] = np.concatenate([w, (rng.standard_normal((grow, w.shape[1])) * scale).astype(w.dtype)])
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config["vocab_size"] = len(tok)
    (path / "config.json").write_text(json.dumps(config))
    return path, tok


@pytest.fixture(scope="module")
def served(think_model):
    with serve_http("--model", str(think_model[0]), "--num-kv-blocks", "256", "--reasoning-parser",
                    "deepseek_r1") as s:
        yield s


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def _allowed(tok) -> list[int]:
    """Single printable characters (no space: byte-level BPE spells it otherwise) and `</think>`."""
    ids = {tok.convert_tokens_to_ids(ch) for ch in map(chr, range(33, 127))}
    return sorted(ids | {tok.convert_tokens_to_ids("</think>")})


def test_the_grammar_holds_after_the_reasoning(served, oai, think_model):
    path, tok = think_model
    kw = dict(model=str(path), messages=MESSAGES, max_tokens=1500, temperature=1.0, seed=4,
              response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
              extra_body={"allowed_token_ids": _allowed(tok), "logit_bias": {str(tok.convert_tokens_to_ids("</think>")): 3}})
    out = oai.chat.completions.create(**kw).choices[0]
    thought = out.message.model_extra["reasoning_content"]
    assert out.finish_reason == "stop" and thought and "</think>" not in thought
    jsonschema.validate(json.loads(out.message.content), SCHEMA)
    with pytest.raises(ValueError):
        json.loads(thought)  # free text: the grammar did not hold over it
    chunks = [c for c in oai.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks) == thought
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.message.content


def test_required_tool_calls_after_the_reasoning(served, think_model):
    path, tok = think_model
    with Client(served.address, timeout=120) as client:
        # Inside the grammar llguidance allows only the canonical tokens of a forced text ("add"),
        # so here every token but the special ones may come (EOS would end the reasoning).
        params = SamplingParams(max_tokens=1500, temperature=1.0, seed=1,
                                allowed_token_ids=[t for t in range(5, len(tok))],  # not the five special tokens
                                logit_bias={tok.convert_tokens_to_ids("</think>"): 6.0})
        for seed in range(3):
            out = client.chat(MESSAGES, SamplingParams(**{**_fields(params), "seed": seed}), tools=TOOLS,
                              tool_choice="required").outputs[0]
            assert out.finish_reason == "tool_calls" and out.reasoning_content and out.text == ""
            for call in out.tool_calls:
                assert call.function.name == "add"
                jsonschema.validate(json.loads(call.function.arguments), ADD)
        # Structured output over ZMQ as well, and a request without a constraint: all reasoning
        # until `</think>`, then content.
        out = client.chat(MESSAGES, SamplingParams(**{**_fields(params), "structured_output": StructuredOutput(
            json=SCHEMA)})).outputs[0]
        jsonschema.validate(json.loads(out.text), SCHEMA)
        free = client.chat(MESSAGES, params).outputs[0]
        assert free.reasoning_content is not None and "</think>" not in free.reasoning_content


def _fields(p: SamplingParams) -> dict:
    import msgspec

    return msgspec.structs.asdict(p)

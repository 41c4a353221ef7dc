"""Structured output through the offline engine (demo model, random weights).

The text is gibberish, so these prove the constraint, not the content: every
output parses and validates against its schema (jsonschema, an independent
validator), matches its regex (Python's `re`), is one of the choices; the mask
composes with the sampling features; greedy output under a constraint is the
same with preemption (recompute and swap) and chunked prefill as without.
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from noria import LLM, SamplingParams
from noria.protocol.errors import NoriaError
from noria.protocol.structured import StructuredOutput

NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)


def _leaf() -> st.SearchStrategy[dict]:
    # Bounded sizes: a random model never chooses to close a string or an array.
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5)),
        st.builds(lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w},
                  st.integers(-1000, 1000), st.integers(0, 5000)),
        # multipleOf bounds the fraction's digits, which a random model never stops writing.
        st.builds(lambda lo, w, q: {"type": "number", "minimum": lo, "maximum": lo + w, "multipleOf": q},
                  st.integers(-50, 50), st.integers(1, 100), st.sampled_from([0.5, 0.25, 0.125])),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(lambda vs: {"enum": vs}, st.lists(st.one_of(NAME, st.integers(-9, 99), st.booleans()),
                                                     min_size=1, max_size=4, unique=True)),
    )


def _schema(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    obj = st.builds(
        lambda props, req_mask: {
            "type": "object",
            "properties": props,
            # Optional fields: only those picked by the mask are required.
            "required": [k for k, r in zip(props, req_mask, strict=False) if r],
            "additionalProperties": False,
        },
        st.dictionaries(NAME, children, min_size=1, max_size=4),
        st.lists(st.booleans(), min_size=4, max_size=4),
    )
    arr = st.builds(lambda items, hi: {"type": "array", "items": items, "maxItems": hi}, children, st.integers(0, 3))
    return st.one_of(obj, arr)


SCHEMAS = st.recursive(_leaf(), _schema, max_leaves=8).filter(lambda s: s.get("type") in ("object", "array"))

SAMPLING = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.7, 1.0, 1.5]),
    "top_p": st.sampled_from([1.0, 0.9, 0.5]),
    "top_k": st.sampled_from([0, 5, 50]),
    "min_p": st.sampled_from([0.0, 0.05]),
    "presence_penalty": st.sampled_from([0.0, 0.5]),
    "repetition_penalty": st.sampled_from([1.0, 1.3]),
    "seed": st.one_of(st.none(), st.integers(0, 2**32)),
})


@pytest.fixture(scope="module")
def llm(demo_path):
    with LLM("demo", num_kv_blocks=512, dtype="float32") as engine:
        yield engine


def _one(llm: LLM, so: StructuredOutput, prompt: str = "Write JSON:", **kw):
    out = llm.generate([prompt], SamplingParams(structured_output=so, max_tokens=kw.pop("max_tokens", 400), **kw),
                       use_tqdm=False)[0]
    return out.outputs[0]


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(schema=SCHEMAS, sampling=SAMPLING)
def test_json_schemas_drawn_by_hypothesis(llm, schema, sampling):
    out = _one(llm, StructuredOutput(json=schema), **sampling)
    assert out.finish_reason == "stop", (schema, out.text)
    jsonschema.validate(json.loads(out.text), schema)


REGEXES = [r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no)( sir)?", r"[A-F0-9]{8}", r"a+b*c?"]


@pytest.mark.parametrize("regex", REGEXES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex(llm, regex, temperature):
    out = _one(llm, StructuredOutput(regex=regex), temperature=temperature, seed=7, max_tokens=60)
    assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text


def test_choice_with_n_samples_and_logprobs(llm):
    choices = ["yes", "no", "maybe so", 'a "quoted" one', "naïve"]
    outs = llm.generate(["Pick one:"], SamplingParams(n=8, temperature=1.5, seed=3, logprobs=5, max_tokens=20,
                                                        structured_output=StructuredOutput(choice=choices)),
                        use_tqdm=False)[0].outputs
    assert len(outs) == 8
    tok = llm.tokenizer
    for o in outs:
        assert o.finish_reason == "stop" and o.text in choices
        prefix: list[int] = []
        for lp in o.logprobs:
            # Every token the distribution allows keeps the text a prefix of some choice:
            # the logprobs are those of the constrained distribution.
            for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True):
                if math.isfinite(v):
                    text = tok.decode(prefix + [t])
                    assert any(c.startswith(text) for c in choices), text
            prefix.append(lp.token_id)


def test_grammars_lark_gbnf_and_json_object(llm):
    lark = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]{1,2}/'
    out = _one(llm, StructuredOutput(grammar=lark), temperature=1.0, seed=1, max_tokens=80)
    assert out.finish_reason == "stop" and re.fullmatch(r"[0-9()+*]+", out.text), out.text
    assert out.text.count("(") == out.text.count(")")
    gbnf = 'root ::= "x" [0-9] [0-9]? ("," "y")?'
    out = _one(llm, StructuredOutput(grammar=gbnf), temperature=1.0, seed=2, max_tokens=20)
    assert out.finish_reason == "stop" and re.fullmatch(r"x[0-9]{1,2}(,y)?", out.text), out.text
    out = _one(llm, StructuredOutput(json_object=True), "Hi", temperature=0.0, max_tokens=400)
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


def test_stop_strings_min_tokens_and_ignore_eos_compose(llm):
    regex = r"[a-c]{2,30}"
    out = _one(llm, StructuredOutput(regex=regex), temperature=1.0, seed=5, min_tokens=4, ignore_eos=True)
    assert out.finish_reason == "stop" and re.fullmatch(regex, out.text) and len(out.token_ids) >= 2
    out = _one(llm, StructuredOutput(regex=r"(ab|ba){20}"), temperature=1.0, seed=5, stop=["ba"], max_tokens=60)
    assert out.finish_reason == "stop" and "ba" not in out.text and re.fullmatch(r"(ab)*a?", out.text), out.text


def test_a_grammar_that_does_not_compile_is_a_clear_error_and_the_engine_serves_on(llm):
    for so, words in [(StructuredOutput(regex="a(b"), "unclosed group"),
                      (StructuredOutput(json={"type": "nonsense"}), "nonsense"),
                      (StructuredOutput(grammar="start: missing_rule"), "missing_rule")]:
        with pytest.raises(NoriaError) as e:
            _one(llm, so)
        assert e.value.code == "invalid_grammar" and words in e.value.message
    with pytest.raises(NoriaError) as e:
        _one(llm, StructuredOutput(regex="a", choice=["b"]))
    assert e.value.code == "invalid_request" and "exactly one" in e.value.message
    assert _one(llm, StructuredOutput(choice=["ok"])).text == "ok"


SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                    "maxItems": 3},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "tags", "ok"], "additionalProperties": False}
LONG = "a prompt that spans several blocks of sixteen tokens, so that prefill is chunked " * 2


def _batch(**flags) -> tuple[list[list[int]], object]:
    prompts = [f"{i} {LONG}" if i % 3 == 0 else f"request {i}:" for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=120,
                             structured_output=StructuredOutput(json=SCHEMA) if i % 2 else
                             StructuredOutput(regex=r"[a-z ]{10,40}\.")) for i in range(12)]
    with LLM("demo", dtype="float32", **flags) as engine:
        outs = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.stats()
    for i, o in enumerate(outs):
        assert o.outputs[0].finish_reason == "stop"
        if i % 2:
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        else:
            assert re.fullmatch(r"[a-z ]{10,40}\.", o.outputs[0].text)
    return [o.outputs[0].token_ids for o in outs], stats


def test_greedy_output_is_the_same_across_preemption_swap_and_chunked_prefill(demo_path):
    reference, _ = _batch(num_kv_blocks=512, enable_prefix_caching=False)
    recompute, s = _batch(num_kv_blocks=14, preemption_mode="recompute", enable_prefix_caching=False)
    assert s.num_preemptions > 0 and recompute == reference
    swapped, s = _batch(num_kv_blocks=14, preemption_mode="swap", swap_space=0.01, enable_prefix_caching=False)
    assert s.num_swap_outs > 0 and swapped == reference
    chunked, _ = _batch(num_kv_blocks=512, max_num_batched_tokens=24, enable_chunked_prefill=True)
    assert chunked == reference

"""Tokenization, incremental detokenization and stop strings, against the tokenizer itself."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from noria.frontend.detokenizer import IncrementalDetokenizer, StopStrings
from noria.frontend.processor import InputProcessor, eos_token_ids
from noria.protocol.client import Generate
from noria.protocol.errors import NoriaError

TEXTS = [
    "Hello, world! How are you today?",
    " The mill grinds grain; 東京 and 你好 and café, naïve 🙂 ✓ done.",
    "Numbers: 3.14159 and 2026\n\nnew lines\ttabs",
]


def _stream(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    parts = []
    for t in ids:
        det.add([t])
        parts.append(det.take(final=False))
        if det.stopped:
            break
    parts.append(det.take(final=True))
    return parts


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_decoded_text_and_never_splits_characters(demo_tokenizer, text):
    prompt = demo_tokenizer("Once upon a time")["input_ids"]
    out = demo_tokenizer(text, add_special_tokens=False)["input_ids"]
    parts = _stream(IncrementalDetokenizer(demo_tokenizer, prompt, None), out)
    assert "".join(parts) == demo_tokenizer.decode(out) == text
    assert not any("\ufffd" in p for p in parts)


def test_multibyte_characters_span_tokens_in_this_tokenizer(demo_tokenizer):
    # Guards the test above: some character must really be split across tokens.
    ids = demo_tokenizer("🙂 ✓ Привет", add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in demo_tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize(
    "stop, expected",
    [(["world"], "Hello, "), (["How", "!"], "Hello, world"), (["zzz"], TEXTS[0]), (["today?"], "Hello, world! How are you ")],
)
def test_stop_strings_truncate_and_are_never_partly_streamed(demo_tokenizer, stop, expected):
    out = demo_tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    det = IncrementalDetokenizer(demo_tokenizer, [0], stop)
    parts = _stream(det, out)
    assert "".join(parts) == expected
    assert det.stopped == (expected != TEXTS[0])
    sent = ""
    for p in parts[:-1]:
        sent += p
        assert all(s not in sent for s in stop)


def _first_stop(text: str, start: int, stop: list[str]) -> int:
    """The reference: the earliest of each stop string's first occurrence from `start`."""
    hits = [i for i in (text.find(s, start) for s in stop) if i != -1]
    return min(hits, default=-1)


@given(st.lists(st.text("ab c", min_size=1, max_size=6), min_size=1, max_size=12), st.lists(st.text("ab c", max_size=5),
       max_size=12))
@settings(max_examples=300, deadline=None)
def test_indexed_stop_strings_find_what_searching_each_finds(stop, chunks):
    index = StopStrings(stop)
    hold = max(map(len, stop)) - 1
    text = ""
    for chunk in chunks:
        new_from = len(text)
        text += chunk
        want = _first_stop(text, max(0, new_from - hold), stop)
        assert index.first_hit(text, new_from) == want
        if want != -1:
            break


def test_thousands_of_stop_strings_are_indexed_once_for_every_sample(demo_tokenizer):
    stop = [f"zq{i}" for i in range(20_000)] + ["world"]
    index = StopStrings(stop)
    out = demo_tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    samples = [IncrementalDetokenizer(demo_tokenizer, [0], index) for _ in range(3)]
    assert all("".join(_stream(det, out)) == "Hello, " for det in samples)


@pytest.fixture
def processor(demo_path, demo_tokenizer):
    return InputProcessor(demo_tokenizer, eos_token_ids(str(demo_path), demo_tokenizer), len(demo_tokenizer), 64)


def test_eos_ids_come_from_generation_config(demo_path, demo_tokenizer):
    assert eos_token_ids(str(demo_path), demo_tokenizer) == [1, 4]


def test_prompt_and_chat_tokenize(processor, demo_tokenizer):
    ids, params = processor.process(Generate(request_id="a", prompt="Hello", max_tokens=3))
    assert ids == demo_tokenizer("Hello")["input_ids"] and params.max_tokens == 3
    ids, _ = processor.process(Generate(request_id="b", messages=[{"role": "user", "content": "Hi"}]))
    text = demo_tokenizer.decode(ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user") and text.count("<|begin_of_text|>") == 1
    assert text.endswith("assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize(
    "msg, code, words",
    [
        (Generate(request_id="a", prompt=""), "invalid_request", "empty"),
        (Generate(request_id="a"), "invalid_request", "exactly one"),
        (Generate(request_id="a", prompt="x", prompt_token_ids=[1]), "invalid_request", "exactly one"),
        (Generate(request_id="a", prompt_token_ids=[5, 100000]), "invalid_request", "vocabulary"),
        (Generate(request_id="a", prompt="x " * 200), "prompt_too_long", "max_model_len"),
        (Generate(request_id="a", prompt="x", temperature=-1.0), "invalid_request", "temperature"),
        (Generate(request_id="a", messages=[{"content": "x"}]), "invalid_request", "role"),
        (Generate(request_id="", prompt="x"), "invalid_request", "request_id"),
    ],
)
def test_bad_input_is_named(processor, msg, code, words):
    with pytest.raises(NoriaError) as e:
        processor.process(msg)
    assert e.value.code == code and words in e.value.message


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(5, 700), min_size=1, max_size=30), prompt=st.sampled_from(TEXTS))
def test_any_token_sequence_streams_to_its_full_decode(demo_tokenizer, ids, prompt):
    # Random ids include lone bytes of multi-byte characters that never complete.
    p = demo_tokenizer(prompt)["input_ids"]
    parts = _stream(IncrementalDetokenizer(demo_tokenizer, p, None), ids)
    assert "".join(parts) == demo_tokenizer.decode(ids, skip_special_tokens=True)


def test_engine_params_hold_bad_words_as_ids_and_are_capped(processor, demo_tokenizer, monkeypatch):
    import noria.frontend.processor as processor_module
    from noria.protocol.sampling import SamplingParams

    e = processor.engine_params(SamplingParams(bad_words=["little"], stop=["never sent on"]))
    assert e.bad_words_token_ids == [demo_tokenizer.encode("little", add_special_tokens=False)]
    monkeypatch.setattr(processor_module, "MAX_ENGINE_PARAMS_BYTES", 100)
    processor.engine_params(SamplingParams(allowed_token_ids=[1, 2]))
    with pytest.raises(NoriaError, match="bytes in the engine"):
        processor.engine_params(SamplingParams(allowed_token_ids=list(range(60))))

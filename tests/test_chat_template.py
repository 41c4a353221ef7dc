"""Chat template controls in the frontend (no engine): `chat_template_kwargs`, a request's own
`chat_template`, the server's `--chat-template`, `add_generation_prompt` and
`continue_final_message`, each compared with transformers' own `apply_chat_template`; hostile
templates (sandbox, deadline, size cap, trust flag) cost their request only; `tokenize` and
`detokenize` against the tokenizer itself."""

from __future__ import annotations

import sys

import pytest

from noria.frontend.chat_template import RENDER_SECONDS, load_chat_template, within
from noria.frontend.processor import InputLimits, InputProcessor
from noria.protocol.client import Detokenize, Generate, Tokenize
from noria.protocol.errors import ErrorCode, NoriaError

# A template in the style of Qwen3's: a kwarg turns the thinking block on and off.
THINKING = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
CHAT = [{"role": "user", "content": "Hello there"}]
PARTIAL = [{"role": "user", "content": "Finish this"}, {"role": "assistant", "content": "The river runs"}]


@pytest.fixture(scope="module")
def tok(demo_tokenizer):
    return demo_tokenizer


def _processor(tok, **kw) -> InputProcessor:
    return InputProcessor(tok, [1], len(tok), 2048, **kw)


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _generate(**fields) -> Generate:
    return Generate(request_id="r", max_tokens=4, **fields)


def _refused(fn, param: str, code: str = ErrorCode.INVALID_REQUEST) -> NoriaError:
    with pytest.raises(NoriaError) as info:
        fn()
    assert info.value.param == param and info.value.code == code, (info.value.param, info.value.message)
    return info.value


def test_kwargs_reach_the_servers_template_as_transformers_renders_them(tok):
    p = _processor(tok, chat_template=THINKING)
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, None):
        got = p.tokenize(_generate(messages=CHAT, chat_template_kwargs=kwargs))
        ref = tok.apply_chat_template(CHAT, chat_template=THINKING, tokenize=False, add_generation_prompt=True,
                                      **(kwargs or {}))
        assert got == _ids(tok, ref)
    off = p.render(_generate(messages=CHAT, chat_template_kwargs={"enable_thinking": False}))
    on = p.render(_generate(messages=CHAT, chat_template_kwargs={"enable_thinking": True}))
    # Written out by hand too: the kwarg is what adds the empty thinking block.
    assert off == on + "<think>\n\n</think>\n\n"
    assert on == "<|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|>" \
                 "<|start_header_id|>assistant<|end_header_id|>\n\n"


def test_the_server_template_replaces_the_tokenizers(tok):
    own = _processor(tok)
    server = _processor(tok, chat_template=THINKING)
    msg = _generate(messages=CHAT)
    assert own.tokenize(msg) == _ids(tok, tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
    assert server.tokenize(msg) == _ids(tok, tok.apply_chat_template(CHAT, chat_template=THINKING, tokenize=False,
                                                                     add_generation_prompt=True))
    assert own.tokenize(msg) != server.tokenize(msg)  # the demo's template starts with BOS, THINKING does not


def test_a_request_template_needs_the_trust_flag_and_fits_the_cap(tok):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    msg = _generate(messages=CHAT, chat_template=template)
    err = _refused(lambda: _processor(tok).tokenize(msg), "chat_template")
    assert "--trust-request-chat-template" in err.message
    # The same template handed over inside chat_template_kwargs (vLLM's merge) is no way around it.
    _refused(lambda: _processor(tok).tokenize(_generate(messages=CHAT, chat_template_kwargs={"chat_template": template})),
             "chat_template")
    trusted = _processor(tok, trust_request_chat_template=True)
    assert trusted.tokenize(msg) == _ids(tok, "[user] Hello there\n")
    assert trusted.tokenize(_generate(messages=CHAT, chat_template_kwargs={"chat_template": template})) == \
        _ids(tok, "[user] Hello there\n")
    small = _processor(tok, trust_request_chat_template=True, limits=InputLimits(max_chat_template_chars=20))
    err = _refused(lambda: small.process(msg), "chat_template")
    assert "20" in err.message


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_add_generation_prompt_reaches_the_template(tok, generation_prompt):
    got = _processor(tok).tokenize(_generate(messages=CHAT, add_generation_prompt=generation_prompt))
    ref = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=generation_prompt)
    assert got == _ids(tok, ref)


def test_continue_final_message_leaves_the_last_message_open(tok):
    p = _processor(tok)
    got = p.render(_generate(messages=PARTIAL, add_generation_prompt=False, continue_final_message=True))
    assert got == tok.apply_chat_template(PARTIAL, tokenize=False, continue_final_message=True)
    assert got.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nThe river runs")
    closed = p.render(_generate(messages=PARTIAL, add_generation_prompt=False))
    assert closed == got + "<|eot_id|>"
    # Both at once is vLLM's 400, naming continue_final_message.
    _refused(lambda: p.tokenize(_generate(messages=PARTIAL, continue_final_message=True)), "continue_final_message")
    # The kwargs may set the switches too (vLLM merges them over the fields).
    assert p.render(_generate(messages=PARTIAL, chat_template_kwargs={
        "add_generation_prompt": False, "continue_final_message": True})) == got


@pytest.mark.parametrize("template, words", [
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{% if %}", "failed"),
    ("{{ messages | no_such_filter }}", "no_such_filter"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),  # the sandbox, as transformers runs it
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
])
def test_a_template_that_fails_costs_its_request_only(tok, template, words):
    p = _processor(tok, trust_request_chat_template=True)
    err = _refused(lambda: p.tokenize(_generate(messages=CHAT, chat_template=template)), "chat_template")
    assert words in err.message
    assert p.tokenize(_generate(messages=CHAT)) == _ids(tok, tok.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True))


def test_the_models_template_failing_names_messages(tok):
    p = _processor(tok, chat_template="{{ raise_exception('no system role') }}")
    err = _refused(lambda: p.tokenize(_generate(messages=CHAT)), "messages")
    assert "no system role" in err.message


def test_a_template_that_loops_forever_is_stopped_at_its_deadline(tok):
    p = _processor(tok, trust_request_chat_template=True)
    # Loops over a variable, not a call: only the trace of the template's own lines can stop it
    # (10^15 iterations, hours of work).
    spin = "{% set x = range(100000) | list %}{% for a in x %}{% for b in x %}{% for c in x %}{% endfor %}" \
           "{% endfor %}{% endfor %}"
    before = sys.gettrace()
    err = _refused(lambda: p.tokenize(_generate(messages=CHAT, chat_template=spin)), "chat_template")
    assert f"more than {RENDER_SECONDS:g}s" in err.message
    assert sys.gettrace() is before  # the thread's own tracer is back


def test_within_restores_a_tracer_and_passes_results_through():
    seen: list[str] = []

    def tracer(frame, event, arg):
        seen.append(event)
        return None

    sys.settrace(tracer)
    try:
        assert within(5.0, lambda: "done") == "done"
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def test_a_rendered_prompt_past_the_character_limit_is_too_long(tok):
    p = _processor(tok, chat_template="{% for i in range(1000) %}{{ messages[0]['content'] }}{% endfor %}",
                   limits=InputLimits(max_prompt_chars=5000))
    _refused(lambda: p.tokenize(_generate(messages=CHAT)), "messages", ErrorCode.PROMPT_TOO_LONG)


@pytest.mark.parametrize("key", ["tokenize", "return_tensors", "padding", "documents"])
def test_kwargs_may_not_change_the_render_call(tok, key):
    _refused(lambda: _processor(tok).tokenize(_generate(messages=CHAT, chat_template_kwargs={key: True})),
             "chat_template_kwargs")


def test_kwargs_count_towards_the_size_limit(tok):
    p = _processor(tok, limits=InputLimits(max_prompt_chars=1000))
    _refused(lambda: p.process(_generate(messages=CHAT, chat_template_kwargs={"pad": "x" * 2000})), "messages",
             ErrorCode.PROMPT_TOO_LONG)


def test_load_chat_template_reads_a_file_or_takes_the_template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(THINKING)
    assert load_chat_template(str(path)) == THINKING
    # Inline, with a shell user's "\n" read as a newline (vLLM's reading).
    assert load_chat_template("{{ messages[0]['content'] }}\\n") == "{{ messages[0]['content'] }}\n"
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    assert load_chat_template(None) is None


# ---- tokenize / detokenize ------------------------------------------------------------------


def test_tokenize_a_prompt_as_the_tokenizer_does(tok):
    p = _processor(tok)
    text = "Unicode: café, 東京 🙂 and the river"
    out = p.tokenize_request(Tokenize(request_id="t", prompt=text))
    assert out.tokens == tok(text)["input_ids"] and out.count == len(out.tokens) and out.max_model_len == 2048
    assert out.tokens[0] == tok.bos_token_id and out.token_strs is None
    bare = p.tokenize_request(Tokenize(request_id="t", prompt=text, add_special_tokens=False, return_token_strs=True))
    assert bare.tokens == out.tokens[1:]
    assert bare.token_strs == tok.convert_ids_to_tokens(bare.tokens)


def test_tokenize_messages_as_the_template_renders_them(tok):
    p = _processor(tok, chat_template=THINKING)
    out = p.tokenize_request(Tokenize(request_id="t", messages=CHAT, chat_template_kwargs={"enable_thinking": False}))
    ref = tok.apply_chat_template(CHAT, chat_template=THINKING, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert out.tokens == _ids(tok, ref)  # no BOS added: the template writes what it wants
    # The same prompt a generate request gets.
    assert out.tokens == p.tokenize(_generate(messages=CHAT, chat_template_kwargs={"enable_thinking": False}))


def test_tokenize_refusals_name_the_field(tok):
    p = _processor(tok, limits=InputLimits(max_prompt_chars=100))
    _refused(lambda: p.tokenize_request(Tokenize(request_id="t", prompt="x" * 101)), "prompt",
             ErrorCode.PROMPT_TOO_LONG)
    with pytest.raises(NoriaError, match="exactly one"):
        p.tokenize_request(Tokenize(request_id="t"))
    _refused(lambda: p.tokenize_request(Tokenize(request_id="t", messages=CHAT, chat_template="x")), "chat_template")


def test_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary(tok):
    p = _processor(tok)
    text = "Привет, 東京 🙂"
    ids = tok(text)["input_ids"]
    assert p.detokenize(Detokenize(request_id="d", tokens=ids)).prompt == tok.decode(ids)
    assert tok.decode(ids).endswith(text)
    for bad in (-1, len(tok), 2**40):
        err = _refused(lambda b=bad: p.detokenize(Detokenize(request_id="d", tokens=[5, b])), "tokens")
        assert str(bad) in err.message


def test_tokenize_stops_a_template_that_loops_forever_too(tok):
    p = _processor(tok, trust_request_chat_template=True)
    spin = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    err = _refused(lambda: p.tokenize_request(Tokenize(request_id="t", messages=CHAT, chat_template=spin)),
                   "chat_template")
    assert f"more than {RENDER_SECONDS:g}s" in err.message

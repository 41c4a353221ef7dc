"""The bridge's HTTP side against a live `noria serve`, spoken to by the official
`openai` package: completions and chat (whole and streamed), n, stop, seed,
logprobs, usage, errors with OpenAI's shape and status, `--api-key`, a bridge
whose engine is gone (503), /metrics, and a client hanging up mid-generation."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from http.client import HTTPConnection

import msgspec
import openai
import pytest

from noria.protocol.sockets import free_tcp_port
from tests.procs import engine_idle, scrape_metrics, serve_http, wait_http, wait_metrics


@pytest.fixture(scope="module")
def served(demo_path):
    # Long enough that a 2000-token request is still running when the test hangs up.
    with serve_http("--num-kv-blocks", "256", "--max-model-len", "2048") as s:
        yield s


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


LONG = "A prompt long enough to fill several KV blocks of sixteen tokens each, and then some more. " * 3
BLOCK = 16  # the default --block-size


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def _get(url: str, **headers: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, msgspec.json.decode(r.read())
    except urllib.error.HTTPError as e:
        return e.code, msgspec.json.decode(e.read())


def test_models_and_health(served, oai):
    assert [m.id for m in oai.models.list().data] == ["demo"]
    status, body = _get(f"{served.http}/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == "demo"


def test_completion_stream_equals_whole_for_a_seed(oai):
    kw = dict(model="demo", prompt="The river", max_tokens=24, temperature=0.9, top_p=0.95, seed=11)
    whole = oai.completions.create(**kw)
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert whole.usage.completion_tokens <= 24 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # a short prompt: no whole block to cache
    assert _cached(whole.usage) == 0

    # Without include_usage the usage still comes, on the last finish chunk.
    plain = list(oai.completions.create(**kw, stream=True))
    assert plain[-1].choices[0].finish_reason and plain[-1].usage == whole.usage


def test_chat_stream_equals_whole_for_a_seed(oai):
    kw = dict(model="demo", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
              max_tokens=20, temperature=0.8, seed=5)
    whole = oai.chat.completions.create(**kw)
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert whole.usage.completion_tokens <= 20

    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    # The same counts, except that the repeat found the first one's prompt blocks in the prefix cache.
    usage = chunks[-1].usage
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == whole.usage.model_dump(exclude={"prompt_tokens_details"})
    assert _cached(whole.usage) == 0 and _cached(usage) == (usage.prompt_tokens - 1) // BLOCK * BLOCK


def test_n_batches_stop_and_max_tokens(oai):
    out = oai.completions.create(model="demo", prompt=["one", "two"], n=2, max_tokens=5, seed=1, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 4 * 5

    greedy = dict(model="demo", prompt="Once upon", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    text = oai.completions.create(**greedy).choices[0].text
    m = re.search(r"[A-Za-z]{2,}", text[4:])
    assert m, f"no word to stop at in {text!r}"
    stop = m.group(0)
    cut = oai.completions.create(**greedy, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]

    chat = oai.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], n=3,
                                       max_completion_tokens=4, seed=2, stream=True)
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chat if c.choices and c.choices[0].finish_reason}
    assert set(finished) == {0, 1, 2}


def test_logprobs(oai):
    out = oai.completions.create(model="demo", prompt="Hi", max_tokens=4, logprobs=2, temperature=0,
                                 extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert not any(t.startswith("token_id:") for t in lp.tokens)  # token texts (tests/test_chat_controls_api.py)
    for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert tok in top and 2 <= len(top) <= 3
    assert lp.text_offset == sorted(lp.text_offset)

    chat = oai.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       logprobs=True, top_logprobs=3, temperature=0, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    # Greedy: the sampled token is the most likely one.
    assert all(t.token == t.top_logprobs[0].token for t in content)


def test_usage_reports_prefix_cache_hits(oai):
    kw = dict(model="demo", prompt=LONG + "completions", max_tokens=2)
    first = oai.completions.create(**kw).usage
    second = oai.completions.create(**kw).usage
    assert first.prompt_tokens == second.prompt_tokens > 3 * BLOCK
    assert _cached(first) == 0
    # Every whole block before the last prompt token (whose logits are needed) was computed once already.
    assert _cached(second) == (second.prompt_tokens - 1) // BLOCK * BLOCK
    # A batch sums its prompts' hits, as it sums their prompt tokens.
    batch = oai.completions.create(model="demo", prompt=[LONG + "completions"] * 2, max_tokens=2).usage
    assert batch.prompt_tokens == 2 * second.prompt_tokens and _cached(batch) == 2 * _cached(second)

    chat = dict(model="demo", messages=[{"role": "user", "content": LONG + "chat"}], max_tokens=2)
    oai.chat.completions.create(**chat)
    chunks = list(oai.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens > 3 * BLOCK and _cached(usage) == (usage.prompt_tokens - 1) // BLOCK * BLOCK


def test_no_prefix_caching_reports_no_cached_tokens(demo_path):
    with (serve_http("--no-enable-prefix-caching", "--num-kv-blocks", "64", "--max-model-len", "256") as s,
          openai.OpenAI(base_url=f"{s.http}/v1", api_key="none", max_retries=0, timeout=60) as c):
        usages = [c.completions.create(model="demo", prompt=LONG, max_tokens=2).usage for _ in range(2)]
    assert usages[0].prompt_tokens > 3 * BLOCK and [_cached(u) for u in usages] == [0, 0]


@pytest.mark.parametrize(
    "kw, status, param",
    [
        (dict(top_p=2.0), 400, "top_p"),
        (dict(temperature=-1), 400, "temperature"),
        (dict(max_tokens=0), 400, "max_tokens"),
        (dict(n=0), 400, "n"),
        (dict(extra_body={"max_tokens": "many"}), 400, "max_tokens"),
        (dict(prompt="word " * 2100), 400, None),
        (dict(model="gpt-9"), 404, "model"),
        (dict(logprobs=25), 400, "logprobs"),
    ],
)
def test_errors_have_openai_shape_and_status(oai, kw, status, param):
    args = {"model": "demo", "prompt": "x", **kw}
    with pytest.raises(openai.APIStatusError) as e:
        oai.completions.create(**args)
    assert e.value.status_code == status
    body = e.value.body
    assert isinstance(body["message"], str) and body["type"] and body["param"] == param
    with pytest.raises(openai.APIStatusError) as e:
        oai.completions.create(**args, stream=True)
    assert e.value.status_code == status


def test_bad_chat_requests(oai):
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="role") as e:
        oai.chat.completions.create(model="demo", messages=[{"content": "no role"}])
    assert e.value.body["param"] == "messages"


def _bridge(engine: str, *args: str) -> tuple[subprocess.Popen, str]:
    """A standalone bridge, returned once it listens: it says so on stdout (its only line
    there), however long a loaded machine takes to start it."""
    port = free_tcp_port()
    proc = subprocess.Popen([sys.executable, "-m", "noria.frontend.cli", "bridge", "--engine", engine, "--port", str(port), *args],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    http = f"http://127.0.0.1:{port}"
    line = proc.stdout.readline()  # "" if it exits first
    assert line.startswith(f"noria bridge: {http} "), f"bridge did not start (exit {proc.poll()}): {line!r}"
    return proc, http


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(120)  # bounds a hang only
    if proc.stdout is not None:
        proc.stdout.close()
    return code


def test_api_key_on_a_standalone_bridge(served):
    import asyncio

    import websockets

    proc, http = _bridge(served.address, "--api-key", "sekret")
    try:
        wait_http(http, proc)  # /health stays open
        for key in (None, "wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            status, body = _get(f"{http}/v1/models", **headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=f"{http}/v1", api_key="wrong", max_retries=0) as bad, pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="demo", prompt="x", max_tokens=2)
        with openai.OpenAI(base_url=f"{http}/v1", api_key="sekret", max_retries=0) as good:
            assert good.completions.create(model="demo", prompt="x", max_tokens=2).usage.completion_tokens >= 1

        ws_url = http.replace("http", "ws") + "/v1/stream"

        async def ws_checks() -> str:
            with pytest.raises(websockets.InvalidStatus) as e:
                async with websockets.connect(ws_url):
                    pass
            assert e.value.response.status_code == 401
            async with websockets.connect(ws_url, additional_headers={"Authorization": "Bearer sekret"}) as ws:
                await ws.send('{"type": "generate", "request_id": "a", "prompt": "x", "max_tokens": 2}')
                while msgspec.json.decode(reply := await ws.recv())["type"] == "delta":
                    pass
            async with websockets.connect(ws_url + "?api_key=sekret") as ws:
                await ws.send('{"type": "generate", "request_id": "b", "prompt": "x", "max_tokens": 2}')
                while msgspec.json.decode(reply := await ws.recv())["type"] == "delta":
                    pass
            return msgspec.json.decode(reply)["type"]

        assert asyncio.run(ws_checks()) == "done"
    finally:
        assert _stop(proc) == 0


def test_an_unreachable_engine_gives_503():
    proc, http = _bridge(f"tcp://127.0.0.1:{free_tcp_port()}")
    try:
        status, body = _get(f"{http}/health")  # it listens already: no retries, no polling
        assert status == 503 and body["status"] == "unavailable"
        assert body["reason"].startswith("engine_unreachable")
        # The client's timeout bounds a hang only; the bridge gives up on the engine on its own.
        with openai.OpenAI(base_url=f"{http}/v1", api_key="none", max_retries=0, timeout=300) as c:
            with pytest.raises(openai.APIStatusError) as e:
                c.completions.create(model="demo", prompt="x", max_tokens=2)
            assert e.value.status_code == 503 and e.value.body["code"] == "engine_unreachable"
            with pytest.raises(openai.APIStatusError) as e:
                c.models.list()
            assert e.value.status_code == 503
        assert scrape_metrics(http)["noria_engine_up"] == 0
    finally:
        assert _stop(proc) == 0


def test_a_taken_port_is_a_clear_error(served):
    port = served.http.rsplit(":", 1)[1]
    r = subprocess.run([sys.executable, "-m", "noria.frontend.cli", "bridge", "--engine", served.address, "--port", port],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr


def test_metrics_parse_and_move_as_requests_complete(served, oai):
    before = wait_metrics(served.http, engine_idle)
    assert before["noria_engine_up"] == 1 and before["noria_kv_cache_blocks"] == 256
    for name in ("noria_prefix_cache_queries_total", "noria_prefix_cache_hits_total", "noria_num_preemptions_total",
                 "noria_num_requests_swapped", "noria_inter_token_latency_seconds_count"):
        assert name in before
    oai.completions.create(model="demo", prompt="count me", max_tokens=6, extra_body={"ignore_eos": True})
    oai.chat.completions.create(model="demo", messages=[{"role": "user", "content": "me too"}], max_tokens=4,
                                extra_body={"ignore_eos": True})
    after = wait_metrics(served.http, lambda m: m["noria_generation_tokens_total"] >= before["noria_generation_tokens_total"] + 10)
    assert after["noria_generation_tokens_total"] >= before["noria_generation_tokens_total"] + 10
    assert after["noria_prompt_tokens_total"] > before["noria_prompt_tokens_total"]
    ok = 'noria_request_success_total{finish_reason="length"}'
    assert after[ok] == before.get(ok, 0) + 2
    for h in ("noria_time_to_first_token_seconds", "noria_e2e_request_latency_seconds"):
        assert after[f"{h}_count"] == before[f"{h}_count"] + 2
        assert after[f"{h}_sum"] > before[f"{h}_sum"]
    assert after["noria_inter_token_latency_seconds_count"] >= before["noria_inter_token_latency_seconds_count"] + 8


def _hang_up_while_running(http: str, **body: object) -> None:
    """POST a non-streaming completion; close the connection once the engine runs it."""
    extra = body.pop("extra_body", {})
    host, port = http.removeprefix("http://").rsplit(":", 1)
    conn = HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=msgspec.json.encode({**body, **extra}),  # type: ignore[dict-item]
                     headers={"Content-Type": "application/json"})
        busy = wait_metrics(http, lambda m: m["noria_num_requests_running"] == 1 and m["noria_kv_cache_usage_ratio"] > 0)
        assert busy["noria_num_requests_running"] == 1, "the request never ran"
    finally:
        conn.close()


def test_hanging_up_an_http_stream_aborts_the_request(served, oai):
    aborted = 'noria_request_success_total{finish_reason="abort"}'
    before = wait_metrics(served.http, engine_idle)
    stream = oai.chat.completions.create(model="demo", messages=[{"role": "user", "content": "go on"}],
                                         max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    busy = wait_metrics(served.http, lambda m: m["noria_kv_cache_usage_ratio"] > 0)
    assert busy["noria_kv_cache_usage_ratio"] > 0 and busy["noria_num_requests_running"] == 1
    stream.close()
    idle = wait_metrics(served.http, engine_idle)
    assert engine_idle(idle), idle
    assert idle[aborted] == before.get(aborted, 0) + 1

    # A non-streaming request whose client gives up is aborted too.
    # It hangs up once the engine runs the request (a client timeout of its own might come
    # after a fast engine's last token, or before a slow one's first).
    _hang_up_while_running(served.http, model="demo", prompt="slow", max_tokens=2000, extra_body={"ignore_eos": True})
    idle = wait_metrics(served.http, engine_idle)
    assert engine_idle(idle), idle
    assert idle[aborted] == before.get(aborted, 0) + 2

"""Prefill/decode disaggregation with real processes on loopback: a producer and a consumer
`noria serve` behind vllm-router's `--vllm-pd-disaggregation` (from the package index,
unmodified), against a single engine of the same model. Greedy output is the single engine's;
the consumer pulled the prompt's KV (its counters say how much) and the producer freed every
held block; a pull that fails falls back to computing the prompt; a transfer nobody pulls
expires."""

from __future__ import annotations

import contextlib
import random
import urllib.error
import urllib.request
from collections.abc import Iterator

import msgspec
import pytest

from noria.frontend.local_server import LocalServer
from noria.protocol.sockets import free_tcp_port
from tests.procs import engine_idle, scrape_metrics, wait_metrics
from tests.test_routers import router_with

FLAGS = ("--num-kv-blocks", "256", "--max-model-len", "1024", "--seed", "0")
BLOCK = 16  # the default block size


def _config(role: str, **extra: object) -> str:
    return msgspec.json.encode({"kv_connector": "NoriaConnector", "kv_role": role, **extra}).decode()


@pytest.fixture(scope="module")
def trio(demo_path) -> Iterator[tuple[LocalServer, LocalServer, LocalServer]]:
    """A producer (its transfers expire after 20 s), a consumer and a plain engine."""
    producer = LocalServer(*FLAGS, "--kv-transfer-config",
                           _config("kv_producer", kv_port=free_tcp_port(),
                                   kv_connector_extra_config={"abort_request_timeout": 20}))
    consumer = LocalServer(*FLAGS, "--kv-transfer-config",
                           _config("kv_consumer", kv_connector_extra_config={"transfer_timeout": 2}))
    single = LocalServer(*FLAGS)
    servers = (producer, consumer, single)
    try:
        for s in servers:
            s.wait(http=True)
        yield servers
    finally:
        for s in servers:
            s.stop()


def pd_router(prefill: LocalServer, decode: LocalServer) -> contextlib.AbstractContextManager[str]:
    return router_with(["--vllm-pd-disaggregation", "--prefill", prefill.http, "--decode", decode.http])


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"{url}{path}", data=msgspec.json.encode(body),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return msgspec.json.decode(r.read())


def _complete(url: str, prompt: list[int], max_tokens: int = 12, **extra: object) -> dict:
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, **extra}
    return _post(url, "/v1/completions", body)


def _tokens(answer: dict) -> list[str]:
    return answer["choices"][0]["logprobs"]["tokens"]


def _counter(engine: LocalServer, name: str) -> float:
    return scrape_metrics(engine.http)[f"noria_{name}_total"]


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def _settled(producer: LocalServer, consumer: LocalServer) -> None:
    """Both engines idle and the producer holds nothing: every block is back."""
    m = wait_metrics(producer.http, lambda m: engine_idle(m) and m["noria_kv_transfers_held"] == 0)
    assert engine_idle(m) and m["noria_kv_transfers_held"] == 0, m
    m = wait_metrics(consumer.http, engine_idle)
    assert engine_idle(m)


def test_pd_through_vllm_router_answers_as_one_engine(trio):
    producer, consumer, single = trio
    rng = random.Random(0)
    # Lengths around block edges: the last prompt token alone, a block and one, a whole block.
    prompts = [_prompt(rng, n) for n in (2, 17, 33, 48, 130)]
    pulls, pulled, released = (_counter(consumer, "kv_pulls_ok"), _counter(consumer, "kv_pull_tokens"),
                               _counter(producer, "kv_transfers_released"))
    with pd_router(producer, consumer) as url:
        for p in prompts:
            assert _tokens(_complete(url, p)) == _tokens(_complete(single.http, p))
        chat = {"model": "demo", "messages": [{"role": "user", "content": "tell me about rivers and stones"}],
                "max_tokens": 10, "temperature": 0}
        via = _post(url, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
        assert via == _post(single.http, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    m = wait_metrics(consumer.http, lambda m: m["noria_kv_pulls_ok_total"] >= pulls + len(prompts) + 1)
    assert m["noria_kv_pulls_ok_total"] == pulls + len(prompts) + 1
    assert m["noria_kv_pulls_failed_total"] == 0
    # Every prompt token's KV but the last was pulled (nothing was cached on the consumer before).
    assert m["noria_kv_pull_tokens_total"] - pulled >= sum(len(p) - 1 for p in prompts)
    assert m["noria_kv_pull_bytes_total"] > 0 and m["noria_kv_pull_seconds_total"] > 0
    m = wait_metrics(producer.http, lambda m: m["noria_kv_transfers_released_total"] >= released + len(prompts) + 1)
    assert m["noria_kv_transfers_released_total"] == released + len(prompts) + 1
    _settled(producer, consumer)


def test_a_prefix_the_consumer_holds_is_not_pulled_again(trio):
    producer, consumer, _ = trio
    prompt = _prompt(random.Random(1), 5 * BLOCK + 3)  # the KV of 82 tokens: five whole blocks and two
    with pd_router(producer, consumer) as url:
        first = _complete(url, prompt)
        before = _counter(consumer, "kv_pull_tokens")
        again = _complete(url, prompt)
    m = wait_metrics(consumer.http, lambda m: m["noria_kv_pull_tokens_total"] > before)
    assert m["noria_kv_pull_tokens_total"] - before == 2  # only what the last, partial block held
    assert _tokens(first) == _tokens(again)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK
    _settled(producer, consumer)


def test_a_failed_pull_computes_the_prompt_on_the_consumer(trio):
    producer, consumer, single = trio
    prompt = _prompt(random.Random(2), 40)
    params = _complete(producer.http, prompt, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    failed = _counter(consumer, "kv_pulls_failed")
    # The transfer released before the consumer reads it (as a producer restarted would have it) ...
    gone = dict(params, remote_transfer_id=params["remote_transfer_id"] + 1)
    # ... and a producer that does not answer at all (the consumer gives up after transfer_timeout).
    silent = dict(params, remote_endpoints=[f"tcp://127.0.0.1:{free_tcp_port()}"])
    want = _tokens(_complete(single.http, prompt))
    for bad in (gone, silent):
        assert _tokens(_complete(consumer.http, prompt, kv_transfer_params=bad)) == want
    m = wait_metrics(consumer.http, lambda m: m["noria_kv_pulls_failed_total"] >= failed + 2)
    assert m["noria_kv_pulls_failed_total"] == failed + 2
    # The real transfer is still held: it goes when the consumer that pulls it releases it.
    assert _tokens(_complete(consumer.http, prompt, kv_transfer_params=params)) == want
    _settled(producer, consumer)


def test_a_transfer_nobody_pulls_expires(trio):
    producer, consumer, _ = trio
    expired = _counter(producer, "kv_transfers_expired")
    answer = _complete(producer.http, _prompt(random.Random(3), 70), 1, kv_transfer_params={"do_remote_decode": True})
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == 5
    m = scrape_metrics(producer.http)
    assert m["noria_kv_transfers_held"] >= 1 and m["noria_kv_cache_usage_ratio"] > 0
    m = wait_metrics(producer.http, lambda m: m["noria_kv_transfers_expired_total"] > expired, timeout=120)
    assert m["noria_kv_transfers_expired_total"] == expired + 1
    _settled(producer, consumer)


def test_kv_transfer_params_are_checked(trio):
    producer, _, _ = trio
    for bad in ([1], {"do_remote_decode": "yes"}, {"do_remote_decode": True, "do_remote_prefill": True}):
        with pytest.raises(urllib.error.HTTPError) as e:
            _complete(producer.http, [5, 6, 7], 1, kv_transfer_params=bad)
        assert e.value.code == 400
        assert b"kv_transfer_params" in e.value.read()

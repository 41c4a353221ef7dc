"""`noria serve --data-parallel-size 2`: two engines behind one frontend (frontend/engine_group.py),
as real processes. Requests that share a prefix go to the engine holding it; distinct ones and
concurrent ones spread; each engine's numbers come out under its own `engine` label; an engine
whose scheduler is killed mid-stream loses no request (the stream goes on, token for token what
it would have been, on the other engine) and comes back."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import msgspec
import openai
import pytest
import zmq

from noria.protocol.sockets import free_tcp_port
from tests.procs import children_of, engine_idle, scrape_metrics, serve_http, wait_metrics
from tests.test_kv_events import DECODE, BlockStored

LONG = "river stone maple cloud amber north quiet lamp field copper harbor violet " * 6


EVENTS_PORT = free_tcp_port()  # engine r publishes its KV-cache events on EVENTS_PORT + r


@pytest.fixture(scope="module")
def served(demo_path):
    events = msgspec.json.encode({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{EVENTS_PORT}"}).decode()
    with serve_http("--num-kv-blocks", "256", "--max-model-len", "1024", "--data-parallel-size", "2",
                    "--kv-events-config", events) as s:
        yield s


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def _per_engine(m: dict[str, float], name: str) -> list[float]:
    return [m[f'{name}{{engine="{e}",model_name="demo"}}'] for e in ("0", "1")]


def _wait(check, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)  # poll interval; the deadline only bounds a hang
    return got


def test_a_shared_prefix_stays_on_one_engine_and_distinct_ones_spread(served, oai):
    wait_metrics(served.http, engine_idle)
    before = scrape_metrics(served.http)
    usages = [oai.completions.create(model="demo", prompt=f"{LONG} question {i}:", max_tokens=3, temperature=0).usage
              for i in range(4)]
    # All but the first find the shared prefix: they went where it is cached.
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert all(u.prompt_tokens_details.cached_tokens >= 16 * 10 for u in usages[1:])
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)

    def hits(m: dict[str, float]) -> list[float]:
        return [a - b for a, b in zip(_per_engine(m, "vllm:prefix_cache_hits_total"),
                                      _per_engine(before, "vllm:prefix_cache_hits_total"), strict=True)]

    # A scrape answers with the stats last published (and asks for fresh ones): wait for them.
    m = wait_metrics(served.http, lambda m: sum(hits(m)) == cached)
    assert sorted(hits(m)) == [0, cached]
    # A prompt that shares nothing goes to the engine that holds fewer prefixes: the other one.
    other = hits(m).index(0)
    before = _per_engine(m, "vllm:prompt_tokens_total")
    oai.completions.create(model="demo", prompt="an entirely different prompt about lamps", max_tokens=2,
                           temperature=0)
    m = wait_metrics(served.http, lambda m: sum(_per_engine(m, "vllm:prompt_tokens_total")) > sum(before))
    after = _per_engine(m, "vllm:prompt_tokens_total")
    assert after[other] > before[other] and after[1 - other] == before[1 - other], (before, after)
    assert sum(after) == m["noria_prompt_tokens_total"]  # the sum is what noria's own series say
    info = msgspec.json.decode(urllib.request.urlopen(f"{served.http}/get_server_info", timeout=10).read())
    assert info["dp_size"] == 2 and info["num_gpu_blocks"] == 512


def test_concurrent_requests_run_on_both_engines(served, oai):
    wait_metrics(served.http, engine_idle)
    streams = [oai.completions.create(model="demo", prompt=f"concurrent request {i} " * 3, max_tokens=600,
                                      temperature=0, stream=True, extra_body={"ignore_eos": True}) for i in range(4)]
    try:
        for s in streams:
            next(iter(s))
        _wait(lambda: all(r >= 1 for r in _per_engine(scrape_metrics(served.http), "vllm:num_requests_running")),
              "the four requests did not spread over both engines")
    finally:
        for s in streams:
            s.close()
    wait_metrics(served.http, engine_idle)


def test_each_engine_publishes_its_kv_events_on_its_own_port(served, oai):
    """Engine r's events go out on the configured port + r, each batch saying data_parallel_rank r."""
    ctx = zmq.Context()
    subs = []
    try:
        for r in (0, 1):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{EVENTS_PORT + r}")
            subs.append(sub)
        seen: dict[int, set[int]] = {0: set(), 1: set()}  # rank -> ranks its batches name
        stored = {0: 0, 1: 0}
        deadline = time.monotonic() + 120
        i = 0
        # A SUB connects asynchronously: keep sending distinct prompts (they alternate between the
        # engines, the one holding fewer prefixes first) until both streams have shown stored blocks.
        while not (stored[0] and stored[1]):
            assert time.monotonic() < deadline, (stored, seen)
            oai.completions.create(model="demo", prompt=f"events {i} " * 12, max_tokens=2, temperature=0)
            i += 1
            for r, sub in enumerate(subs):
                while sub.poll(100):
                    _topic, _seq, payload = sub.recv_multipart()
                    batch = DECODE(payload)
                    seen[r].add(batch.data_parallel_rank)
                    stored[r] += sum(isinstance(e, BlockStored) for e in batch.events)
        assert seen == {0: {0}, 1: {1}}
    finally:
        for sub in subs:
            sub.close(linger=0)
        ctx.term()


def _scheduler_pid(served, rank: int) -> int:
    for pid in children_of(served.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"noria.scheduler" in argv and f'"data_parallel_rank":{rank}'.encode() in b" ".join(argv):
            return pid
    raise AssertionError(f"no scheduler process for engine {rank}")


def test_an_engine_killed_mid_stream_loses_nothing(served, oai):
    # The engine that runs the stream is the one whose prompt-token counter moved: a count stays
    # where a running gauge would be missed if the request finished before a scrape saw it. Long
    # enough that the kill lands mid-stream in practice; if it lands after the end, nothing is lost
    # either.
    prompt, n = "the story of a copper lamp", 1000
    reference = oai.completions.create(model="demo", prompt=prompt, max_tokens=n, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    before = _per_engine(wait_metrics(served.http, engine_idle), "vllm:prompt_tokens_total")
    stream = oai.completions.create(model="demo", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    after = _per_engine(wait_metrics(served.http, lambda m: _per_engine(m, "vllm:prompt_tokens_total") != before),
                        "vllm:prompt_tokens_total")
    victim = 0 if after[0] > before[0] else 1
    os.kill(_scheduler_pid(served, victim), signal.SIGKILL)
    finish = None
    for chunk in chunks:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    assert text == reference  # resumed on the other engine from the tokens already sent
    # The killed engine comes back and takes requests again (its cache is new: no hits there yet).
    _wait(lambda: scrape_metrics(served.http)[f'vllm:num_requests_running{{engine="{victim}",model_name="demo"}}']
          == 0 and _scheduler_pid(served, victim), "the killed engine did not come back")
    m = wait_metrics(served.http, lambda m: engine_idle(m) and m["noria_workers_live"] == 1)
    assert m["noria_engine_up"] == 1
    done = threading.Event()
    results = []

    def one(i: int) -> None:
        results.append(oai.completions.create(model="demo", prompt=f"after the loss {i} " * 4, max_tokens=4,
                                              temperature=0).choices[0].finish_reason)
        if len(results) == 4:
            done.set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert done.is_set() and results == ["length"] * 4

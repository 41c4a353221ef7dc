"""noria engines behind the routers the field already runs: vllm-router and SGLang's model gateway
(sglang-router), from the package index, unmodified, in front of three `noria serve` processes on
loopback. Round-robin spreads requests evenly; cache-aware routing sends requests that share a prefix to the engine that holds it, which
the engines' own prefix-cache counters show; power-of-two reads each engine's /get_load."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from noria.frontend.local_server import LocalServer, stop_child
from noria.protocol.sockets import free_tcp_port
from tests.procs import children_of, engine_idle, scrape_metrics, wait_gone, wait_metrics

# In the test extras: the router's own console script, beside this interpreter.
ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or "vllm-router"
# SGLang's model gateway (`sglang-router launch`, in the test extras too): the same CLI for these flags.
SGLANG = [shutil.which("sglang-router", path=str(Path(sys.executable).parent)) or "sglang-router", "launch"]
ROUTERS = {"vllm-router": [ROUTER], "sglang-router": SGLANG}

ENGINES = 3


def _events_flag(port: int) -> str:
    return msgspec.json.encode({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}).decode()


@pytest.fixture(scope="module")
def engines(demo_path) -> Iterator[list[LocalServer]]:
    """Three engines, each publishing its KV-cache events on a port of its own (`.events`)."""
    ports = [free_tcp_port() for _ in range(ENGINES)]
    servers = [LocalServer("--num-kv-blocks", "512", "--max-model-len", "1024", "--kv-events-config", _events_flag(p))
               for p in ports]
    for server, port in zip(servers, ports, strict=True):
        server.events = f"tcp://127.0.0.1:{port}"  # type: ignore[attr-defined]
    try:
        for s in servers:
            s.wait(http=True)
        yield servers
    finally:
        for s in servers:
            s.stop()


@contextlib.contextmanager
def router(engines: list[LocalServer], policy: str, *extra: str, which: str = "vllm-router") -> Iterator[str]:
    with router_with(["--policy", policy, "--worker-urls", *[e.http for e in engines], *extra], which) as url:
        yield url


@contextlib.contextmanager
def router_with(args: list[str], which: str = "vllm-router") -> Iterator[str]:
    """The router with `args` on a free port; its URL once it answers /v1/models."""
    port = free_tcp_port()
    argv = [*ROUTERS[which], "--host", "127.0.0.1", "--port", str(port), "--log-level",
            "warning" if which == "vllm-router" else "warn", *args]
    if which == "vllm-router":
        argv += ["--prometheus-port", str(free_tcp_port())]  # its own metrics, off the shared default port
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"{which} exited with {proc.returncode}"
            if _answers(f"{url}/v1/models") and (which != "sglang-router" or _all_workers_healthy(url, args)):
                break
            assert time.monotonic() < deadline, f"{which} did not come up"
            time.sleep(0.2)  # poll interval; the deadline bounds the wait
        yield url
    finally:
        stop_child(proc, signal.SIGINT, 30)


def _answers(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as r:
        return r.status == 200
    return False


def _all_workers_healthy(url: str, args: list[str]) -> bool:
    """SGLang's gateway answers before it has registered every --worker-urls engine (it adds them
    in the background, after a health check): until its /workers lists each one healthy, a
    round-robin skips the missing ones and sends a prefix to one engine twice."""
    start = args.index("--worker-urls") + 1 if "--worker-urls" in args else len(args)
    want = set(itertools.takewhile(lambda a: not a.startswith("--"), args[start:]))
    with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(f"{url}/workers", timeout=5) as r:
        workers = msgspec.json.decode(r.read())["workers"]
        return want <= {w["url"] for w in workers if w.get("is_healthy")}
    return False


def _complete(url: str, prompt: str, max_tokens: int = 4, **extra: object) -> dict:
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    req = urllib.request.Request(f"{url}/v1/completions", data=msgspec.json.encode(body),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return msgspec.json.decode(r.read())


def _served(engine: LocalServer) -> float:
    """Requests the engine finished, as its vLLM-named counter says."""
    m = scrape_metrics(engine.http)
    return sum(v for k, v in m.items() if k.startswith("vllm:request_success_total"))


def _short_served(engine: LocalServer) -> float:
    """Requests the engine finished with at most 2 generated tokens (its length histogram)."""
    m = scrape_metrics(engine.http)
    return m['vllm:request_generation_tokens_bucket{engine="0",le="2.0",model_name="demo"}']


def _hits(engine: LocalServer) -> float:
    return scrape_metrics(engine.http)["noria_prefix_cache_hits_total"]


def _idle(engines: list[LocalServer]) -> None:
    for e in engines:
        wait_metrics(e.http, engine_idle)


def _prefix(rng: random.Random, words: int = 120) -> str:
    vocab = ["river", "stone", "maple", "cloud", "amber", "north", "quiet", "lamp", "field", "copper", "harbor",
             "violet", "engine", "paper", "winter", "garden"]
    return " ".join(rng.choice(vocab) for _ in range(words))


@pytest.mark.parametrize("which", ROUTERS)
def test_round_robin_spreads_evenly(engines, which):
    before = [_served(e) for e in engines]
    with router(engines, "round_robin", which=which) as url:
        for i in range(2 * ENGINES):
            out = _complete(url, f"request number {i}")
            assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 4
    _idle(engines)
    assert [_served(e) - b for e, b in zip(engines, before, strict=True)] == [2] * ENGINES


@pytest.mark.parametrize("which", ROUTERS)
def test_cache_aware_routing_finds_cached_prefixes(engines, which):
    """Three requests per shared prefix, one after another: round-robin sends each to another
    engine (no engine sees a prefix twice: no hits), cache-aware to the engine that holds it."""
    rng = random.Random(f"7 {which}")  # prefixes no earlier run left in the engines' caches

    def run(policy: str) -> tuple[float, int]:
        prefixes = [_prefix(rng) for _ in range(4)]
        before = sum(_hits(e) for e in engines)
        with router(engines, policy, which=which) as url:
            tokens = []
            for p in prefixes:
                for j in range(ENGINES):
                    tokens.append(_complete(url, f"{p} question {j}:")["usage"]["prompt_tokens"])
        _idle(engines)
        return sum(_hits(e) for e in engines) - before, sum(tokens)

    rr_hits, _ = run("round_robin")
    ca_hits, ca_tokens = run("cache_aware")
    assert rr_hits == 0
    # Two of every three requests find their prefix (~120 words, most of the prompt) cached.
    assert ca_hits > 0.5 * ca_tokens


def test_kv_aware_routing_reads_the_engines_kv_events(engines):
    """vllm-router's kv_aware policy indexes the blocks each engine publishes (BlockStored with
    their token ids) and sends a request to the engine holding most of its prompt. Each prefix
    is computed first on an engine of the test's choice, directly; the requests that share it,
    sent through the router, find it there, whichever engine that is (blind, the router would
    send them all to one engine and miss two prefixes in three)."""
    rng = random.Random(11)
    sources = [arg for e in engines for arg in ("--kv-event-source", f"{e.http}={e.events}")]
    tries = 0
    with router(engines, "kv_aware", *sources, "--kv-event-block-size", "16", "--kv-event-model", "demo") as url:
        for k in range(2 * ENGINES):
            owner, prefix = engines[k % ENGINES], _prefix(rng)
            seeded = _complete(owner.http, f"{prefix} question 0:")["usage"]["prompt_tokens"]
            before = [_hits(e) for e in engines]
            # The router learns of the owner's blocks from its events, asynchronously: a
            # request routed before they arrive may go elsewhere (and compute the prefix there
            # too); within a few tries one must land on the owner, which then hits.
            deadline = time.monotonic() + 60
            while _hits(owner) - before[engines.index(owner)] < seeded // 2:
                assert time.monotonic() < deadline, f"prefix {k} never routed to engine {k % ENGINES}"
                _complete(url, f"{prefix} question {rng.random()}:")
                _idle(engines)
                tries += 1
    # The events are out before the seeding request's answer (one batch per step): nearly every
    # first try lands. Blind, a third would (about 18 tries in all), or only one engine's.
    assert tries <= 2 * ENGINES + 2, tries
def _router_loads(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/get_loads", timeout=10) as r:
        return {w["worker"]: w["load"] for w in msgspec.json.decode(r.read())["workers"]}


def test_power_of_two_reads_get_load(engines):
    """power_of_two polls each engine's /get_load for `load`: while one engine is kept busy, the
    router sees its load and sends the requests that follow to the others."""
    busy, stop = engines[0], threading.Event()

    def keep_busy() -> None:  # one long request in flight on `busy` until told to stop
        while not stop.is_set():
            body = {"model": "demo", "prompt": "count slowly", "max_tokens": 900, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            req = urllib.request.Request(f"{busy.http}/v1/completions", data=msgspec.json.encode(body),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as stream:
                while not stop.is_set() and stream.readline():
                    pass

    thread = threading.Thread(target=keep_busy, daemon=True)
    thread.start()
    try:
        with router(engines, "power_of_two") as url:
            deadline = time.monotonic() + 120
            while _router_loads(url).get(busy.http, 0) < 1:  # the router has polled the busy engine
                assert time.monotonic() < deadline, _router_loads(url)
                time.sleep(0.1)  # poll interval; the deadline bounds the wait
            before = [_short_served(e) for e in engines]
            for i in range(12):
                _complete(url, f"small request {i}", max_tokens=2)
            after = [_short_served(e) for e in engines]
    finally:
        stop.set()
        thread.join(timeout=300)
    served_by = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(served_by) == 12
    # Blind, the busy engine would take a third (4); seeing its load, none, or one where a poll
    # met the gap between two of its long requests.
    assert served_by[0] <= 1, served_by


def test_an_engine_killed_under_load_loses_nothing_where_the_router_retries(demo_path):
    """Two engines behind round-robin with retries; one is killed (its whole process group) while
    requests run on it. vllm-router answers those in-flight requests 500 (it does not send again a
    request whose answer had begun: `--data-parallel-size` behind one frontend is what loses none
    of them, tests/test_data_parallel.py); the requests on the survivor finish, and every request
    after the kill is answered in full: the router retries the dead engine's refusals on the
    survivor."""
    pair = [LocalServer("--num-kv-blocks", "256", "--max-model-len", "1024") for _ in range(2)]
    try:
        for s in pair:
            s.wait(http=True)
        victim, survivor = pair
        with router(pair, "round_robin", "--retry-max-retries", "3") as url:
            results: list[dict | BaseException] = []

            def one(i: int) -> None:
                try:
                    results.append(_complete(url, f"a request under load {i}", max_tokens=900, ignore_eos=True))
                except urllib.error.HTTPError as e:
                    results.append(e)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 120
            while msgspec.json.decode(urllib.request.urlopen(f"{victim.http}/get_load", timeout=10).read())["load"] < 1:
                assert time.monotonic() < deadline, "no request reached the victim"
                time.sleep(0.05)  # poll interval; the deadline bounds the wait
            # The whole server dies at once, as a host that goes away: the frontend and every child
            # (they run in sessions of their own, so each is killed by name).
            killed = [victim.proc.pid, *children_of(victim.proc.pid)]
            for pid in killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for t in threads:
                t.join(timeout=300)
            done = [r for r in results if isinstance(r, dict)]
            lost = [r for r in results if isinstance(r, urllib.error.HTTPError)]
            assert len(done) + len(lost) == 6 and all(e.code == 500 for e in lost)
            assert 1 <= len(lost) <= 3 and all(r["usage"]["completion_tokens"] == 900 for r in done)
            before = _served(survivor)
            after_kill = [_complete(url, f"after the kill {i}", max_tokens=8, ignore_eos=True) for i in range(6)]
        assert all(r["usage"]["completion_tokens"] == 8 for r in after_kill)
        assert _served(survivor) - before == 6  # the dead engine's turns went to the survivor
        victim.proc.wait(timeout=60)
        assert wait_gone(killed) == []  # nothing of the killed server is left behind
    finally:
        for s in pair:
            if s.proc.poll() is None:
                s.stop()

"""`ws://HOST:PORT/v1/stream` spoken by the `websockets` library, and the
playground page that uses it, driven in headless Chromium by playwright."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest
import websockets

from noria import AsyncClient, SamplingParams
from tests.procs import engine_idle, serve_http, wait_metrics

N = 50
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(demo_path):
    with serve_http("--num-kv-blocks", "256", "--max-model-len", "2048") as s:
        yield s


@pytest.fixture(scope="module")
def reference(served) -> dict[str, tuple[str, list[int]]]:
    """What the ZMQ client library gets for each prompt (greedy, so batching does not matter)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def main():
        async with AsyncClient(served.address) as c:
            return await asyncio.gather(*(c.generate(_prompt(i), params) for i in range(N)))

    return {_prompt(i): (o.outputs[0].text, o.outputs[0].token_ids) for i, o in enumerate(asyncio.run(main()))}


def _prompt(i: int) -> str:
    return f"Story number {i}:"


def _generate(rid: str, prompt: str, **kw) -> str:
    msg = {"type": "generate", "request_id": rid, "prompt": prompt, "max_tokens": MAX_TOKENS,
           "temperature": 0.0, "ignore_eos": True, **kw}
    return msgspec.json.encode(msg).decode()


def _ws_url(served) -> str:
    return served.http.replace("http://", "ws://") + "/v1/stream"


async def _collect(ws, rids: set[str]) -> dict[str, list[dict]]:
    """Read until every rid has its final message; then prove nothing follows it
    by sending a sentinel request and reading up to its own final message."""
    got: dict[str, list[dict]] = {r: [] for r in rids}
    finals = 0
    while finals < len(rids):
        m = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 60))
        got[m["request_id"]].append(m)
        finals += m["type"] in ("done", "error")
    await ws.send(_generate("sentinel", "end", max_tokens=1))
    while True:
        m = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 60))
        if m["request_id"] != "sentinel":
            got[m["request_id"]].append(m)  # a message after the final one: the check below fails
        elif m["type"] == "done":
            return got


def _check(msgs: list[dict], expected: tuple[str, list[int]]) -> None:
    assert [m["type"] for m in msgs[-1:]] == ["done"] and all(m["type"] == "delta" for m in msgs[:-1])
    done = msgs[-1]
    assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == MAX_TOKENS
    assert "".join(m["text"] for m in msgs[:-1]) == expected[0]
    assert [t for m in msgs[:-1] for t in m["token_ids"]] == expected[1]


def test_50_streams_on_one_socket(served, reference):
    async def main():
        async with websockets.connect(_ws_url(served)) as ws:
            for i in range(N):
                await ws.send(_generate(f"r{i}", _prompt(i)))
            return await _collect(ws, {f"r{i}" for i in range(N)})

    got = asyncio.run(main())
    for i in range(N):
        _check(got[f"r{i}"], reference[_prompt(i)])


def test_50_streams_on_50_sockets(served, reference):
    async def one(i: int):
        async with websockets.connect(_ws_url(served)) as ws:
            await ws.send(_generate("r1", _prompt(i)))  # every socket has its own id space
            return (await _collect(ws, {"r1"}))["r1"]

    async def main():
        return await asyncio.gather(*(one(i) for i in range(N)))

    for i, msgs in enumerate(asyncio.run(main())):
        _check(msgs, reference[_prompt(i)])


def test_done_usage_reports_prefix_cache_hits(served):
    prompt = "A prompt long enough to fill several KV blocks of sixteen tokens each. " * 4

    async def main() -> list[dict]:
        async with websockets.connect(_ws_url(served)) as ws:
            usages = []
            for rid in ("c1", "c2"):
                await ws.send(_generate(rid, prompt, max_tokens=2))
                usages.append((await _collect(ws, {rid}))[rid][-1]["usage"])
            return usages

    first, second = asyncio.run(main())
    assert first["prompt_tokens"] == second["prompt_tokens"] > 3 * 16
    # What the first one computed is there for the second: every whole block before the last token.
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] == (second["prompt_tokens"] - 1) // 16 * 16


def test_abort_duplicate_and_bad_messages(served):
    async def main():
        async with websockets.connect(_ws_url(served)) as ws:
            await ws.send(_generate("long", "go", max_tokens=2000))
            await ws.send(_generate("long", "again"))
            await ws.send("{not json")
            await ws.send('{"type": "generate", "request_id": "t", "prompt": "x", "max_tokens": "lots"}')
            await ws.send('{"type": "generate", "request_id": "p", "prompt": "x", "top_p": 9}')
            await ws.send('{"type": "abort", "request_id": "nobody"}')
            seen: list[dict] = []
            while not any(m["type"] == "done" for m in seen):
                m = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 60))
                seen.append(m)
                if sum(x["type"] == "delta" for x in seen) == 3:
                    await ws.send('{"type": "abort", "request_id": "long"}')
            return seen

    seen = asyncio.run(main())
    errors = {(m["request_id"], m["code"]) for m in seen if m["type"] == "error"}
    assert errors == {("long", "duplicate_request"), (None, "invalid_message"), ("t", "invalid_message"),
                      ("p", "invalid_request")}
    done = [m for m in seen if m["type"] == "done"]
    assert len(done) == 1 and done[0]["request_id"] == "long" and done[0]["finish_reason"] == "abort"
    assert done[0]["usage"]["completion_tokens"] < 2000


def test_closing_the_socket_aborts_its_requests(served):
    wait_metrics(served.http, engine_idle)

    async def main():
        # max_queue=None: the library keeps reading what it does not hand out, so it
        # sees the server's answer to its close at once (a full queue would wait 10 s).
        async with websockets.connect(_ws_url(served), max_queue=None) as ws:
            for i in range(3):
                await ws.send(_generate(f"c{i}", "keep going", max_tokens=2000))
            for _ in range(6):
                await asyncio.wait_for(ws.recv(), 60)
            busy = await asyncio.to_thread(wait_metrics, served.http, lambda m: m["noria_num_requests_running"] == 3)
            assert busy["noria_kv_cache_usage_ratio"] > 0
        # leaving the block closed the socket mid-generation

    asyncio.run(main())
    idle = wait_metrics(served.http, engine_idle)
    assert engine_idle(idle), idle


# ---- the playground page in a real browser ------------------------------

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium() -> str:
    """Debian's chromium, installed by tests/setup_browser.sh when missing. Fails (never skips)."""
    path = shutil.which("chromium")
    if path is None:
        script = Path(__file__).with_name("setup_browser.sh")
        r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900)
        path = shutil.which("chromium")
        if path is None:
            pytest.fail(f"the playground test needs Debian's chromium; {script} could not install it:\n"
                        f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return path


def test_playground_streams_and_stops_in_a_browser(served, tmp_path):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playground test needs the `playwright` package (pip install -e .[test])")
    chromium = _chromium()
    wait_metrics(served.http, engine_idle)
    with sync_playwright() as pw:
        # launch() runs headless with a fresh, private profile directory.
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            page.goto(served.http + "/")
            assert page.title() == "noria playground"
            page.fill("#prompt", "Tell me a long story")
            page.fill("#max_tokens", "2000")
            page.fill("#temperature", "0")  # greedy: the same text, without an early EOS, every run
            page.click("#send")
            page.wait_for_function("document.querySelector('#output').textContent.length > 20", timeout=30_000)
            assert page.is_enabled("#stop") and not page.is_enabled("#send")
            assert "streaming" in page.text_content("#status")
            page.click("#stop")
            page.wait_for_function("document.querySelector('#status').textContent.startsWith('abort')", timeout=30_000)
            assert page.is_enabled("#send") and not page.is_enabled("#stop")
            stopped = page.text_content("#output")
            # Once the engine has let go of the request nothing more can come for it.
            assert engine_idle(wait_metrics(served.http, engine_idle))
            assert page.text_content("#output") == stopped, "text kept coming after stop"
            page.screenshot(path=str(tmp_path / "playground.png"))

            # A short generation runs to its end on the same socket.
            page.fill("#max_tokens", "5")
            page.click("#send")
            page.wait_for_function("/^(length|stop) /.test(document.querySelector('#status').textContent)",
                                   timeout=30_000)
            assert page.text_content("#status").startswith("length")
        finally:
            browser.close()
    idle = wait_metrics(served.http, engine_idle)
    assert engine_idle(idle), idle

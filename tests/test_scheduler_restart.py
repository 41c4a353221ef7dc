"""A scheduler SIGKILLed under load: `noria serve` starts a new one (and its worker) and
resubmits every open request from the tokens its client already has. ZMQ, websocket and
OpenAI SSE clients see no error, no delta twice or missing, and the undisturbed run's
outputs: greedy ones, and seeded ones with penalties and min_tokens too (the scheduler
counts the resubmitted outputs as outputs, and a seeded request's noise depends on its
output position only). Past --max-scheduler-restarts the server ends every request with
`engine_dead` and exits non-zero.

The undisturbed run is the same server's first round; the text check is independent of
the engine: the tokenizer's decode of each stream's token ids.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time

import pytest

from noria import Client, NoriaError, SamplingParams
from noria.frontend.local_server import LocalServer
from noria.frontend.processor import load_tokenizer
from tests.faults import (
    Stream,
    Tripwire,
    children_named,
    kill_named,
    mixed_load,
    open_requests,
    worker_stopped,
)
from tests.procs import Served, engine_idle, serve_http, wait_metrics
from tests.workers import health, stats, wait_for, wait_stats

SCHEDULER = b"noria.scheduler"
MAX_TOKENS = 40
N = 18
PROMPTS = [f"Request {i} asks the water wheel about the river" for i in range(N)]
# Even requests greedy; odd ones seeded, with penalties and min_tokens (EOS may end them, the same way twice).
PARAMS = [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=100 + i, min_tokens=MAX_TOKENS // 2,
                   frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.1)
    for i in range(N)
]
# Six at a time, so that most requests wait while the first ones run. A generous --worker-wait:
# on a busy machine the new worker may take long to load the model; a generous --worker-timeout:
# the worker is stopped while the load arrives.
FLAGS = ("--num-kv-blocks", "64", "--max-num-seqs", "6", "--max-model-len", "256", "--worker-wait", "120",
         "--worker-timeout", "120")
LATE = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _watch_health(http: str, seen: list[tuple[int, str]], stop: threading.Event) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            status, body = health(http)
            seen.append((status, body.get("reason") or ""))
            time.sleep(0.05)  # poll interval

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _all_open_then_run(served: Served, progress: list[int]) -> list[Stream]:
    """The mixed load with every request open before the first token (see worker_stopped)."""
    got: list[list[Stream]] = []
    load = threading.Thread(target=lambda: got.append(
        mixed_load(served.address, served.http, PROMPTS, PARAMS, progress)), daemon=True)
    with worker_stopped(served.proc.pid):
        load.start()
        wait_for(f"{N} open requests", lambda: stats(served.address).num_open_requests == N, 120)
    load.join(600)
    assert got, "the load did not end"
    return got[0]


def test_sigkilled_scheduler_under_load_loses_nothing(demo_path, tmp_path):
    tok = load_tokenizer(str(demo_path))
    log = tmp_path / "serve.log"
    with log.open("w") as err, serve_http(*FLAGS, stderr=err) as served:
        calm = mixed_load(served.address, served.http, PROMPTS, PARAMS)
        assert all(s.error is None and s.finals == 1 for s in calm), calm
        with Client(served.address, timeout=60) as c:
            late_calm = c.generate("a late arrival", LATE).outputs[0].token_ids

        seen, stop, late, killed = [], threading.Event(), [], threading.Event()
        helpers: list[threading.Thread] = []
        total = sum(len(s.token_ids) or MAX_TOKENS for s in calm)

        def late_arrival() -> None:
            # A request that arrives while the new scheduler starts waits for it.
            wait_for("/health 503", lambda: any(code == 503 for code, _ in seen), 60)
            with Client(served.address, timeout=120) as c:
                late.append(c.generate("a late arrival", LATE).outputs[0].token_ids)

        def kill_if_open() -> None:
            # On a loaded machine the clients may trail the engine by most of the load: the kill
            # needs requests the engine still holds, asked for at this very delta.
            if open_requests(served.address) < 3:
                return
            kill_named(served.proc.pid, SCHEDULER)
            killed.set()
            helpers.append(_watch_health(served.http, seen, stop))
            helpers.append(threading.Thread(target=late_arrival, daemon=True))
            helpers[-1].start()

        # The kill lands on the delta that makes a third of the load, from the thread that counts
        # it; had the engine ended every request by then, the load runs again with the kill earlier.
        mark = total // 3
        while True:
            hurt = _all_open_then_run(served, Tripwire((mark, kill_if_open)))
            if killed.is_set() or mark == 1:
                break
            mark //= 2
        assert killed.is_set(), "the engine ended every request before its clients had their first delta"
        helpers[1].join(180)
        stop.set()
        helpers[0].join(15)
        assert late == [late_calm]

        # The kill found requests open (the test means nothing otherwise): the server's own count.
        text = wait_for("the scheduler's death in the log", lambda: re.search(
            r"the scheduler died \(.*\); starting a new one \(restart 1\); (\d+) request\(s\) wait for it",
            log.read_text()), 60)
        assert int(text.group(1)) >= 1, "the kill must land while requests are open"
        assert [(s.error, s.finals, s.late) for s in hurt] == [(None, 1, 0)] * N
        assert [s.finish_reason for s in hurt] == [s.finish_reason for s in calm]
        assert [s.text for s in hurt] == [s.text for s in calm]
        assert [s.token_ids for s in hurt] == [s.token_ids for s in calm]
        for s in hurt:  # no delta lost or doubled: the pieces make the whole
            if s.kind != "sse":
                assert s.text == tok.decode(s.token_ids, skip_special_tokens=True)
        assert any(s.finish_reason == "length" for s in hurt)

        restarting = [r for code, r in seen if code == 503]
        assert restarting and all("the scheduler is restarting after the scheduler process exited with code -9" in r
                                  for r in restarting), seen
        after = wait_stats(served.address, lambda st: st.stats.workers_live and st.num_open_requests == 0
                           and st.stats.num_running == 0, "the restarted engine to be idle").stats
        assert after.kv_cache_usage == 0 and after.num_free_blocks == after.num_kv_blocks and after.blocks_consistent
        assert stats(served.address).scheduler_restarts == 1
        m = wait_metrics(served.http, lambda m: engine_idle(m) and m["noria_scheduler_restarts_total"] == 1)
        assert engine_idle(m) and m["noria_scheduler_restarts_total"] == 1
        assert health(served.http)[0] == 200
        assert len(children_named(served.proc.pid, SCHEDULER)) == 1


def test_past_the_restart_bound_every_request_gets_engine_dead_and_the_server_exits_non_zero(demo_path):
    server = LocalServer("--max-scheduler-restarts", "0", "--num-kv-blocks", "128", stderr=subprocess.DEVNULL)
    try:
        server.wait()
        with Client(server.address, timeout=60) as c:
            # Near the demo model's 2048 positions: the request is still open when the kill lands.
            stream = c.stream("a long story", SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True))
            next(iter(stream))  # it runs
            kill_named(server.proc.pid, SCHEDULER)
            with pytest.raises(NoriaError) as e:
                for _ in stream:
                    pass
            assert e.value.code == "engine_dead" and "scheduler process exited with code -9" in e.value.message
        assert server.proc.wait(30) == 1
    finally:
        server.stop()

"""The soak's judge: what it calls lost, duplicated or mismatched, and its RSS drift.

The soak itself runs in test_bench_cli.py (a tiny run against a real server); here
its checks are fed outcomes that are known to be wrong, so that they are shown to fail.
"""

from __future__ import annotations

import asyncio

from noria.bench.soak_jobs import Job, Outcome, pick_stop, problems
from noria.bench.soak_report import rss_drift
from noria.bench.soak_surfaces import Multiplexed

GREEDY = Job(0, "greedy", {}, ["abcdef"], [[1, 2, 3]], ["length"])
N2 = Job(1, "n2", {}, ["xy", "zw"], [[4, 5], [6, 7]], ["length", "length"])


def _streamed(job: Job, pieces: list[list[tuple[str, list[int]]]], reasons: list[str], usage: int,
              abort_after: int | None = None) -> Outcome:
    o = Outcome.new("zmq", job, abort_after)
    for i, sample in enumerate(pieces):
        for text, ids in sample:
            o.delta(i, text, ids)
    o.final(reasons, usage)
    return o


def test_a_right_stream_has_no_problem():
    o = _streamed(N2, [[("x", [4]), ("y", [5])], [("zw", [6, 7])]], ["length", "length"], 4)
    assert problems(o) == []


def test_lost_duplicated_and_late_messages_are_named():
    lost = Outcome.new("ws", GREEDY, None)
    lost.delta(0, "abc", [1])
    assert problems(lost) == ["lost: no final message"]
    twice = _streamed(GREEDY, [[("abcdef", [1, 2, 3])]], ["length"], 3)
    twice.final(["length"], 3)
    assert problems(twice)[0].startswith("duplicated")
    late = _streamed(GREEDY, [[("abcdef", [1, 2, 3])]], ["length"], 3)
    late.settle()
    assert late.verdict() == []
    late.delta(0, "g", [4])  # after the final message, and after the check
    assert late.verdict()[0].startswith("duplicated")


def test_a_stream_that_differs_from_the_final_text_is_caught():
    dropped = _streamed(GREEDY, [[("abc", [1]), ("ef", [3])]], ["length"], 2)
    found = problems(dropped)
    assert any("concatenate" in p for p in found) and any("token ids" in p for p in found)
    usage = _streamed(GREEDY, [[("abcdef", [1, 2, 3])]], ["length"], 4)
    assert problems(usage) == ["usage says 4 completion tokens, the deltas carried 3"]
    reason = _streamed(GREEDY, [[("abcdef", [1, 2, 3])]], ["stop"], 3)
    assert "finish reason" in problems(reason)[0]


def test_an_aborted_stream_must_be_a_prefix():
    ok = _streamed(GREEDY, [[("ab", [1])]], ["abort"], 1, abort_after=1)
    assert problems(ok) == []
    wrong = _streamed(GREEDY, [[("ax", [1])]], ["abort"], 1, abort_after=1)
    assert "not a prefix" in problems(wrong)[0]
    # An abort that came too late: the request ended on its own and must then be whole.
    whole = _streamed(GREEDY, [[("ab", [1])]], ["length"], 1, abort_after=1)
    assert any("concatenate" in p for p in problems(whole))


def test_surfaces_without_token_ids_check_usage_against_the_job():
    o = Outcome.new("http", GREEDY, None, with_ids=False)
    o.delta(0, "abcdef", None)
    o.final(["length"], 3)
    assert problems(o) == []
    o.completion_tokens = 5
    assert problems(o) == ["usage says 5 completion tokens, the job makes 3"]
    cut = Outcome.new("sse", GREEDY, 1, with_ids=False)
    cut.delta(0, "ab", None)
    cut.cut = True  # no final owed
    assert problems(cut) == []


def test_the_multiplexed_reader_files_a_second_done_as_a_duplicate():
    async def go() -> Outcome:
        conn = Multiplexed("zmq")
        sent: list[dict] = []

        async def send(msg: dict) -> None:
            sent.append(msg)
            if msg["type"] == "generate":
                rid = msg["request_id"]
                for m in ({"type": "delta", "request_id": rid, "text": "abcdef", "token_ids": [1, 2, 3]},
                          {"type": "done", "request_id": rid, "finish_reason": "length",
                           "usage": {"prompt_tokens": 2, "completion_tokens": 3}}):
                    conn.on_message(m)

        conn.send = send  # type: ignore[method-assign]
        o = await conn.run(GREEDY, None, 5.0)
        o.settle()
        rid = sent[0]["request_id"]
        conn.on_message({"type": "done", "request_id": rid, "finish_reason": "length",
                         "usage": {"prompt_tokens": 2, "completion_tokens": 3}})
        conn.on_message({"type": "delta", "request_id": "nobody", "text": "", "token_ids": []})
        assert conn.stray == 1
        return o

    o = asyncio.run(go())
    assert o.finals == 2 and o.verdict()[0].startswith("duplicated")


def test_pick_stop_takes_a_later_first_occurrence():
    text = "abcabcXYZtail"
    s = pick_stop(text)
    assert s is not None and text.find(s) > 0 and s in text[len(text) // 2:]


def test_rss_drift_uses_medians_after_the_warm_up():
    times = [float(t) for t in range(100)]
    series = [100.0 if t < 10 else 200.0 for t in range(90)] + [210.0] * 10
    d = rss_drift(times, series, settled=10, end=99, window=9)
    assert d["after_warmup_mib"] == 200.0 and d["end_mib"] == 210.0 and d["drift"] == 0.05
    flat = rss_drift(times, [50.0] * 100, settled=10, end=99, window=9)
    assert flat["drift"] == 0.0 and flat["peak_drift"] == 0.0


def test_rss_drift_without_samples_is_not_flat():
    d = rss_drift([0.0, 1.0], [10.0, 10.0], settled=5, end=9, window=1)
    assert d["drift"] is None

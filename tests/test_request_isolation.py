"""No single request may stall the engine, against a real `noria serve` on loopback.

A hostile completions request (n=64 with as many stop strings as the server's limits
allow, and one over those limits: a million of them) goes in while a small streaming
request (the victim) runs: the victim is open before the hostile request is sent and
still open after its answer (else the round runs again with a longer victim). The victim
ends with the text it has alone, the hostile request ends correctly (a stop string still
ends each sample; the oversized one is refused, naming `stop`), and the worker group is
never lost (no worker restart, the group stays live), and the victim never waits 2 s between
two deltas (a bound that a stall breaks and a busy machine does not; `noria bench fuzz`
reports the gaps themselves).

Before, every sample carried every stop string to the scheduler and in the worker's
plan: the scheduler spent seconds building one plan, missed its heartbeats, lost the
worker group, rebuilt the same plan, and nothing moved.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.procs import serve_http
from tests.workers import stats

VICTIM_TOKENS = (200, 400, 800, 1600)  # a longer victim each time one ended before the hostile answer
MAX_STOPS = 200_000  # the server's limit here; the hostile request holds exactly this many
VICTIM_PROMPT = "Once upon a time"
HOSTILE_PROMPT = "The water wheel turns"
HOSTILE_TOKENS = 12
N = 64
# The victim's largest gap between deltas: under 0.5 s here even beside two busy-looping processes
# on 2 cores, seconds to minutes when one request stalled the engine (3 s to 27 s seen). Only a
# stall breaks it, not a slow machine.
STALL = 2.0


@pytest.fixture(scope="module")
def served(demo_path):
    with serve_http("--max-stop-strings", str(MAX_STOPS), "--max-word-chars", str(20 * MAX_STOPS),
                    "--max-model-len", "2048") as s:
        yield s


class Victim(threading.Thread):
    """A greedy SSE completions stream; the arrival time and text of each delta."""

    def __init__(self, http: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = urllib.parse.urlsplit(http)
        self.body = json.dumps({"model": "demo", "prompt": VICTIM_PROMPT, "max_tokens": max_tokens,
                                "temperature": 0.0, "ignore_eos": True, "stream": True})
        self.times: list[float] = []
        self.text = ""
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=300)
            conn.request("POST", "/v1/completions", self.body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                choices = json.loads(data)["choices"]
                if choices and choices[0]["text"]:
                    self.times.append(time.monotonic())
                    self.text += choices[0]["text"]
                    self.first.set()
            conn.close()
        except BaseException as e:  # reported by the test's thread
            self.error = e
        finally:
            self.first.set()


def _post(http: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"{http}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _completion(http: str, prompt: str, max_tokens: int, **kw: object) -> dict:
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **kw}
    status, out = _post(http, json.dumps(body).encode())
    assert status == 200, out
    return out


def _fillers(count: int) -> list[str]:
    # Short stop strings that the demo model's text never holds (a control character).
    return [f"\x1f{i}" for i in range(count)]


def _beside_victim(served, body: bytes) -> tuple[Victim, int, int, dict]:
    """Run the hostile `body` while the victim streams: (victim, its max_tokens, status, reply).
    The victim is open (it has a delta) before the body is sent; the server still holds it after
    the answer, else the victim ended first and the round runs again with a longer one."""
    for tokens in VICTIM_TOKENS:
        victim = Victim(served.http, tokens)
        victim.start()
        assert victim.first.wait(120), "the victim never started"
        status, reply = _post(served.http, body)
        overlapped = stats(served.address).num_open_requests == 1
        victim.join(300)
        assert not victim.is_alive() and victim.error is None, victim.error
        if overlapped:
            return victim, tokens, status, reply
    raise AssertionError(f"a victim of {tokens} tokens ended before the hostile request: nothing was tested")


def _largest_gap(victim: Victim) -> float:
    return max((b - a for a, b in zip(victim.times, victim.times[1:], strict=False)), default=0.0)


def _group_untouched(served) -> None:
    st = stats(served.address).stats
    assert st.worker_restarts == 0 and st.workers_live, st.worker_status


@pytest.fixture(scope="module")
def calm(served):
    """What the victim (at each length) and the hostile prompt produce alone."""
    plain = _completion(served.http, HOSTILE_PROMPT, HOSTILE_TOKENS, ignore_eos=True)
    hostile_text = plain["choices"][0]["text"]
    stop = next(hostile_text[i:i + 3] for i in range(1, len(hostile_text) - 3) if hostile_text[i:i + 3].strip())
    assert "\x1f" not in hostile_text
    body = _hostile_body([*_fillers(MAX_STOPS - 1), stop])
    victim_text = {n: _completion(served.http, VICTIM_PROMPT, n, ignore_eos=True)["choices"][0]["text"]
                   for n in VICTIM_TOKENS}
    return {"victim_text": victim_text, "stop": stop, "hostile_text": hostile_text, "body": body}


def _hostile_body(stop: list[str]) -> bytes:
    return json.dumps({"model": "demo", "prompt": HOSTILE_PROMPT, "max_tokens": HOSTILE_TOKENS, "n": N,
                       "temperature": 0.0, "ignore_eos": True, "stop": stop}).encode()


def test_a_hostile_request_within_the_limits_stalls_nobody(served, calm):
    _group_untouched(served)
    victim, tokens, status, reply = _beside_victim(served, calm["body"])
    assert status == 200, reply
    # Every sample ends at the stop string's first occurrence: stop strings still work.
    want = calm["hostile_text"][:calm["hostile_text"].index(calm["stop"])]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in sorted(reply["choices"], key=lambda c: c["index"])] \
        == [(i, want, "stop") for i in range(N)]
    assert victim.text == calm["victim_text"][tokens]
    assert _largest_gap(victim) < STALL, f"the victim waited {_largest_gap(victim):.2f} s between two deltas"
    _group_untouched(served)


def test_a_million_stop_strings_are_refused_and_stall_nobody(served, calm):
    body = _hostile_body(_fillers(1_000_000))
    assert len(body) > 10 << 20
    victim, tokens, status, reply = _beside_victim(served, body)
    assert status == 400 and reply["error"]["param"] == "stop", reply
    assert victim.text == calm["victim_text"][tokens]
    assert _largest_gap(victim) < STALL, f"the victim waited {_largest_gap(victim):.2f} s between two deltas"
    _group_untouched(served)

"""No single request may stall the engine, against a real `noria serve` on loopback.

A hostile completions request (n=64 with as many stop strings as the server's limits
allow, and one over those limits: a million of them) goes in while a small streaming
request (the victim) runs. The victim's largest gap between deltas stays under
MAX_GAP, it ends with the text it has alone, the hostile request ends correctly (a
stop string still ends each sample; the oversized one is refused, naming `stop`), and
the worker group is never lost (no worker restart, the group stays live).

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

MAX_GAP = 2.0  # seconds between two deltas of the victim
MAX_STOPS = 200_000  # the server's limit here; the hostile request holds exactly this many
VICTIM_PROMPT = "Once upon a time"
HOSTILE_PROMPT = "The water wheel turns"
HOSTILE_TOKENS = 12
N = 64


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

    @property
    def largest_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)), default=0.0)


def _post(http: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"{http}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _completion(http: str, prompt: str, max_tokens: int, **kw: object) -> tuple[dict, float]:
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **kw}
    t0 = time.monotonic()
    status, out = _post(http, json.dumps(body).encode())
    assert status == 200, out
    return out, time.monotonic() - t0


def _fillers(count: int) -> list[str]:
    # Short stop strings that the demo model's text never holds (a control character).
    return [f"\x1f{i}" for i in range(count)]


def _beside_victim(served, victim_tokens: int, body: bytes) -> tuple[Victim, int, dict, float]:
    """Run the hostile `body` while the victim streams; (victim, status, reply, reply time)."""
    victim = Victim(served.http, victim_tokens)
    victim.start()
    assert victim.first.wait(120), "the victim never started"
    status, reply = _post(served.http, body)
    answered = time.monotonic()
    victim.join(300)
    assert not victim.is_alive() and victim.error is None, victim.error
    return victim, status, reply, answered


def _group_untouched(served) -> None:
    st = stats(served.address).stats
    assert st.worker_restarts == 0 and st.workers_live, st.worker_status


@pytest.fixture(scope="module")
def calm(served):
    """What the victim and the hostile prompt produce alone, and how long the victim must run
    to outlast a hostile request (measured here, so that a slow machine gets a longer victim)."""
    t0 = time.monotonic()
    alone, _ = _completion(served.http, VICTIM_PROMPT, 100, ignore_eos=True)
    per_token = (time.monotonic() - t0) / 100
    text = alone["choices"][0]["text"]
    plain, _ = _completion(served.http, HOSTILE_PROMPT, HOSTILE_TOKENS, ignore_eos=True)
    hostile_text = plain["choices"][0]["text"]
    stop = next(hostile_text[i:i + 3] for i in range(1, len(hostile_text) - 3) if hostile_text[i:i + 3].strip())
    assert "\x1f" not in hostile_text
    # The hostile request alone, with its stop strings: its duration sizes the victim.
    body = _hostile_body([*_fillers(MAX_STOPS - 1), stop])
    t0 = time.monotonic()
    status, reply = _post(served.http, body)
    hostile_seconds = time.monotonic() - t0
    assert status == 200, reply
    victim_tokens = min(1800, max(200, int(4 * hostile_seconds / per_token)))
    ref, _ = _completion(served.http, VICTIM_PROMPT, victim_tokens, ignore_eos=True)
    assert ref["choices"][0]["text"].startswith(text)
    return {"victim_tokens": victim_tokens, "victim_text": ref["choices"][0]["text"], "stop": stop,
            "hostile_text": hostile_text, "body": body}


def _hostile_body(stop: list[str]) -> bytes:
    return json.dumps({"model": "demo", "prompt": HOSTILE_PROMPT, "max_tokens": HOSTILE_TOKENS, "n": N,
                       "temperature": 0.0, "ignore_eos": True, "stop": stop}).encode()


def test_a_hostile_request_within_the_limits_stalls_nobody(served, calm):
    _group_untouched(served)
    victim, status, reply, answered = _beside_victim(served, calm["victim_tokens"], calm["body"])
    assert status == 200, reply
    # Every sample ends at the stop string's first occurrence: stop strings still work.
    want = calm["hostile_text"][:calm["hostile_text"].index(calm["stop"])]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in sorted(reply["choices"], key=lambda c: c["index"])] \
        == [(i, want, "stop") for i in range(N)]
    assert victim.times[-1] > answered, "the victim ended before the hostile request: nothing was tested"
    assert victim.text == calm["victim_text"]
    assert victim.largest_gap < MAX_GAP, f"the victim stalled {victim.largest_gap:.2f}s"
    _group_untouched(served)


def test_a_million_stop_strings_are_refused_and_stall_nobody(served, calm):
    body = _hostile_body(_fillers(1_000_000))
    assert len(body) > 10 << 20
    victim, status, reply, answered = _beside_victim(served, calm["victim_tokens"], body)
    assert status == 400 and reply["error"]["param"] == "stop", reply
    assert victim.times[-1] > answered, "the victim ended before the hostile request: nothing was tested"
    assert victim.text == calm["victim_text"]
    assert victim.largest_gap < MAX_GAP, f"the victim stalled {victim.largest_gap:.2f}s"
    _group_untouched(served)

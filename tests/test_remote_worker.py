"""Remote workers on loopback: `noria serve --worker-listen tcp://127.0.0.1:P --num-local-workers 0`
comes up without a worker, `noria worker --connect` serves it with the local engine's greedy
output, a worker that never comes back gives `engine_unavailable` within `--worker-wait` and a
later one brings the engine back; wrong models and protocol versions are refused by name on
both sides."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import msgspec
import pytest
import zmq

from noria import LLM, Client, NoriaError, SamplingParams
from noria.protocol.codec import Codec
from noria.protocol.sockets import free_tcp_port
from noria.protocol.worker_link import WORKER_PROTOCOL_VERSION, Refused, Register, SchedulerToWorker
from tests.procs import serve_http, wait_metrics
from tests.workers import NORIA, health, start_worker, wait_for

PROMPTS = ["Hello", "The river turns the wheel", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
WORKER_WAIT = 3.0
ENGINE = ("--num-kv-blocks", "64", "--max-model-len", "256")


@pytest.fixture(scope="module")
def remote(demo_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("remote") / "serve.log"
    link = f"tcp://127.0.0.1:{free_tcp_port()}"
    with log.open("w") as err, serve_http(
        "--worker-listen", link, "--num-local-workers", "0", *ENGINE, "--worker-timeout", "2",
        "--worker-wait", str(WORKER_WAIT), wait_bridge=False, stderr=err,
    ) as served:
        wait_for("the bridge", lambda: health(served.http)[0], 60)
        yield served, link, log


def _generate(address: str) -> list[list[int]]:
    with Client(address, timeout=60) as c:
        return [c.generate(p, GREEDY).outputs[0].token_ids for p in PROMPTS]


def _unavailable(address: str) -> None:
    """A request with no worker ends with `engine_unavailable`: one still waiting when
    --worker-wait runs out, or one refused on arrival after it. One left waiting for good
    would end with the client's own `timeout` instead."""
    with Client(address, timeout=120) as c, pytest.raises(NoriaError) as e:
        c.generate("anyone there?", GREEDY)
    assert e.value.code == "engine_unavailable" and "no worker" in e.value.message


def _wait_healthy(http: str) -> None:
    wait_for("/health 200", lambda: health(http)[0] == 200, 90)


def test_serve_comes_up_without_a_worker_and_says_why(remote):
    served, link, log = remote
    status, body = health(served.http)
    assert status == 503 and body["status"] == "unavailable"
    assert "no worker" in body["reason"] and link in body["reason"]
    # Up for less than --worker-wait: the request waits, then fails; past it: refused on arrival.
    _unavailable(served.address)
    wait_for("the scheduler's log of the waiting requests failed", lambda: "no worker for" in log.read_text(), 60)
    _unavailable(served.address)


def test_a_remote_worker_serves_dies_and_a_later_one_brings_it_back(remote, demo_path):
    served, link, _ = remote
    with LLM(str(demo_path), num_kv_blocks=64, max_model_len=256) as llm:
        local = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    worker = start_worker(link)
    try:
        _wait_healthy(served.http)
        assert _generate(served.address) == local
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        wait_for("/health 503", lambda: health(served.http)[0] == 503, 60)
        assert "connection to worker rank 0" in health(served.http)[1]["reason"]
        _unavailable(served.address)
        worker = start_worker(link)
        _wait_healthy(served.http)
        assert _generate(served.address) == local
        m = wait_metrics(served.http, lambda m: m["noria_worker_restarts_total"] >= 1)
        assert m["noria_worker_restarts_total"] >= 1 and m["noria_seconds_without_worker"] >= WORKER_WAIT
    finally:
        worker.kill()
        worker.wait()


def test_a_worker_with_another_model_is_refused_on_both_sides(remote, demo_path, tmp_path):
    served, link, log = remote
    other = tmp_path / "other"
    shutil.copytree(demo_path, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-6}))
    worker = start_worker(link, "--model", str(other))
    out, _ = worker.communicate(timeout=60)
    assert worker.returncode == 1
    assert "refused rank 0" in out and "config.json differs" in out
    wait_for("the scheduler's log of the refusal",
             lambda: "refused worker rank 0" in log.read_text() and "config.json differs" in log.read_text(), 60)


def test_a_worker_of_another_protocol_version_is_refused_on_both_sides(remote):
    served, link, log = remote
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(link)
        dealer.send(msgspec.msgpack.encode(Register(999, 0, "cpu", "elsewhere", 4242, 0, None)))
        assert dealer.poll(10_000), "no answer to the registration"
        refused = Codec(SchedulerToWorker).decode(dealer.recv())
    finally:
        dealer.close(linger=0)
        ctx.term()
    assert isinstance(refused, Refused) and f"worker protocol version 999 != {WORKER_PROTOCOL_VERSION}" in refused.reason
    wait_for("the scheduler's log of the refusal",
             lambda: "refused worker rank 0 (elsewhere pid 4242): worker protocol version 999" in log.read_text(), 60)


def test_a_worker_without_a_scheduler_gives_up(tmp_path: Path):
    worker = start_worker(f"tcp://127.0.0.1:{free_tcp_port()}", "--scheduler-wait", "2")
    out, _ = worker.communicate(timeout=120)  # one that never gave up would hang here
    assert worker.returncode == 1 and "no scheduler answered" in out


@pytest.mark.parametrize("host", ["0.0.0.0", "*"])
def test_a_clear_text_worker_link_on_every_interface_is_refused_unless_insecure(host):
    link = f"tcp://{host}:{free_tcp_port()}"
    out = subprocess.run([*NORIA, "serve", "--worker-listen", link, "--num-local-workers", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "refusing to bind the worker link" in out.stderr
    assert "--curve-keys" in out.stderr and "--insecure" in out.stderr

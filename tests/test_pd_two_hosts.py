"""Prefill/decode disaggregation across two hosts (tests/netns.py: this namespace as host A, a new
one as host B): the producer on B, the consumer and vllm-router's `--vllm-pd-disaggregation` on
A. The KV blocks and the releases cross the veth under CURVE, with the key folder both engines
share; greedy output is a single engine's."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator

import msgspec
import pytest

from noria.frontend.local_server import LocalServer
from noria.protocol.security import generate_keys
from tests import netns
from tests.procs import scrape_metrics, wait_metrics
from tests.test_pd_disaggregation import _complete, _prompt, _tokens, pd_router
from tests.test_routers_two_hosts import _wait_health

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=f"no network namespaces: {netns.unavailable()}")

FLAGS = ["--num-kv-blocks", "256", "--max-model-len", "1024", "--seed", "0"]


class _Remote:
    def __init__(self, http: str) -> None:
        self.http = http


@pytest.fixture(scope="module")
def pd_hosts(demo_path, tmp_path_factory) -> Iterator[tuple[_Remote, LocalServer, LocalServer]]:
    keys = tmp_path_factory.mktemp("pd-keys")
    generate_keys(keys)  # one folder for both engines: the scheduler pair serves, the worker pair connects
    generate_keys(keys, "noria-bridge")  # made here, not by both servers at once
    with netns.two_hosts() as hosts:
        port = 18090
        producer_config = msgspec.json.encode({"kv_connector": "NoriaConnector", "kv_role": "kv_producer",
                                               "kv_ip": hosts.addr_b, "kv_port": 14579}).decode()
        b = hosts.popen_on_b([sys.executable, "-m", "noria.frontend.cli", "serve", "--host", "0.0.0.0", "--port",
                              str(port), "--zmq-port", "15655", "--curve-keys", str(keys), *FLAGS,
                              "--kv-transfer-config", producer_config], stdout=subprocess.DEVNULL)
        consumer = LocalServer(*FLAGS, "--curve-keys", str(keys), "--kv-transfer-config",
                               '{"kv_connector": "NoriaConnector", "kv_role": "kv_consumer"}')
        single = LocalServer(*FLAGS)
        try:
            consumer.wait(http=True, zmq=False)
            single.wait(http=True)
            producer = _Remote(f"http://{hosts.addr_b}:{port}")
            _wait_health(producer.http, b)
            yield producer, consumer, single
        finally:
            consumer.stop()
            single.stop()
            b.send_signal(2)  # Ctrl-C: the server drains and stops its children
            b.wait(timeout=60)


def test_pd_across_hosts_under_curve(pd_hosts):
    producer, consumer, single = pd_hosts
    prompt = _prompt(random.Random(7), 70)
    answer = _complete(producer.http, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = answer["kv_transfer_params"]
    assert params["remote_host"] == params["remote_endpoints"][0].split("//")[1].split(":")[0] != "127.0.0.1"
    with pd_router(producer, consumer) as url:  # type: ignore[arg-type]
        assert _tokens(_complete(url, prompt)) == _tokens(_complete(single.http, prompt))
    m = wait_metrics(consumer.http, lambda m: m["noria_kv_pulls_ok_total"] >= 1)
    assert m["noria_kv_pulls_ok_total"] == 1 and m["noria_kv_pulls_failed_total"] == 0
    assert m["noria_kv_pull_tokens_total"] == len(prompt) - 1
    # The producer heard the release over the veth (and the unpulled transfer above still waits).
    m = wait_metrics(producer.http, lambda m: m["noria_kv_transfers_released_total"] >= 1)
    assert m["noria_kv_transfers_released_total"] == 1 and m["noria_kv_transfers_held"] == 1
    assert scrape_metrics(producer.http)["noria_kv_transfers_expired_total"] == 0


def test_a_consumer_without_the_keys_gets_no_blocks(pd_hosts):
    producer, _, single = pd_hosts
    stranger = LocalServer(*FLAGS, "--kv-transfer-config",
                           '{"kv_connector": "NoriaConnector", "kv_role": "kv_consumer", '
                           '"kv_connector_extra_config": {"transfer_timeout": 2}}')
    try:
        stranger.wait(http=True)
        prompt = _prompt(random.Random(8), 50)
        params = _complete(producer.http, prompt, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
        # Its pull meets a CURVE server it has no key for: it computes the prompt itself.
        got = _complete(stranger.http, prompt, kv_transfer_params=params)
        assert _tokens(got) == _tokens(_complete(single.http, prompt))
        m = wait_metrics(stranger.http, lambda m: m["noria_kv_pulls_failed_total"] >= 1)
        assert m["noria_kv_pulls_failed_total"] == 1 and m["noria_kv_pulls_ok_total"] == 0
    finally:
        stranger.stop()

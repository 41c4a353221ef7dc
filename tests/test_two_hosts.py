"""Two hosts (tests/netns.py: this namespace as host A, a new one as host B, a veth pair
between): `noria serve` on A binds the worker link on A's veth address with CURVE, `noria
worker` runs on B. Greedy output equals the local engine's; a worker whose key is not
authorised never registers and the scheduler logs who tried; a network cut loses the worker
within --worker-timeout, and once mended it registers again and the requests finish."""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from noria import LLM, Client, SamplingParams
from noria.protocol.security import generate_keys
from noria.protocol.sockets import free_tcp_port
from tests import netns
from tests.faults import Tripwire
from tests.procs import serve_http
from tests.test_engine_parity import _with_tokenizer
from tests.test_remote_worker import ENGINE
from tests.tiny_models import make_checkpoint
from tests.workers import NORIA, health, stream_all, wait_for, wait_stats, worker_cmd

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=f"no network namespaces: {netns.unavailable()}")

PROMPTS = [f"Host B computes request {i}" for i in range(8)]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _worker_keys(keys: Path, dest: Path, pair_from: Path | None = None) -> Path:
    """What an operator copies to host B: the scheduler's public key and one worker pair."""
    dest.mkdir()
    shutil.copy(keys / "scheduler.key", dest)
    for f in ("worker.key", "worker.key_secret"):
        shutil.copy((pair_from or keys) / f, dest)
    return dest


@pytest.fixture(scope="module")
def local_outputs(demo_path):
    with LLM(str(demo_path), num_kv_blocks=64, max_model_len=256) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def hosts():
    with netns.two_hosts() as h:
        yield h


@pytest.fixture(scope="module")
def cluster(hosts, demo_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-hosts")
    keys = tmp / "keys"
    made = subprocess.run([*NORIA, "keygen", str(keys)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and f"wrote {keys}/authorized/worker.key" in made.stdout
    assert "copy to the worker's host" in made.stdout
    link = f"tcp://{hosts.addr_a}:{free_tcp_port(hosts.addr_a)}"
    log = tmp / "serve.log"
    with log.open("w") as err, serve_http(
        "--worker-listen", link, "--num-local-workers", "0", "--curve-keys", str(keys), *ENGINE,
        "--worker-timeout", "2", "--worker-wait", "60", wait_bridge=False, stderr=err,
    ) as served:
        wait_for("the bridge", lambda: health(served.http)[0], 60)
        yield served, link, keys, log, tmp


def test_a_worker_on_host_b_serves_with_the_local_engines_output(cluster, hosts, local_outputs):
    served, link, keys, _, tmp = cluster
    wkeys = _worker_keys(keys, tmp / "b-keys")
    hosts.popen_on_b(worker_cmd(link, "--curve-keys", str(wkeys)))
    wait_for("/health 200", lambda: health(served.http)[0] == 200, 90)
    outs = asyncio.run(stream_all(served.address, PROMPTS, GREEDY))
    assert [o.token_ids for o in outs] == local_outputs


def test_a_cut_network_loses_the_worker_and_mending_it_brings_it_back(cluster, hosts, local_outputs):
    served, *_ = cluster
    wait_for("/health 200", lambda: health(served.http)[0] == 200, 90)
    # The cut lands on the 8th delta, from the thread that counts it: the requests are mid-way.
    deltas = Tripwire((8, hosts.cut))
    during_cut: list[int] = []

    async def run() -> list:
        streams = asyncio.ensure_future(stream_all(served.address, PROMPTS, GREEDY, deltas))
        try:
            await asyncio.to_thread(wait_for, "the cut", lambda: deltas.fired, 120)
            lost = await asyncio.to_thread(
                wait_stats, served.address, lambda s: not s.stats.workers_live, "the worker to be lost", 60)
            assert "silent" in lost.stats.worker_status
            during_cut.append(deltas[0])
            await asyncio.sleep(1.0)  # a window in which no delta may arrive, not a synchronisation
            during_cut.append(deltas[0])
        finally:
            hosts.mend()
        return await streams

    outs = asyncio.run(run())
    assert during_cut[0] == during_cut[1], "requests kept streaming while the worker was cut off"
    assert [o.token_ids for o in outs] == local_outputs
    after = wait_stats(served.address, lambda s: s.stats.workers_live and s.stats.num_running == 0, "idle again")
    assert after.stats.worker_restarts >= 1 and after.stats.kv_cache_usage == 0


def test_a_worker_with_an_unlisted_key_never_registers(cluster, hosts):
    served, link, keys, log, tmp = cluster
    other = tmp / "other-keys"
    generate_keys(other)  # a pair the scheduler's folder has never authorised
    wkeys = _worker_keys(keys, tmp / "intruder", pair_from=other)
    intruder = hosts.popen_on_b(worker_cmd(link, "--curve-keys", str(wkeys), "--scheduler-wait", "3"),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = intruder.communicate(timeout=60)
    assert intruder.returncode == 1 and "no scheduler answered" in out
    public = (other / "worker.key").read_text().split('public-key = "')[1].split('"')[0]
    text = log.read_text()
    assert "not authorised" in text and public in text and hosts.addr_b in text
    assert f"pid {intruder.pid})" not in text, "the intruder got as far as registering"


def test_a_clear_text_link_on_the_network_is_refused(hosts):
    link = f"tcp://{hosts.addr_a}:{free_tcp_port(hosts.addr_a)}"
    out = subprocess.run([*NORIA, "serve", "--worker-listen", link, "--num-local-workers", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "refusing to bind the worker link" in out.stderr and "--curve-keys" in out.stderr
    assert "--insecure" in out.stderr


def test_a_tensor_parallel_group_across_the_hosts_matches_one_rank(hosts, demo_path, tmp_path):
    """Rank 0 on host B hosts the gloo rendezvous, rank 1 on host A joins it; --insecure
    lets the link run in the clear on a network the operator trusts."""
    ckpt = _with_tokenizer(make_checkpoint("llama", tmp_path / "llama", num_key_value_heads=4), demo_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(2, 40))] for _ in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = ("--model", str(ckpt), "--dtype", "float32", "--num-kv-blocks", "32", "--block-size", "16")
    with LLM(str(ckpt), dtype="float32", num_kv_blocks=32) as llm:
        one_rank = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    link = f"tcp://{hosts.addr_a}:{free_tcp_port(hosts.addr_a)}"
    with serve_http(*engine, "--tensor-parallel-size", "2", "--worker-listen", link, "--num-local-workers", "0",
                    "--insecure", wait_bridge=False) as served:
        hosts.popen_on_b(worker_cmd(link, "--rank", "0"))
        rank1 = subprocess.Popen(worker_cmd(link, "--rank", "1"))
        try:
            wait_for("/health 200", lambda: health(served.http)[0] == 200, 120)
            with Client(served.address, timeout=60) as c:
                two_ranks = [c.generate(p, params).outputs[0].token_ids for p in prompts]
        finally:
            rank1.kill()
            rank1.wait()
    assert two_ranks == one_rank

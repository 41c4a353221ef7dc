"""The ZMQ client API: loopback unless `--zmq-host` says otherwise (whatever `--host` is),
optional CURVE with an allow-list (the bridge of `noria serve` gets through by a key of its
own), and no pickle-like deserialisation anywhere in the product."""

from __future__ import annotations

import ast
import shutil
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth

from noria import Client, NoriaError, SamplingParams
from noria.protocol.security import generate_keys
from tests.procs import serve_http

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("noria", "protocol", "frontend", "scheduler", "worker", "kernels", "bench")


def _listen_addresses(port: int) -> set[str]:
    """Local IPv4 addresses listening on `port`, from /proc/net/tcp (state 0A)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        ip_hex, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            out.add(".".join(str(int(ip_hex[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


def test_exposing_http_does_not_expose_the_zmq_api(demo_path):
    with serve_http("--host", "0.0.0.0", "--num-kv-blocks", "64") as s:
        zmq_port = int(s.address.rsplit(":", 1)[1])
        http_port = int(s.http.rsplit(":", 1)[1])
        assert _listen_addresses(zmq_port) == {"127.0.0.1"}
        assert _listen_addresses(http_port) == {"0.0.0.0"}


def _client_folder(keys: Path, name: str, dest: Path) -> Path:
    """What a client host gets: the server's public key and its own pair."""
    dest.mkdir()
    for f in ("scheduler.key", f"{name}.key", f"{name}.key_secret"):
        shutil.copyfile(keys / f, dest / f)
    return dest


def test_keygen_writes_an_authorised_pair(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "noria.frontend.cli", "keygen", str(tmp_path / "k"), "--name", "bob"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "k" / "scheduler.key_secret").exists() and (tmp_path / "k" / "authorized" / "bob.key").exists()
    assert zmq.auth.load_certificate(str(tmp_path / "k" / "bob.key_secret"))[1] is not None


def test_curve_admits_authorised_clients_only(demo_path, tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys, "alice")
    alice = _client_folder(keys, "alice", tmp_path / "alice")
    mallory = tmp_path / "mallory"  # knows the server's public key, but her key is not authorised
    mallory.mkdir()
    shutil.copyfile(keys / "scheduler.key", mallory / "scheduler.key")
    zmq.auth.create_certificates(str(mallory), "mallory")
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with serve_http("--zmq-curve-keys", str(keys), "--num-kv-blocks", "64", wait_zmq=False) as s:
        with Client(s.address, curve_keys=alice) as c:
            assert len(c.generate("Hello", greedy).outputs[0].token_ids) == 4
        # The bridge of `noria serve` holds a key of its own: HTTP still reaches the engine.
        req = urllib.request.Request(f"{s.http}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                     data=msgspec.json.encode({"prompt": "Hello", "max_tokens": 4}))
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        with Client(s.address, curve_keys=mallory, timeout=3.0, heartbeat_timeout=3.0) as c, \
                pytest.raises(NoriaError):
            c.hello()
        ctx = zmq.Context()
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(s.address)
        plain.send(msgspec.msgpack.encode({"type": "hello"}))
        assert not plain.poll(3000)  # a client in the clear gets nothing back
        plain.close()
        ctx.term()
    assert (keys / "authorized" / "noria-bridge.key").exists()


# Ways to turn bytes into arbitrary Python objects (or code): none may appear in the product.
_BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib",
                   "multiprocessing"}
_PICKLING_SOCKET_CALLS = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}


def _violations(tree: ast.AST, label: str) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        where = f"{label}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            bad += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in _BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _BANNED_MODULES:
            bad.append(f"{where} from {node.module}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, owner = node.func.attr, node.func.value
            owner_name = owner.id if isinstance(owner, ast.Name) else ""
            kw = {k.arg: k.value for k in node.keywords}
            safe_torch = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
            if name in _PICKLING_SOCKET_CALLS:
                bad.append(f"{where} .{name}()")
            elif owner_name == "torch" and name == "load" and not safe_torch:
                bad.append(f"{where} torch.load without weights_only=True")
            elif owner_name in ("np", "numpy") and name == "load" and "allow_pickle" in kw:
                bad.append(f"{where} numpy.load(allow_pickle=...)")
    return bad


def test_no_pickle_anywhere_in_the_product():
    bad = []
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob("*.py"):
            bad += _violations(ast.parse(path.read_text(), str(path)), str(path.relative_to(ROOT)))
    assert not bad, bad


def test_the_pickle_scan_sees_what_it_bans():
    src = ("import pickle\nfrom marshal import loads\nimport torch\nsock.recv_pyobj()\ntorch.load('x')\n"
           "torch.load('y', weights_only=True)\nimport numpy as np\nnp.load('z', allow_pickle=True)\n")
    assert len(_violations(ast.parse(src), "x")) == 5

"""CURVE on the worker link: keys from `generate_keys`, an authorised worker gets through,
an unlisted one never reaches the application and is logged, and binding on the network in
the clear is refused."""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path

import pytest
import zmq

from noria.protocol.security import (
    CurveServer,
    KeyFolderError,
    apply_curve_client,
    check_exposure,
    generate_keys,
    is_loopback,
)


def _pair(server_dir: Path, client_dir: Path) -> bytes | None:
    """One DEALER -> ROUTER round over tcp with CURVE; the bytes that arrived, or None."""
    ctx = zmq.Context()
    server = CurveServer(ctx, server_dir)
    router = ctx.socket(zmq.ROUTER)
    server.apply(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    apply_curve_client(dealer, client_dir)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    with contextlib.suppress(zmq.Again):  # a refused handshake leaves nowhere to queue
        dealer.send(b"hello", zmq.NOBLOCK)
    got = router.recv_multipart()[1] if router.poll(1500) else None
    for s in (router, dealer):
        s.close(linger=0)
    server.stop()
    ctx.term()
    return got


def _worker_folder(src: Path, dest: Path, name: str = "worker") -> Path:
    """What an operator copies to a worker's host: the scheduler's public key and one pair."""
    dest.mkdir()
    for f in ("scheduler.key", f"{name}.key", f"{name}.key_secret"):
        shutil.copy(src / f, dest / f)
    return dest


def test_keygen_writes_pyzmq_certificates(tmp_path: Path) -> None:
    written = generate_keys(tmp_path / "keys")
    names = sorted(p.relative_to(tmp_path / "keys").as_posix() for p in written)
    assert names == ["authorized/worker.key", "scheduler.key", "scheduler.key_secret", "worker.key", "worker.key_secret"]
    assert (tmp_path / "keys/worker.key_secret").stat().st_mode & 0o077 == 0
    # A second call adds a worker and keeps the scheduler's pair.
    before = (tmp_path / "keys/scheduler.key").read_bytes()
    generate_keys(tmp_path / "keys", "host2")
    assert (tmp_path / "keys/scheduler.key").read_bytes() == before
    assert (tmp_path / "keys/authorized/host2.key").exists()


def test_authorised_worker_connects(tmp_path: Path) -> None:
    generate_keys(tmp_path / "keys")
    client = _worker_folder(tmp_path / "keys", tmp_path / "w")
    assert _pair(tmp_path / "keys", client) == b"hello"


def test_unlisted_worker_is_refused_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    generate_keys(tmp_path / "keys")
    generate_keys(tmp_path / "other")  # a pair the scheduler has never seen
    client = tmp_path / "w"
    client.mkdir()
    shutil.copy(tmp_path / "keys/scheduler.key", client)
    for f in ("worker.key", "worker.key_secret"):
        shutil.copy(tmp_path / "other" / f, client)
    with caplog.at_level(logging.WARNING, logger="noria.security"):
        assert _pair(tmp_path / "keys", client) is None
    assert any("not authorised" in r.message and "127.0.0.1" in r.message for r in caplog.records)


def test_wrong_server_key_gets_nothing_through(tmp_path: Path) -> None:
    generate_keys(tmp_path / "keys")
    generate_keys(tmp_path / "impostor")
    client = _worker_folder(tmp_path / "keys", tmp_path / "w")
    shutil.copy(tmp_path / "impostor/scheduler.key", client / "scheduler.key")
    assert _pair(tmp_path / "keys", client) is None


def test_key_folder_errors_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(KeyFolderError, match="scheduler.key_secret is missing"):
        CurveServer(zmq.Context.instance(), tmp_path)
    generate_keys(tmp_path / "keys")
    generate_keys(tmp_path / "keys", "second")
    with pytest.raises(KeyFolderError, match="exactly one worker key pair"):
        apply_curve_client(zmq.Context.instance().socket(zmq.DEALER), tmp_path / "keys")


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("tcp://127.0.0.1:5000", True), ("tcp://127.8.9.1:5000", True), ("tcp://[::1]:5000", True),
     ("tcp://localhost:1", True), ("ipc:///tmp/x", True), ("tcp://0.0.0.0:5000", False),
     ("tcp://*:5000", False), ("tcp://10.77.0.1:5000", False), ("tcp://eth0:5000", False)],
)
def test_loopback_addresses(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_clear_network_bind_is_refused_unless_secured_or_insecure() -> None:
    with pytest.raises(ValueError, match="--curve-keys DIR.*--insecure"):
        check_exposure("tcp://0.0.0.0:6000", None, False)
    check_exposure("tcp://0.0.0.0:6000", "/keys", False)
    check_exposure("tcp://0.0.0.0:6000", None, True)
    check_exposure("tcp://127.0.0.1:6000", None, False)

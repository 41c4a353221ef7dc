"""ZMQ CURVE for links that leave the host: key files, the allow-list, and the exposure rule.

Key folder layout (what `noria keygen DIR` writes, pyzmq's own certificate format):

    DIR/scheduler.key, DIR/scheduler.key_secret   the scheduler's pair (the CURVE server)
    DIR/NAME.key, DIR/NAME.key_secret              one pair per worker (default NAME: worker)
    DIR/authorized/NAME.key                        public keys the scheduler lets in

The scheduler's host keeps the whole folder. A worker's host needs `scheduler.key` (public)
and its own pair, nothing else: `scp DIR/scheduler.key DIR/worker.key DIR/worker.key_secret`.
Authentication goes through ZAP (`zmq.auth`); no crypto is written here.
"""

from __future__ import annotations

import ipaddress
import logging
import shutil
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("noria.security")

SERVER_NAME = "scheduler"
AUTHORIZED = "authorized"


class KeyFolderError(ValueError):
    """A key folder that cannot be used; the message says what is missing."""


def generate_keys(folder: str | Path, name: str = "worker") -> list[Path]:
    """Write the scheduler's pair (once) and a pair for `name`, authorised. Returns new files."""
    folder = Path(folder)
    if name == SERVER_NAME or not name or "/" in name:
        raise KeyFolderError(f"cannot name a worker key {name!r}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / AUTHORIZED).mkdir(exist_ok=True)
    written: list[Path] = []
    for who in (SERVER_NAME, name):
        if (folder / f"{who}.key_secret").exists():
            continue
        public, secret = zmq.auth.create_certificates(str(folder), who)
        Path(secret).chmod(0o600)
        written += [Path(public), Path(secret)]
    allowed = folder / AUTHORIZED / f"{name}.key"
    if not allowed.exists():
        shutil.copyfile(folder / f"{name}.key", allowed)
        written.append(allowed)
    return written


BRIDGE_NAME = "noria-bridge"


def bridge_key_folder(folder: str | Path) -> str:
    """A private folder that lets `noria serve`'s own bridge through a CURVE-protected client API.

    The bridge's pair is made once in `folder` (and authorised there, like any client's);
    the returned temporary folder holds the server's public key and that pair, the layout
    `apply_curve_client` reads. The caller removes it."""
    import tempfile

    generate_keys(folder, BRIDGE_NAME)
    private = Path(tempfile.mkdtemp(prefix="noria-bridge-keys-"))  # mode 0700
    for name in (f"{SERVER_NAME}.key", f"{BRIDGE_NAME}.key", f"{BRIDGE_NAME}.key_secret"):
        shutil.copyfile(Path(folder) / name, private / name)
    (private / f"{BRIDGE_NAME}.key_secret").chmod(0o600)
    return str(private)


def _load(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.exists():
        raise KeyFolderError(f"{path} is missing (make keys with `noria keygen {path.parent}`)")
    public, private = zmq.auth.load_certificate(str(path))
    if secret and private is None:
        raise KeyFolderError(f"{path} holds no secret key")
    return public, private


class CurveServer:
    """Turns a bound socket into a CURVE server that admits only authorised public keys.

    Refusals are logged with the peer's address and key: an operator must see who tried.
    """

    def __init__(self, ctx: zmq.Context, folder: str | Path) -> None:
        folder = Path(folder)
        self.public, self.secret = _load(folder / f"{SERVER_NAME}.key_secret", secret=True)
        allow_dir = folder / AUTHORIZED
        if not allow_dir.is_dir() or not any(allow_dir.glob("*.key")):
            raise KeyFolderError(f"{allow_dir} lists no worker keys (add one with `noria keygen {folder} --name NAME`)")
        self.auth = _LoggingAuthenticator(ctx)
        self.auth.start()
        # The callback re-reads the folder, so a key added while serving is honoured.
        self.auth.configure_curve_callback(domain="*", credentials_provider=_AllowList(allow_dir))

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        self.auth.stop()


def apply_curve_client(sock: zmq.Socket, folder: str | Path) -> None:
    """Set a connecting socket's CURVE keys: its own pair and the scheduler's public key."""
    folder = Path(folder)
    server_public, _ = _load(folder / f"{SERVER_NAME}.key", secret=False)
    pairs = sorted(p for p in folder.glob("*.key_secret") if p.name != f"{SERVER_NAME}.key_secret")
    if len(pairs) > 1:  # a server's folder also holds its bridge's own pair, which is no worker's
        pairs = [p for p in pairs if p.name != f"{BRIDGE_NAME}.key_secret"]
    if len(pairs) != 1:
        found = ", ".join(p.name for p in pairs) or "none"
        raise KeyFolderError(f"{folder} must hold exactly one worker key pair besides the scheduler's (found: {found})")
    public, secret = _load(pairs[0], secret=True)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


class _AllowList:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def callback(self, domain: str, key: bytes) -> bool:
        for path in self.folder.glob("*.key"):
            try:
                public, _ = zmq.auth.load_certificate(str(path))
            except (OSError, ValueError):
                continue
            if public == key:
                return True
        return False


class _LoggingAuthenticator(ThreadAuthenticator):
    async def handle_zap_message(self, msg: list[bytes]) -> None:
        await super().handle_zap_message(msg)
        # The reply has gone; read our own verdict back from the allow-list for the log.
        if len(msg) >= 7 and msg[5] == b"CURVE":
            address = msg[3].decode("utf-8", "replace")
            key = zmq.utils.z85.encode(msg[6]).decode()
            providers = self.credentials_providers.get("*")
            if providers is not None and not providers.callback("*", key.encode()):
                log.warning("refused a worker link from %s: public key %s is not authorised", address, key)


def is_loopback(address: str) -> bool:
    """ipc:// and inproc:// never leave the host; tcp:// does unless bound to loopback."""
    parts = urlsplit(address)
    if parts.scheme in ("ipc", "inproc"):
        return True
    host = (parts.hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # `*`, an interface name or a host name: assume it is reachable


def check_exposure(address: str, curve_keys: str | None, insecure: bool, what: str = "worker link") -> None:
    """Refuse to bind a link on the network in the clear unless the operator said so."""
    if curve_keys or insecure or is_loopback(address):
        return
    raise ValueError(
        f"refusing to bind the {what} on {address} without encryption: anyone who reaches it "
        "could register as a worker and read prompts. Pass --curve-keys DIR (make one with "
        "`noria keygen DIR`), or --insecure on a trusted network."
    )

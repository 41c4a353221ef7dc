"""`noria bench fuzz --inputs N`: bad input against every surface of one `noria serve`.

Hypothesis draws ZMQ frames (structured maps and raw bytes), websocket messages,
HTTP requests and raw HTTP bytes; after each input the server must answer with a
documented error or a normal reply, never hang, and end every request it
accepted. Every `--check-every` inputs (and at the end) the engine must be idle
with no KV block in use, its block check consistent, and a greedy request must
give what it gave before the first input. At the end the server's log must hold
no traceback, and the server must exit 0 on Ctrl-C.

Then, on a server of their own, the hostile shapes of bench/fuzz_hostile.py (huge lists
and integers, abort races, a client that does not read, deep JSON, bad UTF-8), each with
a victim stream beside it: per shape the answer, the victim's largest gap between chunks
and whether its text was unchanged (`--hostile off|only`, `--hostile-scale`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from noria.bench import fuzz_hostile as hostile
from noria.bench import fuzz_inputs as inputs
from noria.bench.fuzz_drivers import (
    Violation,
    WsProbe,
    ZmqProbe,
    check_engine,
    http_exchange,
    raw_http_exchange,
    reference_output,
)
from noria.frontend.local_server import LocalServer

SERVER_FLAGS = ("--num-kv-blocks", "64", "--max-model-len", "128", "--max-num-seqs", "16")
PROBE_PROMPT = [1, 17, 42, 99, 7]
SURFACES = ("zmq", "zmq_bytes", "ws", "http", "http_raw")


class FuzzSession:
    """One server, a probe per surface, and the answers counted per surface."""

    def __init__(self, log_path: Path, *flags: str, check_every: int = 500) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.server = LocalServer(*(flags or SERVER_FLAGS), log=self.log)
        self.server.wait(http=True)
        self.address = self.server.address
        url = urlsplit(self.server.http)
        self.host, self.port = url.hostname or "127.0.0.1", int(url.port or 80)
        self.reference = reference_output(self.address, PROBE_PROMPT)
        self.zmq = ZmqProbe(self.address)
        self._ws: WsProbe | None = None
        self.check_every = check_every
        self.counts: dict[str, Counter[str]] = {s: Counter() for s in SURFACES}
        self.seconds: dict[str, float] = {}

    @property
    def ws(self) -> WsProbe:
        if self._ws is None:
            self._ws = WsProbe(f"ws://{self.host}:{self.port}/v1/stream", self.zmq)
        return self._ws

    def _after(self, surface: str, answer: Counter[str] | str) -> None:
        counts = self.counts[surface]
        counts.update(answer if isinstance(answer, Counter) else [answer])
        counts["inputs"] += 1
        if self.server.proc.poll() is not None:
            raise Violation(f"the server exited with {self.server.proc.returncode}")
        if counts["inputs"] % self.check_every == 0:
            self.check()

    def check(self) -> None:
        check_engine(self.address, PROBE_PROMPT, self.reference)

    def one(self, surface: str, value: Any) -> None:
        if surface == "zmq":
            answer: Counter[str] | str = self.zmq.exchange([msgspec.msgpack.encode(m) for m in value])
        elif surface == "zmq_bytes":
            answer = self.zmq.exchange(value)
        elif surface == "ws":
            answer = self.ws.exchange(value)
        elif surface == "http":
            answer = str(http_exchange(self.host, self.port, *value))
        else:
            answer = raw_http_exchange(self.host, self.port, value).decode("latin-1")[:12] or "closed"
        self._after(surface, answer)

    def run(self, surface: str, n: int, *, shrink: bool = True) -> None:
        """Draw `n` inputs for `surface` with hypothesis and check each answer."""
        t0 = time.perf_counter()
        run_examples(STRATEGIES[surface], lambda v: self.one(surface, v), n, shrink=shrink)
        self.check()
        self.seconds[surface] = self.seconds.get(surface, 0.0) + time.perf_counter() - t0

    def close(self) -> int:
        """Stop the server; its exit code. Raises Violation if its log shows a traceback."""
        if self._ws is not None:
            self._ws.close()
        self.zmq.close()
        rc = self.server.stop()
        self.log.close()
        text = self.log_path.read_text(errors="replace")
        if "Traceback" in text:
            start = text.index("Traceback")
            raise Violation(f"the server logged a traceback:\n{text[start:start + 3000]}")
        return rc


STRATEGIES: dict[str, st.SearchStrategy[Any]] = {
    "zmq": st.lists(inputs.client_maps(), min_size=1, max_size=3),
    "zmq_bytes": st.lists(inputs.msgpack_frames(), min_size=1, max_size=2),
    "ws": inputs.ws_messages(),
    "http": inputs.http_requests(),
    "http_raw": inputs.RAW_HTTP,
}


def run_examples(strategy: st.SearchStrategy[Any], fn: Callable[[Any], None], n: int, *, shrink: bool) -> None:
    from hypothesis import Phase

    phases = [Phase.generate, Phase.target] + ([Phase.shrink] if shrink else [])

    @settings(max_examples=n, deadline=None, database=None, phases=phases, suppress_health_check=list(HealthCheck),
              print_blob=True)
    @given(strategy)
    def each(value: Any) -> None:
        fn(value)

    each()


def split(total: int) -> dict[str, int]:
    """`total` inputs over the surfaces: mostly the ZMQ API (the engine's own door), raw HTTP least."""
    weights = {"zmq": 3, "zmq_bytes": 2, "ws": 2, "http": 2, "http_raw": 1}
    return {s: max(1, total * w // sum(weights.values())) for s, w in weights.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=10_000, help="inputs in all, over every surface")
    ap.add_argument("--check-every", type=int, default=1000, help="engine invariants every this many inputs")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--hostile", choices=["on", "off", "only"], default="on",
                    help="after the drawn inputs, the hostile shapes with a victim stream (bench/fuzz_hostile.py) on "
                         "a server of their own; `only`: those alone")
    ap.add_argument("--hostile-scale", type=float, default=1.0, metavar="F",
                    help="sizes of the hostile shapes' lists, depths and strings, times F (1: 100,000 stop strings...)")
    ap.add_argument("--shape", action="append", default=None, help="run this hostile shape only (repeatable)")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"inputs": args.inputs, "violations": 0, "cpus": os.cpu_count()}
    rc = 0
    with tempfile.TemporaryDirectory(prefix="noria-fuzz-") as tmp:
        if args.hostile != "only":
            session = FuzzSession(Path(tmp) / "server.log", check_every=args.check_every)
            try:
                for surface, n in split(args.inputs).items():
                    session.run(surface, n, shrink=False)
                    print(f"{surface}: {n} inputs in {session.seconds[surface]:.1f}s: {dict(session.counts[surface])}",
                          flush=True)
            finally:
                rc = session.close()
            report.update(server_exit=rc, seconds=session.seconds,
                          answers={s: dict(c) for s, c in session.counts.items()})
        if args.hostile != "off":
            results, hostile_rc = run_hostile_session(Path(tmp) / "hostile.log", args.hostile_scale, args.shape)
            rc = rc or hostile_rc
            report.update(hostile=hostile.as_json(results), hostile_scale=args.hostile_scale, hostile_exit=hostile_rc)
            print(hostile.table(results))
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if rc == 0 else 1


def run_hostile_session(log_path: Path, scale: float, only: list[str] | None = None,
                        ) -> tuple[list[hostile.ShapeResult], int]:
    """The hostile shapes against a server of their own; (results, its exit code). Raises
    Violation if an answer breaks the protocol, the engine does not come back to idle or its
    greedy output changed, or the server logged a traceback."""
    with open(log_path, "wb") as log:
        server = LocalServer(*hostile.SERVER_FLAGS, log=log)
        try:
            server.wait(http=True)
            reference = reference_output(server.address, PROBE_PROMPT)
            url = urlsplit(server.http)
            results = hostile.run_hostile(url.hostname or "127.0.0.1", int(url.port or 80), scale, only,
                                          log=lambda line: print(line, flush=True))
            check_engine(server.address, PROBE_PROMPT, reference)
        finally:
            rc = server.stop()
    text = log_path.read_text(errors="replace")
    if "Traceback" in text:
        start = text.index("Traceback")
        raise Violation(f"the server logged a traceback:\n{text[start:start + 3000]}")
    return results, rc


if __name__ == "__main__":
    raise SystemExit(main())

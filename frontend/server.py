"""The frontend's ZMQ ROUTER API: clients (DEALER) send msgpack maps, get deltas back.

One thread polls the client socket and the scheduler's output socket; it
blocks when there is nothing to do. A large `generate` (a frame over
LARGE_REQUEST bytes) is validated, templated and tokenized on a helper thread
instead (`FrontendCore.prepare`), so that one request never holds up the others'
deltas or the liveness answers (`hello`, `stats`: frontend/queries.py); its result comes back to the
loop through a pipe. A client's `generate` and `abort` messages still take
effect in the order it sent them: behind a request being prepared, its later
ones wait (an abort then finds the request it names). A scheduler that dies is restarted and its
requests resubmitted (frontend/supervisor.py); past `--max-scheduler-restarts`,
every in-flight and new request gets an `engine_dead` error and `serve_forever`
returns non-zero. SIGTERM drains: new requests get `shutting_down`, open ones
may finish for `drain_timeout` seconds, the rest then end with `shutting_down`,
and `serve_forever` returns 0. Ctrl-C is a drain with no wait. A draining server restarts
nothing: a child that exits then ends the open requests at once (frontend/supervisor.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import zmq

from noria.frontend.core import FrontendCore, Prepared
from noria.frontend.queries import TokenAnswers, mark_relay, ready, stats, token_answer
from noria.frontend.supervisor import Supervisor
from noria.protocol.client import (
    Abort,
    ClientToServer,
    Delta,
    Detokenize,
    Done,
    Embed,
    Embedding,
    Error,
    Generate,
    GetStats,
    Hello,
    Ready,
    Stats,
    Tokenize,
)
from noria.protocol.codec import Codec
from noria.protocol.errors import ErrorCode, NoriaError
from noria.protocol.security import CurveServer, bridge_key_folder
from noria.protocol.sockets import CLIENT_HWM, MAX_CLIENT_MESSAGE, drain_router, make_socket

log = logging.getLogger("noria.frontend")

SAME_STOP = 1.0  # s: a second SIGTERM sooner than this is not a second request (see install_signal_handlers)
LARGE_REQUEST = 32 << 10  # bytes: a `generate` frame larger than this is prepared off the I/O loop
MAX_BACKLOG = 256  # messages of one client waiting behind a request being prepared (aborts always may)


class _Waiting:
    """A client message that takes effect after those the client sent before it."""

    __slots__ = ("msg", "prepared")

    def __init__(self, msg: Generate | Embed | Abort, prepared: Future[Prepared | NoriaError] | None) -> None:
        self.msg = msg
        self.prepared = prepared  # being made on the helper thread; None: nothing to wait for


class FrontendServer:
    def __init__(self, core: FrontendCore, address: str, model_name: str, curve_keys: str | None = None,
                 supervisor: Supervisor | None = None, drain_timeout: float = 30.0) -> None:
        """`curve_keys`: a key folder (protocol/security.py); the API then speaks CURVE and
        admits only the public keys in its `authorized/` folder. `supervisor`: how a dead
        scheduler is restarted (default: it is not)."""
        self.core = core
        self.supervisor = supervisor or Supervisor(core)
        self.drain_timeout = drain_timeout
        self.drain_deadline: float | None = None  # set by SIGTERM / Ctrl-C / stop_event
        self.model_name = model_name
        self.ctx = zmq.Context()
        # A key pair for the bridge of `noria serve`, in a private folder of its own.
        self.bridge_keys = bridge_key_folder(curve_keys) if curve_keys else None
        self.curve = CurveServer(self.ctx, curve_keys) if curve_keys else None
        # Clients are untrusted: bounded queues per peer and a largest frame (a bigger one
        # drops that peer's connection), see protocol/sockets.py.
        self.router = make_socket(self.ctx, zmq.ROUTER, address, bind=True, hwm=CLIENT_HWM,
                                  max_msg_size=MAX_CLIENT_MESSAGE, setup=self.curve.apply if self.curve else None)
        # Sending to a client that has gone raises EHOSTUNREACH instead of being
        # dropped silently: that is how a vanished client's requests get aborted.
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.gone: set[bytes] = set()
        self.codec: Codec[ClientToServer] = Codec(ClientToServer)
        self.stop_event = threading.Event()
        # Large requests are prepared here, one at a time (the tokenizer is shared), and each
        # client's messages behind one wait in its backlog, in order.
        self.preparer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="noria-prepare")
        self.backlog: dict[bytes, deque[_Waiting]] = {}
        self.token_answers = TokenAnswers()  # `tokenize` / `detokenize` made on the helper thread
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        # Called once when the drain begins, possibly from a signal handler (so: no locks), e.g.
        # to stop restarting the bridge.
        self.on_drain: list[Callable[[], None]] = []

    def _sink(self, identity: bytes):  # noqa: ANN202 - closure type is obvious
        router, encode = self.router, self.codec.encode

        def send(msg: Delta | Done | Error | Embedding | Ready | Stats) -> None:
            try:
                # NOBLOCK: a client that has let CLIENT_HWM replies pile up unread (zmq.Again)
                # is treated as gone, rather than stalling everyone else's replies.
                router.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
            except zmq.ZMQError:
                self.gone.add(identity)

        return send

    def handle_client(self, identity: bytes, payload: bytes) -> None:
        try:
            msg = self.codec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError) as e:
            # ValueError: msgspec raises UnicodeDecodeError for a str that is not UTF-8.
            self._sink(identity)(
                Error(request_id=_request_id_of(payload), code=ErrorCode.INVALID_MESSAGE, message=str(e)[:500])
            )
            return
        self._guarded(identity, msg, lambda: self._dispatch(identity, msg, len(payload)))

    def _guarded(self, identity: bytes, msg: ClientToServer, act: Callable[[], None]) -> None:
        try:
            act()
        except Exception as e:  # a bug must cost one request, not the server
            log.exception("internal error on a client message")
            rid = getattr(msg, "request_id", None)
            self._sink(identity)(Error(request_id=rid, code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}"[:500]))

    def _dispatch(self, identity: bytes, msg: ClientToServer, size: int = 0) -> None:
        if isinstance(msg, Generate | Embed | Abort):
            waiting = self.backlog.get(identity)
            large = isinstance(msg, Generate | Embed) and (size > LARGE_REQUEST or _brings_template(msg))
            if waiting is None and not large:
                self._apply(identity, msg, None)
                return
            if isinstance(msg, Generate | Embed) and waiting is not None and len(waiting) >= MAX_BACKLOG:
                self._sink(identity)(Error(request_id=msg.request_id, code=ErrorCode.OVERLOADED,
                                           message=f"{MAX_BACKLOG} messages of this connection already wait "
                                                   "behind a large request; retry later"))
                return
            future = self.preparer.submit(self._prepare, msg) if large else None
            if future is not None:
                future.add_done_callback(self._wake)
            self.backlog.setdefault(identity, deque()).append(_Waiting(msg, future))
            self._release(identity)
        elif isinstance(msg, Tokenize | Detokenize):
            if size > LARGE_REQUEST or _brings_template(msg):
                future = self.preparer.submit(token_answer, self.core.processor, msg)
                future.add_done_callback(self._wake)
                self.token_answers.add(identity, future)
            else:
                self._sink(identity)(token_answer(self.core.processor, msg))
        elif isinstance(msg, Hello):
            if msg.relay:
                mark_relay(self.core.relays, identity)
            self._sink(identity)(ready(self.core, self.model_name))
        elif isinstance(msg, GetStats):
            self._sink(identity)(stats(self.core, self.status(), self.supervisor.restarts))

    def _prepare(self, msg: Generate | Embed) -> Prepared | NoriaError:
        """On the helper thread: what `submit` needs, or why the request is refused."""
        try:
            return self.core.prepare(msg)
        except NoriaError as e:
            return e
        except Exception as e:  # a bug must cost one request, not the server
            log.exception("internal error preparing a request")
            return NoriaError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"[:500])

    def _wake(self, _future: Future) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the loop just as well
            os.write(self.wake_w, b"\0")

    def _apply(self, identity: bytes, msg: Generate | Embed | Abort, prepared: Prepared | NoriaError | None) -> None:
        if isinstance(msg, Generate | Embed):
            self.core.submit((identity, msg.request_id), msg, self._sink(identity), client=identity,
                             prepared=prepared)
        else:
            self.core.abort((identity, msg.request_id))

    def _release(self, identity: bytes) -> None:
        """Apply the client's waiting messages in order, up to one still being prepared."""
        waiting = self.backlog[identity]
        while waiting and (waiting[0].prepared is None or waiting[0].prepared.done()):
            w = waiting.popleft()
            prepared = w.prepared.result() if w.prepared is not None else None
            self._guarded(identity, w.msg, lambda: self._apply(identity, w.msg, prepared))  # noqa: B023 - called at once
        if not waiting:
            del self.backlog[identity]

    def _on_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 4096):
                pass
        for identity in [i for i, w in self.backlog.items() if w[0].prepared is None or w[0].prepared.done()]:
            self._release(identity)
        if self.token_answers:
            self.token_answers.send_done(self._sink)

    def _answer_backlog(self) -> None:
        """Before the loop ends: every waiting request gets its final message (the core, which
        takes no more requests by then, refuses each with its reason)."""
        for identity, waiting in list(self.backlog.items()):
            for w in waiting:
                if w.prepared is not None:
                    w.prepared.cancel()
                if isinstance(w.msg, Generate | Embed):
                    self._guarded(identity, w.msg, lambda: self._apply(
                        identity, w.msg, NoriaError(ErrorCode.SHUTTING_DOWN, "the server is shutting down")))  # noqa: B023
        self.backlog.clear()

    def status(self) -> tuple[str, str]:
        """("ok" | "draining" | "restarting", why) for `stats` and the bridge's /health."""
        if self.drain_deadline is not None:
            return "draining", "draining"
        if self.supervisor.restarting:
            return "restarting", f"the scheduler is restarting after {self.supervisor.reason}"
        return "ok", ""

    def serve_forever(self) -> int:
        """Serve until drained (0) or until the engine dies for good (1)."""
        poller, pulls = zmq.Poller(), []
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        while True:
            if self.stop_event.is_set():
                self.drain(0.0)
            if self.drain_deadline is not None and self._drained():
                return 0
            engine = self.core.engine
            sockets = engine.sockets()
            if sockets != pulls:  # a restarted scheduler comes with fresh sockets
                for s in pulls:
                    poller.unregister(s)
                pulls = sockets
                for s in pulls:
                    poller.register(s, zmq.POLLIN)
            # A quarter second at most: a scheduler's exit or a drain deadline is noticed soon.
            events = dict(poller.poll(250))
            if self.router in events:
                self._read_clients()
            if self.wake_r in events:
                self._on_wake()
            dead = self.supervisor.pump(0)
            if dead:
                log.error("engine died: %s", dead)
                self._answer_backlog()
                return 1
            if self.gone:
                self._abort_gone()

    def drain(self, timeout: float) -> None:
        """Take no new request from now on; end the open ones in `timeout` s at the latest
        (an earlier deadline stands)."""
        deadline = time.monotonic() + timeout
        if self.drain_deadline is None:
            log.log(logging.WARNING if self.core.num_open else logging.INFO,
                    "draining: %d open request(s) may finish for %gs; new ones are refused", self.core.num_open, timeout)
            self.core.refusing = (ErrorCode.SHUTTING_DOWN, "the server is shutting down and takes no new requests")
            self.supervisor.hold_restarts()
            for hook in self.on_drain:
                hook()
        if self.drain_deadline is None or deadline < self.drain_deadline:
            self.drain_deadline = deadline

    def _drained(self) -> bool:
        assert self.drain_deadline is not None
        if self.core.num_open and time.monotonic() >= self.drain_deadline:
            n = self.core.end_all(ErrorCode.SHUTTING_DOWN, "the server is shutting down: the request was still "
                                  "open at the drain deadline")
            log.warning("drain deadline: %d request(s) ended with shutting_down", n)
        if self.core.num_open == 0 and self.backlog:
            self._answer_backlog()  # refused now: the server is shutting down
        return self.core.num_open == 0 and not self.backlog

    def _read_clients(self) -> None:
        for identity, payload in drain_router(self.router, 256):  # bounded: engine outputs are never starved
            self.handle_client(identity, payload)

    def _abort_gone(self) -> None:
        gone, self.gone = self.gone, set()
        for identity in gone:
            for w in self.backlog.pop(identity, ()):  # nobody is left to answer
                if w.prepared is not None:
                    w.prepared.cancel()
        n = self.core.abort_where(lambda key: key[0] in gone)
        if n:
            log.info("aborted %d request(s) of %d vanished client(s)", n, len(gone))
        self.gone -= gone  # the abort's own `done` also fails to send

    def install_signal_handlers(self) -> None:
        """SIGTERM drains for `drain_timeout` seconds; Ctrl-C (or a second SIGTERM) ends the
        open requests now. Both exit 0 once every request has had its final message.

        A SIGTERM within SAME_STOP seconds of the first is the same request to stop: `timeout`
        signals its child and then its whole process group, so the server gets two at once."""
        first_term: list[float] = []

        def term(signum: int, _frame: object) -> None:
            now = time.monotonic()
            if not first_term:
                first_term.append(now)
                self.drain(self.drain_timeout)
            elif now - first_term[0] >= SAME_STOP:
                self.drain(0.0)

        def interrupt(signum: int, _frame: object) -> None:
            self.drain(0.0)

        signal.signal(signal.SIGINT, interrupt)
        signal.signal(signal.SIGTERM, term)

    def close(self) -> None:
        self.preparer.shutdown(wait=True, cancel_futures=True)
        os.close(self.wake_r)
        os.close(self.wake_w)
        self.router.close(linger=200)
        if self.curve is not None:
            self.curve.stop()
        if self.bridge_keys is not None:
            shutil.rmtree(self.bridge_keys, ignore_errors=True)
        self.ctx.term()


def _brings_template(msg: object) -> bool:
    """The message carries its own chat template: rendering it is prepared off the I/O loop,
    however small the message (a template may take up to its render deadline)."""
    if getattr(msg, "chat_template", None) is not None:
        return True
    kwargs = getattr(msg, "chat_template_kwargs", None)
    return isinstance(kwargs, dict) and kwargs.get("chat_template") is not None


def _request_id_of(payload: bytes) -> str | None:
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) else None

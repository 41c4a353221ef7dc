"""The worker's one DEALER to the scheduler, owned by an I/O thread.

zmq sockets are not thread-safe, and heartbeats must flow while the main thread runs a
step or loads a model, so one thread owns the socket: it sends what the main thread hands
it over an inproc PAIR, decodes what the scheduler sends into a queue the main thread
reads, answers for liveness with `Heartbeat`s of its own, and puts `LinkDown` in that
queue when the scheduler has been silent for the timeout. Heartbeats from the scheduler
stop here. `connect` makes a fresh DEALER (a new identity: a new incarnation to the
scheduler) and drops the old one with whatever it still had queued.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from noria.protocol.codec import Codec
from noria.protocol.security import apply_curve_client
from noria.protocol.sockets import MAX_ENGINE_MESSAGE
from noria.protocol.worker_link import Heartbeat, Refused, SchedulerToWorker, WorkerToScheduler

log = logging.getLogger("noria.worker.link")

REGISTER_BEAT = 0.25  # before Welcome names the scheduler's own interval
REGISTER_TIMEOUT = 5.0  # a scheduler that saw a Register heartbeats at least every second
_ids = itertools.count()


@dataclass(frozen=True)
class LinkDown:
    reason: str


class WorkerLink:
    def __init__(self, address: str, curve_keys: str | None = None) -> None:
        self.address = address
        self.curve_keys = curve_keys
        self.ctx = zmq.Context()
        self.inbox: queue.SimpleQueue[SchedulerToWorker | LinkDown] = queue.SimpleQueue()
        self._pipe_address = f"inproc://worker-link-{next(_ids)}"
        self.pipe = self.ctx.socket(zmq.PAIR)
        self.pipe.bind(self._pipe_address)
        self.codec: Codec[WorkerToScheduler] = Codec(WorkerToScheduler)
        self.thread = threading.Thread(target=self._run, name="worker-link", daemon=True)
        self.thread.start()

    # ---- main thread ------------------------------------------------------

    def connect(self, timeout: float = REGISTER_TIMEOUT) -> None:
        """A fresh DEALER; heartbeats at the registration pace until `beat` says otherwise,
        and `LinkDown` after `timeout` s without a word from the scheduler."""
        self.pipe.send_multipart([b"connect", msgspec.json.encode(min(timeout, REGISTER_TIMEOUT))])

    def beat(self, epoch: int, interval: float, timeout: float) -> None:
        """After Welcome: beat with this epoch, and call the scheduler lost after `timeout` s."""
        self.pipe.send_multipart([b"beat", msgspec.json.encode([epoch, interval, timeout])])

    def send(self, msg: msgspec.Struct) -> None:
        self.pipe.send_multipart([b"send", self.codec.encode(msg)])

    def recv(self, timeout: float | None = None) -> SchedulerToWorker | LinkDown | None:
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Flush what was sent (a WorkerFailed must reach the scheduler) and stop the thread."""
        self.pipe.send_multipart([b"stop"])
        self.thread.join(5.0)
        self.pipe.close(linger=0)
        self.ctx.term()

    # ---- the I/O thread ---------------------------------------------------

    def _run(self) -> None:
        pipe = self.ctx.socket(zmq.PAIR)
        pipe.connect(self._pipe_address)
        state = _State(pipe)
        try:
            while state.alive:
                state.step(self)
        finally:
            if state.dealer is not None:
                state.dealer.close(linger=1000)
            pipe.close(linger=0)

    def make_dealer(self) -> zmq.Socket:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_ENGINE_MESSAGE)
        dealer.setsockopt(zmq.RECONNECT_IVL, 100)
        dealer.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self.curve_keys:
            apply_curve_client(dealer, self.curve_keys)
        dealer.connect(self.address)
        return dealer


class _State:
    """The I/O thread's state: the socket, the beat, when the scheduler last spoke."""

    def __init__(self, pipe: zmq.Socket) -> None:
        self.pipe = pipe
        self.dealer: zmq.Socket | None = None
        self.poller = zmq.Poller()
        self.poller.register(pipe, zmq.POLLIN)
        self.codec: Codec[SchedulerToWorker] = Codec(SchedulerToWorker)
        self.epoch, self.interval, self.timeout = 0, REGISTER_BEAT, REGISTER_TIMEOUT
        self.last_heard = self.next_beat = time.monotonic()
        self.down = False
        self.alive = True
        self.beat_bytes = self.codec.encode(Heartbeat(0))

    def step(self, link: WorkerLink) -> None:
        wait = None  # nothing but commands to wait for until the first connect
        if self.dealer is not None:
            deadline = self.next_beat if self.down else min(self.next_beat, self.last_heard + self.timeout)
            wait = max(0, int((deadline - time.monotonic()) * 1000) + 1)
        events = dict(self.poller.poll(wait))
        if events.get(self.pipe):
            self._command(self.pipe.recv_multipart(), link)
        if self.dealer is not None and events.get(self.dealer):
            self._receive(link)
        self._keep_time(link)

    def _command(self, frames: list[bytes], link: WorkerLink) -> None:
        kind = frames[0]
        if kind == b"send":
            self._send(frames[1])
        elif kind == b"connect":
            if self.dealer is not None:
                self.poller.unregister(self.dealer)
                self.dealer.close(linger=0)
            self.dealer = link.make_dealer()
            self.poller.register(self.dealer, zmq.POLLIN)
            self.epoch, self.interval, self.timeout = 0, REGISTER_BEAT, msgspec.json.decode(frames[1])
            self.beat_bytes = self.codec.encode(Heartbeat(0))
            self.last_heard = self.next_beat = time.monotonic()
            self.down = False
        elif kind == b"beat":
            self.epoch, self.interval, self.timeout = msgspec.json.decode(frames[1])
            self.beat_bytes = self.codec.encode(Heartbeat(self.epoch))
            self.last_heard = time.monotonic()
        elif kind == b"stop":
            self.alive = False

    def _send(self, payload: bytes) -> None:
        # A DEALER whose connection was refused (a CURVE handshake that failed) has no
        # pipe, and a plain send would block this thread for good; the message is dropped
        # instead: silence then says "no scheduler", and registration starts again.
        if self.dealer is None:
            return
        with contextlib.suppress(zmq.Again):
            self.dealer.send(payload, zmq.NOBLOCK)

    def _receive(self, link: WorkerLink) -> None:
        assert self.dealer is not None
        while True:
            try:
                payload = self.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.last_heard = time.monotonic()
            self.down = False
            try:
                msg = self.codec.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                msg = Refused(f"cannot read the scheduler's message ({e}): run the same noria version on both hosts")
            if not isinstance(msg, Heartbeat):
                link.inbox.put(msg)

    def _keep_time(self, link: WorkerLink) -> None:
        if self.dealer is None:
            return
        now = time.monotonic()
        if now >= self.next_beat:
            self._send(self.beat_bytes)
            self.next_beat = now + self.interval
        if not self.down and now - self.last_heard > self.timeout:
            self.down = True
            quiet = now - self.last_heard
            why = (f"no answer from the scheduler at {link.address} for {quiet:.1f}s" if self.epoch == 0 else
                   f"the scheduler at {link.address} has been silent for {quiet:.1f}s")
            link.inbox.put(LinkDown(why))

"""The worker's one DEALER to the scheduler, shared by the main thread and a keeper thread.

Plans reach the main thread straight from the socket: while it waits in `recv` it holds the
link's lock and polls the DEALER itself (answering for liveness with its own `Heartbeat`s
meanwhile), and `send` writes results to the DEALER at once. No I/O thread stands between
the socket and the step: handing each plan in and each result out through one would cost
two thread wake-ups per step, and a wake-up after an idle spell, when the vCPUs have
halted, costs ~5x one back to back, at times milliseconds (bench/RESULTS.md, "TTFT after
idle"). While the main thread runs a step or loads a model, the keeper thread takes the lock
to beat on time, hear the scheduler's heartbeats and queue whatever else arrives (in order:
`recv` hands out the queue before it reads the socket), and puts `LinkDown` in that queue
when the scheduler has been silent for the timeout. zmq sockets may change threads behind a
lock (a full memory barrier); never two at once. Heartbeats from the scheduler stop here.
`connect` makes a fresh DEALER (a new identity: a new incarnation to the scheduler) and drops
the old one with whatever it still had queued.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from noria.protocol.codec import Codec
from noria.protocol.security import apply_curve_client
from noria.protocol.sockets import MAX_ENGINE_MESSAGE, backoff_reconnects, make_socket
from noria.protocol.worker_link import Heartbeat, Refused, SchedulerToWorker, WorkerToScheduler

log = logging.getLogger("noria.worker.link")

REGISTER_BEAT = 0.25  # before Welcome names the scheduler's own interval
REGISTER_TIMEOUT = 5.0  # a scheduler that saw a Register heartbeats at least every second


@dataclass(frozen=True)
class LinkDown:
    reason: str


Inbound = SchedulerToWorker | LinkDown


class WorkerLink:
    def __init__(self, address: str, curve_keys: str | None = None) -> None:
        self.address = address
        self.curve_keys = curve_keys
        self.ctx = zmq.Context()
        self.out_codec: Codec[WorkerToScheduler] = Codec(WorkerToScheduler)
        self.in_codec: Codec[SchedulerToWorker] = Codec(SchedulerToWorker)
        self.lock = threading.Lock()  # whoever holds it may touch the DEALER and the fields below
        self.dealer: zmq.Socket | None = None
        self.inbox: deque[Inbound] = deque()  # what the keeper read while the main thread was busy
        self.epoch, self.interval, self.timeout = 0, REGISTER_BEAT, REGISTER_TIMEOUT
        self.beat_bytes = self.out_codec.encode(Heartbeat(0))
        self.last_heard = self.next_beat = time.monotonic()
        self.down = False
        self.stopping = threading.Event()
        self.keeper = threading.Thread(target=self._keep, name="worker-link", daemon=True)
        self.keeper.start()

    # ---- the main thread --------------------------------------------------

    def connect(self, timeout: float = REGISTER_TIMEOUT) -> None:
        """A fresh DEALER; heartbeats at the registration pace until `beat` says otherwise,
        and `LinkDown` after `timeout` s without a word from the scheduler."""
        with self.lock:
            if self.dealer is not None:
                self.dealer.close(linger=0)
            self.dealer = self._make_dealer()
            self.epoch, self.interval, self.timeout = 0, REGISTER_BEAT, min(timeout, REGISTER_TIMEOUT)
            self.beat_bytes = self.out_codec.encode(Heartbeat(0))
            self.last_heard = self.next_beat = time.monotonic()  # the first beat goes with the next `recv`
            self.down = False

    def beat(self, epoch: int, interval: float, timeout: float) -> None:
        """After Welcome: beat with this epoch, and call the scheduler lost after `timeout` s."""
        with self.lock:
            self.epoch, self.interval, self.timeout = epoch, interval, timeout
            self.beat_bytes = self.out_codec.encode(Heartbeat(epoch))
            self.last_heard = time.monotonic()

    def send(self, msg: msgspec.Struct) -> None:
        payload = self.out_codec.encode(msg)
        with self.lock:
            self._send(payload)

    def recv(self, timeout: float | None = None) -> Inbound | None:
        """The next message (or `LinkDown`); None when `timeout` s passed without one."""
        end = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while True:
                self._keep_time()
                if self.inbox:
                    return self.inbox.popleft()
                now = time.monotonic()
                if end is not None and now >= end and self.dealer is None:
                    return None
                wait = self._next_deadline() - now if end is None else min(self._next_deadline(), end) - now
                if self.dealer is None:  # before the first connect nothing can arrive
                    time.sleep(min(max(wait, 0.0), REGISTER_BEAT))
                elif self.dealer.poll(max(0, math.ceil(wait * 1000)), zmq.POLLIN):
                    self._read()
                elif end is not None and time.monotonic() >= end:
                    self._keep_time()
                    return self.inbox.popleft() if self.inbox else None

    def close(self) -> None:
        """Flush what was sent (a WorkerFailed must reach the scheduler) and stop the keeper."""
        self.stopping.set()
        self.keeper.join(5.0)
        with self.lock:
            if self.dealer is not None:
                self.dealer.close(linger=1000)
                self.dealer = None
        self.ctx.term()

    # ---- the keeper thread ------------------------------------------------

    def _keep(self) -> None:
        """Beat, listen and watch the timeout while the main thread is away from the link."""
        wait = REGISTER_BEAT
        while not self.stopping.wait(wait):
            if not self.lock.acquire(blocking=False):
                # The main thread is in `recv` and keeps time itself. The keeper looks again a
                # beat interval later, no sooner: an idle worker wakes once per beat at most.
                wait = self.interval
                continue
            try:
                if self.dealer is not None and self.dealer.poll(0, zmq.POLLIN):
                    self._read()
                self._keep_time()
                wait = max(0.001, self._next_deadline() - time.monotonic())
            finally:
                self.lock.release()

    # ---- with the lock held -----------------------------------------------

    def _make_dealer(self) -> zmq.Socket:
        def setup(dealer: zmq.Socket) -> None:
            backoff_reconnects(dealer)
            if self.curve_keys:
                apply_curve_client(dealer, self.curve_keys)

        return make_socket(self.ctx, zmq.DEALER, self.address, bind=False, max_msg_size=MAX_ENGINE_MESSAGE,
                           setup=setup)

    def _next_deadline(self) -> float:
        if self.dealer is None:
            return time.monotonic() + REGISTER_BEAT
        return self.next_beat if self.down else min(self.next_beat, self.last_heard + self.timeout)

    def _send(self, payload: bytes) -> None:
        # A DEALER whose connection was refused (a CURVE handshake that failed) has no
        # pipe, and a plain send would block for good; the message is dropped instead:
        # silence then says "no scheduler", and registration starts again.
        if self.dealer is None:
            return
        with contextlib.suppress(zmq.Again):
            self.dealer.send(payload, zmq.NOBLOCK)

    def _read(self) -> None:
        assert self.dealer is not None
        while True:
            try:
                payload = self.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.last_heard = time.monotonic()
            self.down = False
            try:
                msg = self.in_codec.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                msg = Refused(f"cannot read the scheduler's message ({e}): run the same noria version on both hosts")
            if not isinstance(msg, Heartbeat):
                self.inbox.append(msg)

    def _keep_time(self) -> None:
        if self.dealer is None:
            return
        now = time.monotonic()
        if now >= self.next_beat:
            self._send(self.beat_bytes)
            self.next_beat = now + self.interval
        if not self.down and now - self.last_heard > self.timeout:
            self.down = True
            quiet = now - self.last_heard
            why = (f"no answer from the scheduler at {self.address} for {quiet:.1f}s" if self.epoch == 0 else
                   f"the scheduler at {self.address} has been silent for {quiet:.1f}s")
            self.inbox.append(LinkDown(why))

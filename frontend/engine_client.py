"""The frontend's link to the scheduler: send requests and aborts, receive outputs.

After a scheduler dies, `restart` starts a new one (with new local ranks) on fresh
sockets; until its `EngineReady` arrives (`restarting` is true), requests and aborts are
not sent: the frontend resubmits every open request once the new engine is ready.
"""

from __future__ import annotations

import contextlib
import time

import zmq

from noria.frontend.launcher import EngineProcesses
from noria.protocol.codec import Codec
from noria.protocol.config import EngineAddresses, EngineConfig, WorkerLinkConfig
from noria.protocol.engine import (
    EngineAbort,
    EngineDead,
    EngineReady,
    EngineRequest,
    EngineShutdown,
    FrontendToScheduler,
    SchedulerToFrontend,
    StatsQuery,
)
from noria.protocol.errors import ErrorCode, NoriaError
from noria.protocol.sockets import MAX_ENGINE_MESSAGE, make_socket

# How long a failed start-up waits, once a child has exited, for the scheduler to say why.
DEAD_REASON_GRACE = 2.0


class EngineClient:
    def __init__(self, config: EngineConfig, addrs: EngineAddresses | None = None,
                 link: WorkerLinkConfig | None = None) -> None:
        """Launch the engine processes locally (their worker link as `link` says), or
        connect to `addrs` if given."""
        self.procs: EngineProcesses | None = None
        if addrs is None:
            self.procs = EngineProcesses(config, link)
            addrs = self.procs.addrs
        self.addrs = addrs
        self.ctx = zmq.Context()
        self.push, self.pull = engine_sockets(self.ctx, addrs)
        self.restarting = False
        self.restarted_at = 0.0
        self.out_codec: Codec[FrontendToScheduler] = Codec(FrontendToScheduler)
        self.in_codec: Codec[SchedulerToFrontend] = Codec(SchedulerToFrontend)
        self.closed = False
        try:
            self.ready = self._wait_ready(config.startup_timeout)
        except BaseException:
            self.close()
            raise
        if self.procs:
            self.procs.watch()  # from now on a local worker that exits is restarted

    def _wait_ready(self, timeout: float) -> EngineReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = self.procs.startup_failure() if self.procs else None
            if dead:
                # The exit code says only that a process failed; the scheduler's EngineDead says
                # why (a rank that fails tells it, then exits), and may be just behind the exit.
                why = self._engine_dead(time.monotonic() + DEAD_REASON_GRACE)
                raise NoriaError(ErrorCode.ENGINE_DEAD, f"start-up failed: {why or dead}")
            if self.pull.poll(200):
                msg = self.in_codec.decode(self.pull.recv())
                if isinstance(msg, EngineReady):
                    return msg
                if isinstance(msg, EngineDead):
                    raise NoriaError(ErrorCode.ENGINE_DEAD, f"start-up failed: {msg.reason}")
        raise NoriaError(ErrorCode.ENGINE_DEAD, f"the engine did not become ready in {timeout:.0f}s")

    def _engine_dead(self, until: float) -> str | None:
        """The reason of an EngineDead that arrives before `until` (monotonic), or None."""
        while self.pull.poll(max(0, int((until - time.monotonic()) * 1000))):
            msg = self.in_codec.decode(self.pull.recv())
            if isinstance(msg, EngineDead):
                return msg.reason
        return None

    def dead(self) -> str | None:
        """Why the engine is dead (its scheduler exited), or None; a worker's exit is not."""
        return self.procs.dead() if self.procs else None

    def restart(self) -> None:
        """Start a new scheduler and local ranks (the old ones are killed) and reconnect on
        fresh sockets, so nothing queued for or from the dead scheduler is ever delivered.
        `on_ready` ends the restart when the new engine's `EngineReady` arrives."""
        assert self.procs is not None, "only an engine this process launched can be restarted"
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.procs.restart_engine()
        self.push, self.pull = engine_sockets(self.ctx, self.addrs)
        self.restarting = True
        self.restarted_at = time.monotonic()

    def sockets(self) -> list[zmq.Socket]:
        """What the server loop polls for this engine's messages (a restart makes new ones)."""
        return [self.pull]

    def on_ready(self, ready: EngineReady) -> None:
        self.ready = ready
        self.restarting = False

    def add(self, req: EngineRequest) -> None:
        if not self.restarting:
            self.push.send(self.out_codec.encode(req))

    def abort(self, req_ids: list[int]) -> None:
        if req_ids and not self.restarting:
            self.push.send(self.out_codec.encode(EngineAbort(req_ids)))

    def query_stats(self) -> None:
        if not self.restarting:
            self.push.send(self.out_codec.encode(StatsQuery()))

    def recv(self, timeout_ms: int) -> list[SchedulerToFrontend]:
        """Every message available now, waiting up to `timeout_ms` for the first."""
        if not self.pull.poll(timeout_ms):
            return []
        out = []
        while True:
            try:
                out.append(self.in_codec.decode(self.pull.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(zmq.ZMQError):  # a restarting scheduler gets it too: it stops
            self.push.send(self.out_codec.encode(EngineShutdown()), zmq.NOBLOCK)
        if self.procs:
            self.procs.shutdown()
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()


def engine_sockets(ctx: zmq.Context, addrs: EngineAddresses) -> tuple[zmq.Socket, zmq.Socket]:
    """The frontend's two engine sockets, PUSH to `requests` and PULL from `outputs`: unbounded
    queues (a PUSH at its high-water mark would block the frontend), the engine links'
    largest frame (protocol/sockets.py)."""
    push = make_socket(ctx, zmq.PUSH, addrs.requests, bind=False, max_msg_size=MAX_ENGINE_MESSAGE)
    pull = make_socket(ctx, zmq.PULL, addrs.outputs, bind=False, max_msg_size=MAX_ENGINE_MESSAGE)
    return push, pull

"""The frontend's link to the scheduler: send requests and aborts, receive outputs."""

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
from noria.protocol.sockets import make_socket


class EngineClient:
    def __init__(self, config: EngineConfig, addrs: EngineAddresses | None = None,
                 link: WorkerLinkConfig | None = None) -> None:
        """Launch the engine processes locally (their worker link as `link` says), or
        connect to `addrs` if given."""
        self.procs: EngineProcesses | None = None
        if addrs is None:
            self.procs = EngineProcesses(config, link)
            addrs = self.procs.addrs
        self.ctx = zmq.Context()
        self.push = make_socket(self.ctx, zmq.PUSH, addrs.requests, bind=False)
        self.pull = make_socket(self.ctx, zmq.PULL, addrs.outputs, bind=False)
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
                raise NoriaError(ErrorCode.ENGINE_DEAD, f"start-up failed: {dead}")
            if self.pull.poll(200):
                msg = self.in_codec.decode(self.pull.recv())
                if isinstance(msg, EngineReady):
                    return msg
                if isinstance(msg, EngineDead):
                    raise NoriaError(ErrorCode.ENGINE_DEAD, f"start-up failed: {msg.reason}")
        raise NoriaError(ErrorCode.ENGINE_DEAD, f"the engine did not become ready in {timeout:.0f}s")

    def dead(self) -> str | None:
        """Why the engine is dead (its scheduler exited), or None; a worker's exit is not."""
        return self.procs.dead() if self.procs else None

    def add(self, req: EngineRequest) -> None:
        self.push.send(self.out_codec.encode(req))

    def abort(self, req_ids: list[int]) -> None:
        if req_ids:
            self.push.send(self.out_codec.encode(EngineAbort(req_ids)))

    def query_stats(self) -> None:
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
        with contextlib.suppress(zmq.ZMQError):
            self.push.send(self.out_codec.encode(EngineShutdown()), zmq.NOBLOCK)
        if self.procs:
            self.procs.shutdown()
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()

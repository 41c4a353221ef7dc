"""The scheduler process: owns the step loop between the frontend and the workers.

Binds all four links (so remote frontends and workers connect to it), waits
for every worker's READY, tells the frontend it is READY, then loops: drain
requests and aborts, plan a step, send it to every rank, apply rank 0's
result, publish the updates. Blocks when idle instead of spinning.
"""

from __future__ import annotations

import logging
import time

import zmq

from noria.protocol.codec import Codec
from noria.protocol.config import EngineAddresses, EngineConfig
from noria.protocol.engine import (
    EngineAbort,
    EngineDead,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    EngineShutdown,
    FrontendToScheduler,
    SchedulerToFrontend,
    StatsQuery,
)
from noria.protocol.sockets import make_socket
from noria.protocol.step import (
    SchedulerToWorker,
    StepResult,
    WorkerFailed,
    WorkerReady,
    WorkerShutdown,
    WorkerToScheduler,
)
from noria.scheduler.scheduler import Scheduler

log = logging.getLogger("noria.scheduler")

STATS_INTERVAL = 0.5


class WorkerLost(Exception):
    pass


class SchedulerProcess:
    def __init__(self, config: EngineConfig, addrs: EngineAddresses) -> None:
        self.config = config
        self.ctx = zmq.Context()
        self.from_frontend = make_socket(self.ctx, zmq.PULL, addrs.requests, bind=True)
        self.to_frontend = make_socket(self.ctx, zmq.PUSH, addrs.outputs, bind=True)
        self.to_workers = [make_socket(self.ctx, zmq.PUSH, a, bind=True) for a in addrs.plans]
        self.from_workers = make_socket(self.ctx, zmq.PULL, addrs.results, bind=True)
        self.in_codec: Codec[FrontendToScheduler] = Codec(FrontendToScheduler)
        self.out_codec: Codec[SchedulerToFrontend] = Codec(SchedulerToFrontend)
        self.plan_codec: Codec[SchedulerToWorker] = Codec(SchedulerToWorker)
        self.result_codec: Codec[WorkerToScheduler] = Codec(WorkerToScheduler)
        self.running = True
        self.stats_due = True
        self.last_stats = 0.0

    def wait_for_workers(self) -> tuple[int, int, int, int]:
        readies: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + self.config.startup_timeout
        while len(readies) < len(self.to_workers):
            if not self.from_workers.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                missing = sorted(set(range(len(self.to_workers))) - set(readies))
                raise WorkerLost(f"worker rank(s) {missing} did not become ready in {self.config.startup_timeout}s")
            msg = self.result_codec.decode(self.from_workers.recv())
            if isinstance(msg, WorkerFailed):
                raise WorkerLost(f"worker rank {msg.rank} failed during start-up: {msg.reason}")
            if isinstance(msg, WorkerReady):
                readies[msg.rank] = msg
        num_blocks = min(r.num_kv_blocks for r in readies.values())
        max_len = min(r.max_model_len for r in readies.values())
        cpu_blocks = min(r.num_cpu_blocks for r in readies.values())
        return num_blocks, max_len, readies[0].vocab_size, cpu_blocks

    def serve(self) -> None:
        try:
            num_blocks, max_len, vocab, cpu_blocks = self.wait_for_workers()
        except WorkerLost as e:
            self.to_frontend.send(self.out_codec.encode(EngineDead(str(e))))
            raise
        self.sched = Scheduler(self.config, num_blocks, max_len, cpu_blocks)
        self.to_frontend.send(
            self.out_codec.encode(EngineReady(num_blocks, self.config.block_size, self.sched.max_model_len, vocab))
        )
        try:
            self.loop()
        except WorkerLost as e:
            self.to_frontend.send(self.out_codec.encode(EngineDead(str(e))))
            raise
        finally:
            for s in self.to_workers:
                s.send(self.plan_codec.encode(WorkerShutdown()))

    def loop(self) -> None:
        sched = self.sched
        was_busy = False
        while self.running:
            busy = sched.has_work()
            # Idle: block on the frontend (waking now and then for stats); busy: just drain.
            if not busy and not self.from_frontend.poll(1000 if not was_busy else 0):
                if was_busy:
                    self._idle_check()
                was_busy = False
                self._publish()
                continue
            self._drain_frontend()
            if sched.has_work():
                plan = sched.schedule()
                payload = self.plan_codec.encode(plan)
                for s in self.to_workers:
                    s.send(payload)
                sched.update_from_result(self._wait_result(plan.step_id))
                was_busy = True
            self._publish()

    def _drain_frontend(self) -> None:
        while True:
            try:
                data = self.from_frontend.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.in_codec.decode(data)
            if isinstance(msg, EngineRequest):
                self.sched.add_request(msg)
            elif isinstance(msg, EngineAbort):
                self.sched.abort(msg.req_ids)
            elif isinstance(msg, StatsQuery):
                self.stats_due = True
            elif isinstance(msg, EngineShutdown):
                self.running = False
                return

    def _wait_result(self, step_id: int) -> StepResult:
        while True:
            msg = self.result_codec.decode(self.from_workers.recv())
            if isinstance(msg, WorkerFailed):
                raise WorkerLost(f"worker rank {msg.rank} failed: {msg.reason}")
            if isinstance(msg, StepResult) and msg.step_id == step_id:
                if msg.error:
                    raise WorkerLost(f"worker step failed: {msg.error}")
                return msg

    def _idle_check(self) -> None:
        problem = self.sched.check_blocks()
        self.sched.stats.blocks_consistent = problem is None
        if problem:
            log.error("KV block accounting is inconsistent while idle: %s", problem)
        self.stats_due = True

    def _publish(self) -> None:
        updates = self.sched.take_updates()
        now = time.monotonic()
        due = self.stats_due or (
            (updates or self.sched.has_work()) and now - self.last_stats > STATS_INTERVAL
        )
        stats = None
        if due:
            stats = self.sched.snapshot_stats()
            self.last_stats = now
            self.stats_due = False
        if updates or stats is not None:
            self.to_frontend.send(self.out_codec.encode(EngineOutputs(updates, stats)))

    def close(self) -> None:
        for s in (self.from_frontend, self.to_frontend, self.from_workers, *self.to_workers):
            s.close(linger=100)
        self.ctx.term()


def run(config: EngineConfig, addrs: EngineAddresses) -> int:
    proc = SchedulerProcess(config, addrs)
    try:
        proc.serve()
        return 0
    except WorkerLost as e:
        log.error("%s", e)
        return 1
    finally:
        proc.close()



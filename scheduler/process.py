"""The scheduler process: owns the step loop between the frontend and the workers.

Binds the three links (so remote frontends and workers connect to it) and loops over
the frontend's requests and the worker ROUTER with deadlines: drain requests and aborts,
let the worker group handle registrations, heartbeats and results, plan a step when a group
is live and none is in flight (with `async_scheduling`: while at most one is, so that the
worker finds the next plan waiting when it finishes a step), publish the updates. Nothing
here blocks without a timeout, so registrations and heartbeats are served while a step runs;
while this thread is busy elsewhere (a large plan, a large request), the worker group's
keeper thread beats in its place (scheduler/worker_group.py), so a slow step costs time,
never the group.

A lost worker group is not an engine death: its requests wait for recompute
(`Scheduler.reset_after_worker_loss`) until a group is live again, and fail with
`engine_unavailable` if none is within `worker_wait` seconds.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from noria.protocol.codec import Codec
from noria.protocol.config import EngineAddresses, EngineConfig, WorkerLinkConfig
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
from noria.protocol.errors import ErrorCode
from noria.protocol.model_identity import model_facts, model_identity
from noria.protocol.security import CurveServer, check_exposure
from noria.protocol.sockets import MAX_ENGINE_MESSAGE, make_socket
from noria.protocol.step import StepPlan, StepResult
from noria.scheduler.kv_events import KVEventPublisher
from noria.scheduler.kv_side_channel import SideChannel
from noria.scheduler.scheduler import Scheduler
from noria.scheduler.worker_group import GroupLost, GroupReady, WorkerGroup

log = logging.getLogger("noria.scheduler")

STATS_INTERVAL = 0.5
ROUTER_BATCH = 1024  # worker messages handled per loop at most


class StartupFailed(Exception):
    """The engine cannot start; passed on to the frontend as EngineDead. `logged`: whoever met
    the cause (a rank, the worker group) has logged it already, so the scheduler does not."""

    def __init__(self, reason: str, logged: bool = False) -> None:
        super().__init__(reason)
        self.logged = logged


def bind_worker_router(ctx: zmq.Context, address: str, curve: CurveServer | None) -> zmq.Socket:
    def setup(router: zmq.Socket) -> None:
        # A send to a rank whose connection has closed (its process died) fails at once
        # instead of vanishing: that rank is lost at that send, not a heartbeat timeout later.
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if curve is not None:
            curve.apply(router)

    return make_socket(ctx, zmq.ROUTER, address, bind=True, max_msg_size=MAX_ENGINE_MESSAGE, setup=setup)


class SchedulerProcess:
    def __init__(self, config: EngineConfig, addrs: EngineAddresses, link: WorkerLinkConfig) -> None:
        self.config = config
        self.link = link
        self.ctx = zmq.Context()
        self.curve = CurveServer(self.ctx, link.curve_keys) if link.curve_keys else None
        self.from_frontend = make_socket(self.ctx, zmq.PULL, addrs.requests, bind=True, max_msg_size=MAX_ENGINE_MESSAGE)
        self.to_frontend = make_socket(self.ctx, zmq.PUSH, addrs.outputs, bind=True, max_msg_size=MAX_ENGINE_MESSAGE)
        self.router = bind_worker_router(self.ctx, addrs.workers, self.curve)
        self.in_codec: Codec[FrontendToScheduler] = Codec(FrontendToScheduler)
        self.out_codec: Codec[SchedulerToFrontend] = Codec(SchedulerToFrontend)
        self.group = WorkerGroup(self.router, config, link, model_identity(config.model, config.load_format != "dummy"),
                                 addrs.workers)
        self.facts = model_facts(config.model)
        max_len = config.max_model_len or self.facts.max_model_len
        self.sched = Scheduler(config, 0, max_len)  # no KV until a worker group is live
        ev = config.kv_events_config
        self.kv_events = (KVEventPublisher(self.ctx, ev, config.block_size, config.data_parallel_rank or 0)
                          if ev and ev.publishes else None)
        if self.kv_events is not None:
            if not config.enable_prefix_caching:
                log.warning("KV-cache events are enabled but prefix caching is not: no block is published")
            self.kv_events.attach(self.sched.kv)
        self.poller = zmq.Poller()
        self.poller.register(self.from_frontend, zmq.POLLIN)
        self.poller.register(self.router, zmq.POLLIN)
        tc = config.kv_transfer_config
        self.side: SideChannel | None = None
        if tc is not None:  # prefill/decode disaggregation (scheduler/kv_transfer.py)
            if tc.produces:
                check_exposure(f"tcp://{tc.kv_ip}:{tc.kv_port}", link.curve_keys, link.insecure,
                               "KV transfer links (--kv-transfer-config kv_ip)")
            self.side = SideChannel(self.ctx, tc, config.data_parallel_rank or 0, self.curve, link.curve_keys)
            self.sched.side_channel = self.side.address
            if self.side.server is not None:
                self.poller.register(self.side.server, zmq.POLLIN)
        self.grammar_fd = self.sched.grammars.wake_fd  # structured output: a grammar has compiled
        self.poller.register(self.grammar_fd, zmq.POLLIN)
        self.running = True
        self.stats_due = True
        self.last_stats = 0.0
        self.in_flight: deque[int] = deque()  # step ids sent to the live group, results not yet applied
        self.max_in_flight = 2 if config.async_scheduling else 1
        # Nothing to plan ahead until the step in flight answers or a message comes in (the
        # requests wait for its tokens): the loop sleeps in its poll meanwhile.
        self.held = False
        # Speculation times each step for its switch: from its plan when nothing ran before it,
        # else from the last result (the worker went on to it from there).
        self.sent_at: dict[int, float] = {}
        self.last_result = 0.0
        if config.speculative_config is not None:
            log.info("%s", config.speculative_config.describe())
        self.was_busy = False
        self.started = time.monotonic()
        # Local workers start with the engine: its READY waits for them and carries their KV
        # capacity. With remote workers only, the engine is READY at once (config.json gives
        # the length and vocabulary) and requests wait for a worker.
        self.ready_sent = link.local_workers(config.tensor_parallel_size) == 0
        self.no_worker_since: float | None = self.started if self.ready_sent else None
        self.no_worker_total = 0.0
        self.unavailable = False  # worker_wait passed with no group: requests fail at once
        self.groups_formed = 0
        self.attention = ("", "")  # the live group's (backend, reason) for stats (/health)

    # ---- the loop ---------------------------------------------------------

    def serve(self) -> None:
        if self.ready_sent:
            self._send_ready(0, self.sched.max_model_len, self.facts.vocab_size)
        self.group.start_keeper()
        try:
            while self.running:
                self._poll()
                self._tick()
                self._maybe_step()
                self._handle_events()
                self._publish()
        finally:
            self.group.shutdown()

    def _poll(self) -> None:
        can_step = (self.group.live and len(self.in_flight) < self.max_in_flight
                    and not (self.held and self.in_flight) and self.sched.has_work())
        timeout = 0 if can_step else int(min(self.group.interval, STATS_INTERVAL) * 1000)
        with self.group.lock:  # the poll reads the ROUTER's state: the keeper must not beat meanwhile
            events = dict(self.poller.poll(timeout))
        if events:
            self.held = False  # a request, an abort, a grammar, a result: planning ahead may go on
        if self.from_frontend in events:
            self._drain_frontend()
        if self.grammar_fd in events:
            self.sched.grammars_ready()
        if self.side is not None and self.side.server in events:
            self.sched.release_transfers(self.side.receive())
        # Bounded, so the frontend is never starved; read even without an event, so that the
        # ranks count as heard up to now (what arrived while this thread was busy is no silence).
        self.group.receive(ROUTER_BATCH)
        self._handle_events()

    def _handle_events(self) -> None:
        status_changed = False
        events = self.group.events
        while events:
            ev = events.pop(0)
            if isinstance(ev, StepResult):
                if self.in_flight and ev.step_id == self.in_flight[0]:  # the worker runs plans in order
                    self.in_flight.popleft()
                    self.sched.update_from_result(ev)
                    if self.sched.spec is not None:  # does drafting pay
                        now = time.monotonic()
                        start = self.sent_at.pop(ev.step_id, self.last_result)
                        self.sched.observe_step(ev.step_id, now - start, len(ev.token_ids))
                        self.last_result = now
                    self.held = False
                    self._maybe_step()  # the next plan before the next result is taken
                continue
            status_changed = True
            if isinstance(ev, GroupReady):
                self._group_ready(ev)
            elif isinstance(ev, GroupLost):
                self._group_lost(ev.reason, ev.rejoining)
        if status_changed:
            self.stats_due = True  # the worker status changed: say so at once (/health reads it)

    def _group_ready(self, ev: GroupReady) -> None:
        self.sched.install_kv(ev.num_kv_blocks, ev.num_cpu_blocks, ev.max_model_len)
        self._attach_kv_events()
        self.attention = (ev.attention_backend, ev.attention_reason)
        # A producer answers with its ranks' block servers (all of them, or it cannot export).
        self.sched.kv_endpoints = list(ev.kv_endpoints) if all(ev.kv_endpoints) else []
        self.groups_formed += 1
        if self.no_worker_since is not None:
            self.no_worker_total += time.monotonic() - self.no_worker_since
        self.no_worker_since = None
        if self.unavailable:
            log.warning("a worker group is live again: requests are accepted")
        self.unavailable = False
        if not self.ready_sent:
            self.ready_sent = True
            self._send_ready(ev.num_kv_blocks, self.sched.max_model_len, ev.vocab_size)

    def _group_lost(self, reason: str, rejoining: bool = False) -> None:
        if not self.ready_sent:
            if rejoining:  # a rank too slow to hear its Welcome (a loaded host) registered again: wait for it
                log.warning("the engine keeps waiting for the rank to register again")
                return
            # A local worker that fails while the engine starts would fail again: say why now.
            raise StartupFailed(f"worker failed during start-up: {reason}", logged=True)
        self.in_flight.clear()
        requeued = len(self.sched.running) + len(self.sched.swapped)
        self.sched.reset_after_worker_loss()
        self._attach_kv_events()
        if self.no_worker_since is None:
            self.no_worker_since = time.monotonic()
        log.warning("%d request(s) wait for recompute", requeued)  # the worker group logged why

    def _tick(self) -> None:
        self.group.tick()
        self._handle_events()
        if self.sched.held:
            self.sched.expire_transfers()
        now = time.monotonic()
        if not self.ready_sent and now - self.started > self.config.startup_timeout:
            raise StartupFailed(f"no worker group became ready in {self.config.startup_timeout:g}s: "
                                f"{self.group.status()}")
        since = self.no_worker_since
        if since is not None and not self.unavailable and now - since > self.link.worker_wait:
            self.unavailable = True
            n = self.sched.fail_all(ErrorCode.ENGINE_UNAVAILABLE, self._unavailable_message())
            log.error("no worker for %.0fs: %d waiting request(s) failed (%s)", now - since, n, self.group.status())
            self.stats_due = True

    def _attach_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.attach(self.sched.kv)  # a new pool: the old one's blocks are all cleared
            self.kv_events.flush()

    def _unavailable_message(self) -> str:
        return f"no worker has been serving for {self.link.worker_wait:g}s: {self.group.status()}"

    def _maybe_step(self) -> None:
        """Plan steps while the pipeline has room: one in flight, or two with async scheduling.
        Planning runs as soon as there is room, after every result and before the next is
        taken, so the order of plans and results does not depend on how fast the worker
        answers: with async scheduling every step but the first is planned ahead."""
        sched = self.sched
        while self.group.live and len(self.in_flight) < self.max_in_flight and not (self.held and self.in_flight):
            if not sched.has_work():
                if self.was_busy:
                    self._idle_check()
                self.was_busy = False
                return
            ahead = bool(self.in_flight)
            if ahead and sched.drafts_next():
                self.held = True  # the draft follows the tokens of the step in flight
                return
            plan = sched.schedule(ahead)
            if self.kv_events is not None:
                self.kv_events.flush()  # one batch per step: the blocks it cached and evicted
            if ahead and carries_nothing(plan):
                self.held = True  # every request waits for the step in flight
                return
            self.was_busy = True
            if not self.group.send_plan(plan):
                return  # the group is lost: its event is handled next, in _handle_events
            sched.stats.steps_planned_ahead += ahead
            if sched.spec is not None and not ahead:
                self.sent_at[plan.step_id] = time.monotonic()
            self.in_flight.append(plan.step_id)

    def _drain_frontend(self) -> None:
        while True:
            try:
                data = self.from_frontend.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.in_codec.decode(data)
            if isinstance(msg, EngineRequest):
                if self.unavailable:
                    self.sched.reject(msg.req_id, ErrorCode.ENGINE_UNAVAILABLE, self._unavailable_message())
                else:
                    self.sched.add_request(msg)
            elif isinstance(msg, EngineAbort):
                self.sched.abort(msg.req_ids)
            elif isinstance(msg, StatsQuery):
                self.stats_due = True
            elif isinstance(msg, EngineShutdown):
                self.running = False
                return

    # ---- output -----------------------------------------------------------

    def _send_ready(self, num_blocks: int, max_len: int, vocab: int) -> None:
        self.to_frontend.send(self.out_codec.encode(EngineReady(num_blocks, self.config.block_size, max_len, vocab)))

    def _idle_check(self) -> None:
        problem = self.sched.check_blocks()
        self.sched.stats.blocks_consistent = problem is None
        if problem:
            log.error("KV block accounting is inconsistent while idle: %s", problem)
        self.stats_due = True

    def _publish(self) -> None:
        if self.side is not None:
            releases = self.sched.take_releases()
            if releases:
                self.side.send(releases)
        updates = self.sched.take_updates()
        now = time.monotonic()
        due = self.stats_due or ((updates or self.sched.has_work()) and now - self.last_stats > STATS_INTERVAL)
        stats = None
        if due:
            stats = self.sched.snapshot_stats()
            stats.workers_live = self.group.live
            stats.worker_status = self.group.status()
            stats.worker_restarts = max(0, self.groups_formed - 1)
            stats.attention_backend, stats.attention_reason = self.attention
            gap = now - self.no_worker_since if self.no_worker_since is not None else 0.0
            stats.seconds_without_worker = self.no_worker_total + gap
            stats.plan_bytes, stats.result_bytes = self.group.plan_bytes, self.group.result_bytes
            self.last_stats = now
            self.stats_due = False
        if updates or stats is not None:
            self.to_frontend.send(self.out_codec.encode(EngineOutputs(updates, stats)))

    def fail(self, reason: str) -> None:
        self.to_frontend.send(self.out_codec.encode(EngineDead(reason)))

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        if self.side is not None:
            self.side.close()
        for s in (self.from_frontend, self.to_frontend, self.router):
            s.close(linger=100)
        if self.curve is not None:
            self.curve.stop()
        self.sched.grammars.close()
        self.ctx.term()


def carries_nothing(plan: StepPlan) -> bool:
    """A plan the worker would only answer (nothing computed, swapped, dropped or pulled)."""
    return not (plan.scheduled or plan.new_requests or plan.cached_requests or plan.finished_req_ids
                or plan.swap_out or plan.swap_in or plan.kv_pulls or plan.kv_release)


def run(config: EngineConfig, addrs: EngineAddresses, link: WorkerLinkConfig) -> int:
    proc = SchedulerProcess(config, addrs, link)
    try:
        proc.serve()
        return 0
    except StartupFailed as e:
        if not e.logged:
            log.error("%s", e)
        proc.fail(str(e))
        return 1
    finally:
        proc.close()

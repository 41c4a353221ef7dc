"""The scheduler's side of the worker link: one ROUTER, the ranks registered on it, the group
they form, heartbeats and epochs.

A registration is checked (protocol version, rank, model identity) and refused with a reason
that both sides log. When ranks 0..N-1 have all registered, the epoch goes up by one and each
gets `Welcome`; when each has answered `WorkerReady` the group is live (`GroupReady`). Losing
any rank loses the group (`GroupLost`): the others get `Disband` and register again. A rank is
lost when a send to it fails (`ROUTER_MANDATORY`: its process died and the kernel closed its
socket), when it has been silent for `worker_timeout`, or when it reports a failure. Messages
carrying another epoch than the live group's are dropped, never applied.

The scheduler's own stalls (planning a large step, taking a large request) must not cost the
group: a keeper thread beats while the main thread is away from the ROUTER (`lock` says who
holds the socket: zmq sockets may change threads behind a lock, never be used by two at
once), and a rank's silence is measured up to `heard_until`, the moment up to which its
messages have been read, not up to the clock: what waits unread in the socket while the
main thread was busy is not silence.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from noria.protocol.codec import Codec
from noria.protocol.config import EngineConfig, WorkerLinkConfig
from noria.protocol.model_identity import ModelIdentity, identity_difference
from noria.protocol.step import StepPlan, StepResult
from noria.protocol.worker_link import (
    WORKER_PROTOCOL_VERSION,
    Disband,
    Heartbeat,
    Refused,
    Register,
    Welcome,
    WorkerFailed,
    WorkerReady,
    WorkerShutdown,
    WorkerToScheduler,
    heartbeat_interval,
)

log = logging.getLogger("noria.scheduler.workers")


LOADING_SILENCE = 4  # a loading rank may be silent this many worker timeouts


@dataclass
class Member:
    identity: bytes
    hello: Register
    last_seen: float
    ready: WorkerReady | None = None

    @property
    def name(self) -> str:
        h = self.hello
        return f"worker rank {h.rank} ({h.hostname} pid {h.pid})"


@dataclass(frozen=True)
class GroupReady:
    epoch: int
    num_kv_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    vocab_size: int
    attention_backend: str = ""  # rank 0's (WorkerReady)
    attention_reason: str = ""
    kv_endpoints: list[str] = field(default_factory=list)  # by rank: where a producer's ranks serve KV blocks


@dataclass(frozen=True)
class GroupLost:
    reason: str
    rejoining: bool = False  # the lost rank's own process registered again (it is alive)


Event = GroupReady | GroupLost | StepResult


class WorkerGroup:
    def __init__(self, router: zmq.Socket, config: EngineConfig, link: WorkerLinkConfig, model: ModelIdentity,
                 address: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.router = router
        self.config = config
        self.model = model
        self.address = address
        self.size = config.tensor_parallel_size
        self.timeout = link.worker_timeout
        self.interval = heartbeat_interval(link.worker_timeout)
        self.clock = clock
        self.codec: Codec[WorkerToScheduler] = Codec(WorkerToScheduler)
        self.members: dict[int, Member] = {}  # by rank
        self.epoch = 0
        self.plan_bytes = 0  # the link's traffic, for `noria bench failover`
        self.result_bytes = 0
        self.welcomed = False  # the members were sent Welcome with `epoch`
        self.welcomed_at = 0.0
        self.live = False  # ... and every one answered WorkerReady
        self.last_loss: str | None = None
        self.events: list[Event] = []
        self.next_beat = 0.0
        self.lock = threading.Lock()  # held by whoever uses `router`
        # Every message that reached the socket before this time has been read (`receive`);
        # inf where the caller reads messages itself (`on_message`) as they come.
        self.heard_until = math.inf
        self.stopping = threading.Event()
        self.keeper: threading.Thread | None = None

    # ---- inbound ----------------------------------------------------------

    def receive(self, limit: int) -> None:
        """Handle the messages waiting on the ROUTER, at most `limit` (so that a busy rank never
        starves the caller's other sockets); once the socket is empty, the ranks have been
        heard up to now. A frame with no payload (a peer speaking another protocol) is skipped."""
        with self.lock:
            now = self.clock()
            for _ in range(limit):
                try:
                    frames = self.router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    self.heard_until = now
                    return
                if len(frames) >= 2:
                    self.on_message(frames[0], frames[1])

    def on_message(self, identity: bytes, payload: bytes) -> None:
        member = next((m for m in self.members.values() if m.identity == identity), None)
        try:
            msg = self.codec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            if member is None:
                self._refuse(identity, None, f"cannot read its registration ({_version_hint(payload)}): {e}")
            else:
                log.warning("%s sent an undecodable message: %s", member.name, e)
            return
        now = self.clock()
        if isinstance(msg, Register):
            self._register(identity, msg, now)
            return
        if member is None:
            # A rank this scheduler does not know (declared lost, or the scheduler restarted):
            # whatever it holds is stale, so it must drop it and register again.
            self._send(identity, Disband(msg.epoch, "this scheduler does not know you: register again"))
            return
        member.last_seen = now
        if not self.welcomed or msg.epoch != self.epoch:
            log.debug("dropped a %s of epoch %d from %s (current epoch %d)", type(msg).__name__, msg.epoch,
                      member.name, self.epoch)
            return
        if isinstance(msg, WorkerReady):
            member.ready = msg
            self._maybe_live()
        elif isinstance(msg, StepResult):
            if msg.error:
                self._lose(member, f"{member.name} failed a step: {msg.error}")
            elif member.hello.rank == 0:
                self.result_bytes += len(payload)
                self.events.append(msg)
        elif isinstance(msg, WorkerFailed):
            # The rank has logged its failure (with any traceback) itself: the reason is passed
            # on (status, GroupLost, the engine's start-up error), not logged here again.
            last_line = msg.reason.strip().splitlines()[-1] if msg.reason.strip() else ""
            self._lose(member, f"{member.name} failed: {last_line}", logged=f"{member.name} failed")

    def _register(self, identity: bytes, msg: Register, now: float) -> None:
        reason = self._check(msg)
        if reason:
            self._refuse(identity, msg, reason)
            return
        old = self.members.get(msg.rank)
        if old is not None:
            if not self._replaceable(old, identity, msg, now):
                self._refuse(identity, msg, f"rank {msg.rank} is taken by a live {old.name}")
                return
            same = old.identity == identity or (old.hello.hostname, old.hello.pid) == (msg.hostname, msg.pid)
            self._lose(old, f"{old.name} was replaced by a new registration of rank {msg.rank}", rejoining=same)
        member = Member(identity, msg, now)
        self.members[msg.rank] = member
        log.info("%s registered: device %s, %.2f GiB for its KV cache", member.name, msg.device,
                 msg.kv_capacity_bytes / 2**30)
        if len(self.members) == self.size and not self.welcomed:
            self._welcome(now)

    def _check(self, msg: Register) -> str | None:
        if msg.protocol_version != WORKER_PROTOCOL_VERSION:
            return (f"worker protocol version {msg.protocol_version} != {WORKER_PROTOCOL_VERSION}, the "
                    "scheduler's: run the same noria version on both hosts")
        if not 0 <= msg.rank < self.size:
            return f"rank {msg.rank} is outside 0..{self.size - 1} (tensor_parallel_size {self.size})"
        if msg.model is not None:
            diff = identity_difference(self.model, msg.model)
            if diff:
                return f"its model is not the engine's ({self.config.model}): {diff}"
        if msg.rank == 0 and self.size > 1 and not msg.dist_address:
            return "rank 0 of a tensor-parallel group must offer a rendezvous address (dist_address)"
        return None

    def _replaceable(self, old: Member, identity: bytes, msg: Register, now: float) -> bool:
        """May a new registration take `old`'s rank? Yes if it is the same process again, or
        if `old` is gone: silent too long, or its connection closed (the probe's send fails)."""
        if old.identity == identity or (old.hello.hostname, old.hello.pid) == (msg.hostname, msg.pid):
            return True
        if now - old.last_seen > self.timeout:
            return True
        return not self._send(old.identity, Heartbeat(self.epoch))

    def _refuse(self, identity: bytes, msg: Register | None, reason: str) -> None:
        who = f"worker rank {msg.rank} ({msg.hostname} pid {msg.pid})" if msg else "a worker"
        log.error("refused %s: %s", who, reason)
        self._send(identity, Refused(reason))

    # ---- group life -------------------------------------------------------

    def _welcome(self, now: float) -> None:
        self.epoch += 1
        self.welcomed, self.live, self.welcomed_at = True, False, now
        dist = f"tcp://{self.members[0].hello.dist_address}" if self.size > 1 else None
        welcome = Welcome(self.epoch, self.config, self.model, self.interval, self.timeout, dist)
        log.debug("worker group of epoch %d formed: %s", self.epoch, ", ".join(m.name for m in self.members.values()))
        self._broadcast(welcome)

    def _maybe_live(self) -> None:
        readies = [m.ready for m in self.members.values()]
        if self.live or any(r is None for r in readies):
            return
        rs = [r for r in readies if r is not None]
        self.live = True
        self.last_loss = None
        first = min(rs, key=lambda r: r.rank)
        ready = GroupReady(self.epoch, min(r.num_kv_blocks for r in rs), min(r.num_cpu_blocks for r in rs),
                           min(r.max_model_len for r in rs), rs[0].vocab_size, first.attention_backend,
                           first.attention_reason,
                           [r.kv_endpoint for r in sorted(rs, key=lambda r: r.rank)] if any(r.kv_endpoint for r in rs) else [])
        log.info("worker group of epoch %d is live: %d KV blocks", self.epoch, ready.num_kv_blocks)
        self.events.append(ready)

    def _lose(self, member: Member, reason: str, *, rejoining: bool = False, logged: str | None = None) -> None:
        """Drop `member`; before Welcome only it, after Welcome the whole group. `logged`: what
        this log says instead of `reason` where the rank has logged the reason itself."""
        if self.members.get(member.hello.rank) is not member:
            return
        if not self.welcomed:
            del self.members[member.hello.rank]
            log.warning("%s (not yet in a group)", logged or reason)
            return
        lost_epoch = self.epoch
        others = [m for m in self.members.values() if m is not member]
        self.members.clear()
        self.welcomed = self.live = False
        self.last_loss = reason
        log.error("worker group of epoch %d lost: %s", lost_epoch, logged or reason)
        for m in others:
            self._send(m.identity, Disband(lost_epoch, reason))
        self.events.append(GroupLost(reason, rejoining))

    # ---- outbound and time ------------------------------------------------

    def send_plan(self, plan: StepPlan) -> bool:
        """Send one plan to every rank of the live group; False if that lost the group."""
        plan.epoch = self.epoch
        payload = self.codec.encode(plan)
        self.plan_bytes += len(payload)
        with self.lock:
            ok = self._broadcast(payload)
            self.next_beat = self.clock() + self.interval  # a plan says "alive" as well as a beat
        return ok

    def _broadcast(self, msg: msgspec.Struct | bytes) -> bool:
        payload = msg if isinstance(msg, bytes) else self.codec.encode(msg)
        for m in [self.members[r] for r in sorted(self.members)]:
            if not self._send(m.identity, payload):
                self._lose(m, f"the connection to {m.name} closed")
                return False
        return True

    def _send(self, identity: bytes, msg: msgspec.Struct | bytes) -> bool:
        payload = msg if isinstance(msg, bytes) else self.codec.encode(msg)
        try:
            self.router.send_multipart([identity, payload])
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise

    def tick(self) -> None:
        """Heartbeats due, silent ranks lost, a group that never became ready lost."""
        with self.lock:
            self._tick()

    def _tick(self) -> None:
        now = self.clock()
        heard = min(now, self.heard_until)
        for m in list(self.members.values()):
            # A rank loading its model on a busy host can starve its link's keeper thread for seconds
            # (safetensors and weight packing hold the GIL); it gets LOADING_SILENCE timeouts,
            # still bounded by startup_timeout. A dead local rank is seen at once anyway: the
            # heartbeat's send to its closed socket fails.
            allowed = self.timeout * (LOADING_SILENCE if self.welcomed and m.ready is None else 1)
            if heard - m.last_seen > allowed:
                self._lose(m, f"{m.name} has been silent for {heard - m.last_seen:.1f}s "
                              f"(worker timeout {allowed:g}s)")
        if self.welcomed and not self.live and now - self.welcomed_at > self.config.startup_timeout:
            slow = next(m for m in self.members.values() if m.ready is None)
            self._lose(slow, f"{slow.name} did not become ready in {self.config.startup_timeout:g}s")
        if now >= self.next_beat:
            self.next_beat = now + self.interval
            self._broadcast(Heartbeat(self.epoch))

    def status(self) -> str:
        """Why no group is live, in words (empty while one is)."""
        if self.live:
            return ""
        if self.welcomed:
            return f"worker group of epoch {self.epoch} is loading the model"
        missing = [r for r in range(self.size) if r not in self.members]
        waiting = f"waiting for worker rank(s) {missing} to register on {self.address}"
        return f"{self.last_loss}; {waiting}" if self.last_loss else waiting

    def start_keeper(self) -> None:
        """Beat from a thread of its own whenever the main thread is away from the socket."""
        self.keeper = threading.Thread(target=self._keep, name="scheduler-beats", daemon=True)
        self.keeper.start()

    def _keep(self) -> None:
        while not self.stopping.wait(self.interval / 2):
            if not self.lock.acquire(blocking=False):
                continue  # the main thread is at the socket, and beats itself
            try:
                now = self.clock()
                if now < self.next_beat or not self.members:
                    continue
                self.next_beat = now + self.interval
                beat = self.codec.encode(Heartbeat(self.epoch))
                for m in list(self.members.values()):
                    # A failed send is left to the main thread, which meets it at its own
                    # next send and loses the rank there (events are the main thread's).
                    with contextlib.suppress(zmq.ZMQError):
                        self.router.send_multipart([m.identity, beat], zmq.NOBLOCK)
            finally:
                self.lock.release()

    def shutdown(self) -> None:
        self.stopping.set()
        if self.keeper is not None:
            self.keeper.join()
        for m in self.members.values():
            self._send(m.identity, WorkerShutdown())


def _version_hint(payload: bytes) -> str:
    """The protocol version a registration we cannot decode claims, for the refusal."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return "not msgpack"
    if isinstance(raw, list) and len(raw) > 1 and raw[0] == "register":
        return f"it speaks worker protocol version {raw[1]!r}, this scheduler {WORKER_PROTOCOL_VERSION}"
    return f"this scheduler speaks worker protocol version {WORKER_PROTOCOL_VERSION}"

"""The scheduler's side of the worker link (`WorkerGroup`) against hand-driven DEALERs on real
inproc sockets, with a clock the test moves: registration checks, group formation, epochs,
losses, and that nothing from a lost incarnation is ever applied."""

from __future__ import annotations

import pytest
import zmq

from noria.protocol.codec import Codec
from noria.protocol.config import EngineConfig, WorkerLinkConfig
from noria.protocol.model_identity import ModelIdentity, WeightFile
from noria.protocol.step import StepPlan, StepResult
from noria.protocol.worker_link import (
    WORKER_PROTOCOL_VERSION,
    Disband,
    Heartbeat,
    Refused,
    Register,
    SchedulerToWorker,
    Welcome,
    WorkerFailed,
    WorkerReady,
)
from noria.scheduler.worker_group import LOADING_SILENCE, GroupLost, GroupReady, WorkerGroup
from tests.workers import wait_for

MODEL = ModelIdentity("aa" * 32, [WeightFile("model.safetensors", 1000, "bb" * 32)])
CODEC: Codec[SchedulerToWorker] = Codec(SchedulerToWorker)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Rig:
    """A ROUTER with its WorkerGroup, and DEALERs standing in for worker ranks."""

    def __init__(self, tp: int = 1) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.bind("inproc://workers")
        self.clock = Clock()
        config = EngineConfig(model="/m", tensor_parallel_size=tp)
        self.group = WorkerGroup(self.router, config, WorkerLinkConfig(worker_timeout=5.0), MODEL,
                                 "inproc://workers", clock=self.clock)
        self.dealers: list[zmq.Socket] = []

    def dealer(self) -> zmq.Socket:
        d = self.ctx.socket(zmq.DEALER)
        d.connect("inproc://workers")
        self.dealers.append(d)
        return d

    def send(self, dealer: zmq.Socket, msg: object) -> None:
        dealer.send(CODEC.encode(msg))
        identity, payload = self.router.recv_multipart()
        self.group.on_message(identity, payload)

    def recv(self, dealer: zmq.Socket) -> list[object]:
        """Everything the scheduler has sent this rank, heartbeats left out."""
        out = []
        while dealer.poll(50):
            msg = CODEC.decode(dealer.recv())
            if not isinstance(msg, Heartbeat):
                out.append(msg)
        return out

    def hang_up(self, dealer: zmq.Socket, rank: int) -> None:
        """Close a rank's socket, as its process dying would, and wait until the ROUTER knows
        (a closing inproc peer is noticed asynchronously: probe until the send fails)."""
        identity = self.group.members[rank].identity
        dealer.close(linger=0)
        self.dealers.remove(dealer)
        beat = CODEC.encode(Heartbeat(0))

        def gone() -> bool:
            try:
                self.router.send_multipart([identity, beat])
                return False
            except zmq.ZMQError as e:
                return e.errno == zmq.EHOSTUNREACH

        wait_for("the ROUTER to notice the closed socket", gone, 10)

    def events(self) -> list[object]:
        ev, self.group.events = self.group.events, []
        return ev

    def close(self) -> None:
        for s in (*self.dealers, self.router):
            s.close(linger=0)
        self.ctx.term()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def hello(rank: int = 0, pid: int = 10, model: ModelIdentity | None = MODEL, version: int = WORKER_PROTOCOL_VERSION,
          dist: str | None = "10.0.0.1:29500") -> Register:
    return Register(version, rank, "cpu", "host-a", pid, 1 << 30, model, dist)


def join(rig: Rig, pid: int = 10) -> tuple[zmq.Socket, Welcome]:
    d = rig.dealer()
    rig.send(d, hello(pid=pid))
    (welcome,) = rig.recv(d)
    assert isinstance(welcome, Welcome)
    rig.send(d, WorkerReady(welcome.epoch, 0, 64, 0, 1000, 2048))
    assert rig.events() == [GroupReady(welcome.epoch, 64, 0, 2048, 1000)]
    return d, welcome


def test_a_result_from_a_lost_incarnation_is_never_applied(rig):
    old, w1 = join(rig)
    assert rig.group.send_plan(StepPlan(1, [(0, 3)]))
    (plan,) = rig.recv(old)
    assert isinstance(plan, StepPlan) and plan.epoch == w1.epoch
    # The rank goes silent past the timeout: the group is lost.
    rig.clock.now += 6
    rig.group.tick()
    assert [type(e) for e in rig.events()] == [GroupLost]
    # The same process registers again on a fresh socket: a new epoch.
    new, w2 = join(rig)
    assert w2.epoch == w1.epoch + 1
    rig.send(old, StepResult(1, [0], [42], epoch=w1.epoch))  # the old incarnation's late answer
    assert rig.events() == []
    assert isinstance(rig.recv(old)[0], Disband), "an unknown rank is told to register again"
    rig.send(new, StepResult(1, [0], [7], epoch=w1.epoch))  # right socket, wrong epoch
    assert rig.events() == []
    rig.send(new, StepResult(1, [0], [7], epoch=w2.epoch))
    assert rig.events() == [StepResult(1, [0], [7], epoch=w2.epoch)]


@pytest.mark.parametrize(
    ("msg", "words"),
    [
        (hello(version=999), f"worker protocol version 999 != {WORKER_PROTOCOL_VERSION}"),
        (hello(rank=3), "rank 3 is outside 0..0"),
        (hello(model=ModelIdentity("cc" * 32, MODEL.weights)), "config.json differs"),
        (hello(model=ModelIdentity(MODEL.config_sha256, [WeightFile("model.safetensors", 999, "bb" * 32)])),
         "model.safetensors: size 999 on the worker != 1000"),
    ],
)
def test_registrations_that_cannot_serve_are_refused_by_name(rig, msg, words, caplog):
    d = rig.dealer()
    with caplog.at_level("ERROR", logger="noria.scheduler.workers"):
        rig.send(d, msg)
    (refused,) = rig.recv(d)
    assert isinstance(refused, Refused) and words in refused.reason
    assert any(words in r.getMessage() and "host-a" in r.getMessage() for r in caplog.records)
    assert rig.group.members == {} and not rig.group.welcomed


def test_an_undecodable_registration_is_refused_with_its_version():
    rig = Rig()
    try:
        d = rig.dealer()
        d.send(Codec(object).encode(["register", 7, "a shape from the future"]))
        rig.group.on_message(*rig.router.recv_multipart())
        (refused,) = rig.recv(d)
        assert isinstance(refused, Refused) and "version 7" in refused.reason
    finally:
        rig.close()


def test_a_live_rank_is_not_taken_but_a_dead_one_is(rig):
    first, w1 = join(rig, pid=10)
    intruder = rig.dealer()
    rig.send(intruder, hello(pid=11))
    (refused,) = rig.recv(intruder)
    assert isinstance(refused, Refused) and "taken by a live worker rank 0 (host-a pid 10)" in refused.reason
    assert rig.events() == []
    # Its socket closes (the process died): the probe's send fails and the rank is free.
    rig.hang_up(first, 0)
    replacement = rig.dealer()
    rig.send(replacement, hello(pid=12))
    (lost,) = rig.events()
    assert isinstance(lost, GroupLost) and not lost.rejoining  # another process: the old one failed
    (welcome,) = rig.recv(replacement)
    assert isinstance(welcome, Welcome) and welcome.epoch == w1.epoch + 1


def test_a_rank_that_registers_again_from_a_fresh_socket_is_rejoining(rig):
    """A worker on a loaded host that heard nothing for its registration timeout reconnects
    and registers again: the same process, so the loss says it is rejoining (start-up waits)."""
    first = rig.dealer()
    rig.send(first, hello(pid=10))
    (w1,) = rig.recv(first)
    again = rig.dealer()
    rig.send(again, hello(pid=10))
    (lost,) = rig.events()
    assert isinstance(lost, GroupLost) and lost.rejoining and "replaced by a new registration" in lost.reason
    (w2,) = rig.recv(again)
    assert isinstance(w2, Welcome) and w2.epoch == w1.epoch + 1


def test_a_tensor_parallel_group_forms_from_every_rank_and_falls_with_any():
    rig = Rig(tp=2)
    try:
        r1, r0 = rig.dealer(), rig.dealer()
        rig.send(r1, hello(rank=1, pid=21, dist=None))
        assert rig.recv(r1) == [], "no Welcome before every rank has registered"
        rig.send(r0, hello(rank=0, pid=20, dist="10.0.0.5:29511"))
        (w0,), (w1,) = rig.recv(r0), rig.recv(r1)
        assert w0 == w1 and w0.dist_init_method == "tcp://10.0.0.5:29511" and w0.config.tensor_parallel_size == 2
        rig.send(r0, WorkerReady(w0.epoch, 0, 64, 8, 1000, 2048, "kernels", ""))
        assert rig.events() == []
        rig.send(r1, WorkerReady(w0.epoch, 1, 48, 4, 1000, 1024, "torch", "why not"))
        # Capacity is the minimum over ranks; the attention backend reported is rank 0's.
        assert rig.events() == [GroupReady(w0.epoch, 48, 4, 1024, 1000, "kernels", "")]
        rig.hang_up(r1, 1)
        assert not rig.group.send_plan(StepPlan(1, [(0, 1)]))
        assert [type(e) for e in rig.events()] == [GroupLost]
        assert [type(m) for m in rig.recv(r0)] == [StepPlan, Disband]
        assert rig.group.members == {} and "waiting for worker rank(s) [0, 1]" in rig.group.status()
    finally:
        rig.close()


def test_rank_0_of_a_group_must_offer_a_rendezvous():
    rig = Rig(tp=2)
    try:
        d = rig.dealer()
        rig.send(d, hello(rank=0, dist=None))
        (refused,) = rig.recv(d)
        assert isinstance(refused, Refused) and "rendezvous" in refused.reason
    finally:
        rig.close()


def test_heartbeats_go_out_and_silence_is_counted_from_the_last_word(rig):
    d, w = join(rig)
    rig.clock.now += 1.0
    rig.group.tick()
    assert CODEC.decode(d.recv()) == Heartbeat(w.epoch)
    rig.clock.now += 4.0
    rig.send(d, Heartbeat(w.epoch))  # heard 5 s after joining: still alive at 9 s
    rig.clock.now += 4.0
    rig.group.tick()
    assert rig.events() == [] and rig.group.live
    rig.clock.now += 1.5
    rig.group.tick()
    (lost,) = rig.events()
    assert isinstance(lost, GroupLost) and "silent for 5.5s" in lost.reason


def test_the_schedulers_own_stall_is_not_a_ranks_silence(rig):
    d, w = join(rig)
    rig.group.receive(64)  # nothing waiting: every rank is heard up to now
    rig.clock.now += 6.0  # the scheduler plans a huge step and reads nothing meanwhile
    rig.group.tick()
    assert rig.events() == [] and rig.group.live
    d.send(CODEC.encode(Heartbeat(w.epoch)))  # the rank's beat waited in the socket
    wait_for("the beat to reach the ROUTER", lambda: rig.router.poll(0), 5)
    rig.group.receive(64)
    rig.clock.now += 4.0
    rig.group.tick()
    assert rig.events() == [] and rig.group.live
    rig.clock.now += 1.5  # now it really has been silent, with the socket read empty
    rig.group.receive(64)
    rig.group.tick()
    (lost,) = rig.events()
    assert isinstance(lost, GroupLost) and "silent for 5.5s" in lost.reason


def test_the_keeper_beats_while_the_main_thread_is_away(rig):
    d, w = join(rig)
    rig.group.start_keeper()
    try:
        for _ in range(3):  # the test's thread never touches the socket: only the keeper can beat
            rig.clock.now += rig.group.interval
            assert wait_for("a heartbeat from the keeper", lambda: d.poll(50), 10)
            assert CODEC.decode(d.recv()) == Heartbeat(w.epoch)
    finally:
        rig.group.stopping.set()
        assert rig.group.keeper is not None
        rig.group.keeper.join()


def test_a_loading_rank_may_be_silent_longer_but_not_for_ever(rig):
    d = rig.dealer()
    rig.send(d, hello())
    (w,) = rig.recv(d)  # welcomed; loading the model (no WorkerReady yet)
    rig.clock.now += 5.0 * LOADING_SILENCE - 0.5
    rig.group.tick()
    assert rig.events() == [] and 0 in rig.group.members
    rig.clock.now += 1.0
    rig.group.tick()
    (lost,) = rig.events()
    assert isinstance(lost, GroupLost) and f"worker timeout {5.0 * LOADING_SILENCE:g}s" in lost.reason


def test_a_rank_that_reports_a_failure_loses_the_group_and_a_stale_report_does_not(rig):
    d, w = join(rig)
    rig.send(d, WorkerFailed(w.epoch - 1, 0, "an old incarnation's failure"))
    assert rig.events() == [] and rig.group.live
    rig.send(d, WorkerFailed(w.epoch, 0, "Traceback (most recent call last):\nRuntimeError: boom"))
    (lost,) = rig.events()
    assert isinstance(lost, GroupLost) and "worker rank 0 (host-a pid 10) failed: RuntimeError: boom" in lost.reason
    assert not rig.group.live and "RuntimeError: boom" in rig.group.status()

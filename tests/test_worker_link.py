"""The worker's side of the worker link (`WorkerLink`) against a hand-driven ROUTER on ipc:
plans come out of `recv` in the order sent, with the scheduler's heartbeats taken out; the
link beats and listens while the main thread is busy (a long step is not a lost scheduler,
and what arrived meanwhile is kept, in order); silence ends in `LinkDown`; `connect` is a new
incarnation; a result sent just before `close` still arrives."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from noria.protocol.codec import Codec
from noria.protocol.step import StepPlan, StepResult
from noria.protocol.worker_link import (
    WORKER_PROTOCOL_VERSION,
    Heartbeat,
    Register,
    SchedulerToWorker,
    WorkerToScheduler,
)
from noria.worker.link import LinkDown, WorkerLink
from tests.workers import wait_for

HANG = 60.0  # s: a wait for a message that has not come by then hangs

TO_WORKER: Codec[SchedulerToWorker] = Codec(SchedulerToWorker)
FROM_WORKER: Codec[WorkerToScheduler] = Codec(WorkerToScheduler)


class Scheduler:
    """A ROUTER standing in for the scheduler: what each identity sent, in order."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(address)
        self.got: list[tuple[bytes, object]] = []

    def pump(self, seconds: float) -> None:
        """Read what the workers send for `seconds`."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self.router.poll(max(1, int(left * 1000))):
                identity, payload = self.router.recv_multipart()
                self.got.append((identity, FROM_WORKER.decode(payload)))

    def wait_for(self, kind: type, timeout: float = 60.0) -> tuple[bytes, object]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = [(i, m) for i, m in self.got if isinstance(m, kind)]
            if found:
                return found[-1]
            self.pump(0.02)
        raise AssertionError(f"no {kind.__name__} from the worker in {timeout}s")

    def send(self, identity: bytes, msg: object) -> None:
        self.router.send_multipart([identity, TO_WORKER.encode(msg)])

    def close(self) -> None:
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
def rig(tmp_path) -> Iterator[tuple[Scheduler, WorkerLink]]:  # noqa: ANN001 - pytest's tmp_path
    address = f"ipc://{tmp_path}/workers"
    sched = Scheduler(address)
    link = WorkerLink(address)
    try:
        yield sched, link
    finally:
        link.close()
        sched.close()


def _registered(sched: Scheduler, link: WorkerLink, timeout: float = 5.0) -> bytes:
    link.connect(timeout=timeout)
    link.send(Register(WORKER_PROTOCOL_VERSION, 0, "cpu", "test-host", 1, 0, None))
    identity, _ = sched.wait_for(Register)
    return identity


def test_plans_come_out_in_order_without_the_schedulers_heartbeats(rig):
    sched, link = rig
    me = _registered(sched, link)
    for msg in (Heartbeat(0), StepPlan(1, []), Heartbeat(0), StepPlan(2, []), Heartbeat(0), StepPlan(3, [])):
        sched.send(me, msg)
    got = [link.recv(timeout=HANG) for _ in range(3)]
    # The heartbeats never reach the main thread: each recv is the next plan.
    assert [getattr(m, "step_id", m) for m in got] == [1, 2, 3]


def test_a_result_reaches_the_scheduler_and_a_plan_the_worker(rig):
    sched, link = rig
    me = _registered(sched, link)
    sched.send(me, StepPlan(7, [(1, 3)]))
    plan = link.recv(timeout=HANG)
    assert isinstance(plan, StepPlan) and plan.scheduled == [(1, 3)]
    link.send(StepResult(7, [1], [42]))
    identity, result = sched.wait_for(StepResult)
    assert identity == me and result.token_ids == [42]  # type: ignore[attr-defined]


def test_a_busy_main_thread_keeps_beating_and_keeps_what_arrived_in_order(rig):
    sched, link = rig
    me = _registered(sched, link)
    interval, timeout = 0.05, 1.0
    link.beat(epoch=3, interval=interval, timeout=timeout)
    sched.got.clear()
    # The "step" lasts, away from the link, until the keeper has beaten 3 timeouts' worth of
    # times (each beat waits an interval at least), while the scheduler answers each beat and
    # sends two plans: nothing may count as lost, and nothing may be reordered.
    need = round(3 * timeout / interval)

    def beats() -> list[Heartbeat]:
        return [m for i, m in sched.got if i == me and isinstance(m, Heartbeat)]

    answered, sent, end = 0, 0, time.monotonic() + HANG
    while len(beats()) < need:
        assert time.monotonic() < end, f"{len(beats())} of {need} beats from a worker whose main thread is busy"
        for _ in range(len(beats()) - answered):
            sched.send(me, Heartbeat(3))
        answered = len(beats())
        if sent < 2 and answered >= need * (sent + 1) // 3:
            sent += 1
            sched.send(me, StepPlan(sent, []))
        sched.pump(interval)
    assert sent == 2 and all(b.epoch == 3 for b in beats())
    got = [link.recv(timeout=0), link.recv(timeout=0), link.recv(timeout=0)]
    assert [getattr(m, "step_id", m) for m in got] == [1, 2, None]


def test_silence_is_link_down_after_the_timeout(rig):
    sched, link = rig
    _registered(sched, link)
    link.beat(epoch=1, interval=0.05, timeout=0.3)
    t0 = time.monotonic()
    msg = link.recv(timeout=HANG)
    assert isinstance(msg, LinkDown) and "silent" in msg.reason
    assert time.monotonic() - t0 >= 0.25, "link down before the timeout"  # a slower machine is only later


def test_silence_while_busy_is_link_down_once_the_main_thread_asks(rig):
    sched, link = rig
    _registered(sched, link)
    link.beat(epoch=1, interval=0.05, timeout=0.2)
    # A long step, away from the link until the keeper has noticed the silence.
    wait_for("the keeper to notice the silence", lambda: link.down, HANG)
    msg = link.recv(timeout=0)
    assert isinstance(msg, LinkDown)
    assert link.recv(timeout=0.1) is None  # said once


def test_connect_again_is_a_new_incarnation(rig):
    sched, link = rig
    first = _registered(sched, link)
    sched.got.clear()
    second = _registered(sched, link)
    assert first != second
    sched.send(second, StepPlan(5, []))
    assert getattr(link.recv(timeout=HANG), "step_id", None) == 5


def test_what_was_sent_before_close_arrives(tmp_path):
    address = f"ipc://{tmp_path}/workers"
    sched = Scheduler(address)
    link = WorkerLink(address)
    try:
        _registered(sched, link)
        link.send(StepResult(9, [], [], error="boom"))
        link.close()
        _, result = sched.wait_for(StepResult)
        assert result.error == "boom"  # type: ignore[attr-defined]
    finally:
        sched.close()

"""A consumer rank's pulls run beside its steps, one after another on a thread of their own.

A plan's `kv_pulls` are queued when the plan arrives; the step goes on at once, so decoding
requests never wait for a transfer (the reason to disaggregate at all), and a pull's outcome
goes out with the first step result after it ends (`StepResult.kv_pulled`). The scheduler keeps
a pulling request's blocks to itself until that outcome has arrived (even if the request ended
meanwhile), so the thread writes blocks no step reads or reuses. With several tensor-parallel
ranks, a pull is reported once every rank's shard has ended (`ModelRunner._collect_pulls`),
in the order the plans named them, which every rank shares.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from noria.protocol.step import KVPull, KVPulled
from noria.worker.kv_pull import KVPuller


class PullQueue:
    def __init__(self, puller: KVPuller) -> None:
        self.puller = puller
        self.cv = threading.Condition()  # over every field below
        self.todo: deque[KVPull] = deque()
        self.outstanding: list[int] = []  # request ids not yet reported, in plan order
        self.finished: dict[int, KVPulled] = {}
        self.busy = False
        self.cancelling = False
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="kv-pull", daemon=True)
        self.thread.start()

    def submit(self, pulls: list[KVPull]) -> None:
        with self.cv:
            self.todo.extend(pulls)
            self.outstanding += [p.req_id for p in pulls]
            self.cv.notify_all()

    def wait_any(self, timeout: float) -> None:
        """Wait up to `timeout` s for a pull to end (a step with nothing else to do)."""
        with self.cv:
            if self.outstanding and not self.finished:
                self.cv.wait(timeout)

    def snapshot(self) -> list[tuple[int, KVPulled | None]]:
        """Every pull not yet reported, in plan order, with its outcome if it has ended here."""
        with self.cv:
            return [(rid, self.finished.get(rid)) for rid in self.outstanding]

    def forget(self, req_ids: list[int]) -> None:
        """These were reported."""
        gone = set(req_ids)
        with self.cv:
            self.outstanding = [r for r in self.outstanding if r not in gone]
            for rid in gone:
                self.finished.pop(rid, None)

    def cancel_all(self) -> None:
        """Drop every pull (the worker group is gone): the one running stops at its next piece,
        and this returns once the thread writes nothing more."""
        with self.cv:
            self.todo.clear()
            self.cancelling = True
            while self.busy:
                self.cv.wait()
            self.outstanding, self.finished = [], {}
            self.cancelling = False

    def close(self) -> None:
        with self.cv:
            self.stopping = True
            self.todo.clear()
            self.cv.notify_all()
        self.thread.join()  # a running pull stops within kv_pull.CANCEL_CHECK_SECONDS
        self.puller.close()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.todo and not self.stopping:
                    self.cv.wait()
                if self.stopping:
                    return
                pull = self.todo.popleft()
                self.busy = True
            t0 = time.perf_counter()
            try:
                nbytes, error = self.puller.pull(pull, lambda: self.cancelling or self.stopping)
            except Exception as e:  # noqa: BLE001 - a pull that breaks fails; the thread serves on
                nbytes, error = 0, f"the pull broke: {e!r}"
            outcome = KVPulled(pull.req_id, error is None, nbytes, time.perf_counter() - t0, error)
            with self.cv:
                self.busy = False
                if not self.cancelling:
                    self.finished[pull.req_id] = outcome
                self.cv.notify_all()

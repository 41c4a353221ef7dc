"""Keeps `noria serve`'s engine going when its scheduler dies: a new scheduler, and every open
request resubmitted from the tokens its client already has.

The frontend owns what a client has been sent (each sample's output ids, its detokenizer and
stop-string state), so the scheduler holds nothing that cannot be rebuilt: after a restart
each open sample goes back as an `EngineRequest` with its prompt and its outputs so far
(`output_token_ids`). The scheduler counts those as outputs (`max_tokens`, `min_tokens`,
penalties, the position of a seeded request's noise), so the stream goes on with no token
twice or missing, and greedy and seeded outputs equal an undisturbed run's.

While the new engine starts, requests wait (new ones are taken and sent once it is ready);
past `worker_wait` seconds they end with `engine_unavailable`, as with a lost worker. At
most `max_restarts` restarts within `RESTART_WINDOW` seconds: past that, or when a
restarted engine is not ready within its start-up timeout, the engine is dead for good and
every request ends with `engine_dead`.

Once the server drains (`hold_restarts`), nothing is restarted: a scheduler or local rank that
exits then was most likely stopped with the server (a service manager signals every process
of the service), so the open requests end at once with `shutting_down` (nothing can finish
them) and the server exits 0, without waiting out `--drain-timeout`.
"""

from __future__ import annotations

import collections
import logging
import time

from noria.frontend.core import FrontendCore
from noria.frontend.launcher import SIGNAL_GRACE
from noria.protocol.config import RESTART_WINDOW
from noria.protocol.engine import EngineDead, EngineOutputs, EngineReady
from noria.protocol.errors import ErrorCode

log = logging.getLogger("noria.frontend")


class Supervisor:
    def __init__(self, core: FrontendCore, max_restarts: int = 0, worker_wait: float = 30.0,
                 startup_timeout: float = 300.0) -> None:
        self.core = core
        self.max_restarts = max_restarts
        self.worker_wait = worker_wait
        self.startup_timeout = startup_timeout
        self.recent: collections.deque[float] = collections.deque()
        self.restarts = 0  # schedulers started again, in all
        self.reason = ""  # why the last one died
        self.unavailable = False  # this restart outlasted worker_wait: requests are refused
        self.draining = False  # the server drains: nothing is restarted
        self.stopped: str | None = None  # while draining: why the engine can no longer serve

    @property
    def restarting(self) -> bool:
        return self.core.engine.restarting

    def hold_restarts(self) -> None:
        """The server drains: restart nothing from now on (neither the scheduler nor a rank)."""
        self.draining = True
        if self.core.engine.procs is not None:
            self.core.engine.procs.hold_restarts()

    def pump(self, timeout_ms: int) -> str | None:
        """Apply what the engine has sent (waiting up to `timeout_ms` for it), notice a dead
        scheduler and restart it. Returns why the engine is dead for good, or None."""
        engine = self.core.engine
        for msg in engine.recv(timeout_ms):
            if isinstance(msg, EngineOutputs):
                self.core.on_outputs(msg)
            elif isinstance(msg, EngineReady):
                if engine.restarting:
                    self._ready(msg)
            elif isinstance(msg, EngineDead):
                return self._lost(msg.reason)  # what follows it came from the same dying scheduler
        if engine.restarting:
            return self._check_restart()
        dead = self._down()
        if dead and not self.draining and engine.procs is not None and engine.procs.scheduler_signalled():
            # Signalled along with the server? Its SIGTERM handler (this thread's) runs while we sleep.
            time.sleep(SIGNAL_GRACE)
        return self._lost(dead) if dead else None

    def _down(self) -> str | None:
        """Why the engine cannot serve: its scheduler exited, or (while draining, when no rank is
        restarted) a local rank did; None if it can."""
        engine = self.core.engine
        dead = engine.dead()
        if dead is None and self.draining and engine.procs is not None:
            dead = engine.procs.worker_down()
        return dead

    def _check_restart(self) -> str | None:
        engine = self.core.engine
        dead = self._down()
        if dead:
            # "the scheduler process exited ..." -> "the restarted scheduler process exited ..."
            return self._lost(dead if self.draining else f"the restarted {dead[4:]}")
        waited = time.monotonic() - engine.restarted_at
        if waited > self.startup_timeout:
            return self._lost(f"the restarted engine was not ready within {self.startup_timeout:g}s")
        if waited > self.worker_wait and not self.unavailable:
            self.unavailable = True
            why = (f"the engine has been restarting for {self.worker_wait:g}s (--worker-wait) after "
                   f"{self.reason}; retry later")
            if self.core.refusing is None:  # a draining server keeps refusing as shutting_down
                self.core.refusing = (ErrorCode.ENGINE_UNAVAILABLE, why)
            n = self.core.end_all(ErrorCode.ENGINE_UNAVAILABLE, why)
            log.error("%s; %d request(s) ended", why, n)
        return None

    def _lost(self, reason: str) -> str | None:
        """The scheduler is gone: restart it if the bound allows, else end everything."""
        if self.draining:
            self._stopped_while_draining(reason)
            return None
        now = time.monotonic()
        while self.recent and now - self.recent[0] > RESTART_WINDOW:
            self.recent.popleft()
        if self.core.engine.procs is None or len(self.recent) >= self.max_restarts:
            log.error("the scheduler died (%s); not restarting it: %d restart(s) in the last %gs "
                      "(--max-scheduler-restarts %d)", reason, len(self.recent), RESTART_WINDOW, self.max_restarts)
            self.core.fail_all(f"engine died: {reason}")
            return reason
        self.recent.append(now)
        self.restarts += 1
        self.reason = reason
        log.warning("the scheduler died (%s); starting a new one (restart %d); %d request(s) wait for it",
                    reason, self.restarts, self.core.num_open)
        self.core.engine.restart()
        return None

    def _stopped_while_draining(self, reason: str) -> None:
        """The engine stopped while the server drains: no request can finish, so each ends now."""
        n = self.core.end_all(ErrorCode.SHUTTING_DOWN, "the server is shutting down: the engine stopped before "
                              "the request finished")
        if self.stopped is None:
            self.stopped = reason
            log.warning("the engine stopped while the server drains (%s); %d open request(s) ended", reason, n)

    def _ready(self, ready: EngineReady) -> None:
        self.core.engine.on_ready(ready)
        if self.unavailable:
            self.unavailable = False
            if self.core.refusing is not None and self.core.refusing[0] == ErrorCode.ENGINE_UNAVAILABLE:
                self.core.refusing = None
        n = self.core.resubmit_all()
        log.warning("the restarted engine is ready; %d request(s) resubmitted", n)

"""`--data-parallel-size N`: N engines (a scheduler with its workers each) behind one frontend.

The group stands where one EngineClient stands (FrontendCore, the server loop, the supervisor
use the same few calls) and decides, request by request, which engine runs it:

- Prefix affinity: the frontend has the prompt's token ids, so the group keeps, per engine, the
  digests of the block-aligned prompt prefixes it sent there (chained as the scheduler chains
  its block hashes, the request's cache_salt in the first). A request goes to the engine that
  most likely holds its longest prefix, unless that engine is much busier than the least busy.
- Load: the requests each engine holds now (sent, not yet finished or aborted), counted here as
  they are routed, so that a burst spreads at once rather than after the next stats reply.

An engine whose scheduler dies does not take its requests with it: the group asks the core to
send them again (the same resubmission a scheduler restart has: each sample goes on from the
tokens its client already has) to the engines still serving, and restarts the dead one, which
rejoins once ready. Only when every engine is down is the group itself down (`dead`), and the
supervisor's restart of the whole group applies.

Stats are the sum over the engines (`engines` keeps each one's, in rank order).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import msgspec
import zmq

from noria.frontend.engine_client import EngineClient
from noria.protocol.client import SchedulerStats
from noria.protocol.config import RESTART_WINDOW, EngineConfig, WorkerLinkConfig
from noria.protocol.engine import (
    EngineDead,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    SchedulerToFrontend,
)
from noria.protocol.sockets import offset_port

log = logging.getLogger("noria.frontend")

# Prefix digests remembered per engine (an approximation of its cache: the oldest are forgotten).
MAX_PREFIXES = 200_000
# Affinity yields to load when the engine holding the prefix has this many more requests than the
# least busy one and more than twice as many.
BUSIER_BY = 4
DEAD_CHECK_INTERVAL = 0.25
# An engine restarted this many times within RESTART_WINDOW stays down (the others serve).
MAX_ENGINE_RESTARTS = 3


def prefix_digests(prompt: list[int], block_size: int, salt: str | None) -> list[int]:
    """One digest per full block of `prompt`, each chained from the one before (and the salt)."""
    out, parent = [], hash(("salt", salt))
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = hash((parent, tuple(prompt[start:start + block_size])))
        out.append(parent)
    return out


class _Member:
    def __init__(self, rank: int, client: EngineClient) -> None:
        self.rank = rank
        self.client = client
        self.prefixes: OrderedDict[int, None] = OrderedDict()
        self.rids: set[int] = set()  # samples it runs now
        self.stats: SchedulerStats | None = None
        self.down = False  # its scheduler died and is not being restarted
        self.restarts: deque[float] = deque()  # when it was restarted, within RESTART_WINDOW

    def remember(self, digests: list[int]) -> None:
        for d in digests:
            self.prefixes[d] = None
            self.prefixes.move_to_end(d)
        while len(self.prefixes) > MAX_PREFIXES:
            self.prefixes.popitem(last=False)

    def matched(self, digests: list[int]) -> int:
        n = 0
        for d in digests:
            if d not in self.prefixes:
                break
            n += 1
        return n


def member_config(config: EngineConfig, rank: int, link: WorkerLinkConfig | None,
                  cpus: int | None = None) -> tuple[EngineConfig, WorkerLinkConfig | None]:
    """Engine `rank`'s configuration: its rank, and ports of its own where the group's are given
    (a worker link or a KV-event socket on port P becomes P + rank, as vLLM offsets them).

    Engines whose ranks run on this host's CPU share its cores: unless --num-threads says
    otherwise, each rank gets an equal share (`cpus`, default this process's). Each rank taking
    every core, with OpenMP's threads spinning between kernels, ran two engines on two cores at a
    fifth of one engine's rate (`noria bench routing`)."""
    config = msgspec.structs.replace(config, data_parallel_rank=rank)
    if link is not None and link.worker_listen:
        link = msgspec.structs.replace(link, worker_listen=_rank_port(link.worker_listen, rank))
    elif config.num_threads is None and config.device != "cuda":
        if cpus is None:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        share = max(1, cpus // (config.data_parallel_size * config.tensor_parallel_size))
        config = msgspec.structs.replace(config, num_threads=share)
    return config, link


def _rank_port(address: str, rank: int) -> str:
    """The worker link of engine `rank`; an address without a port to offset is refused."""
    offset = offset_port(address, rank)
    if offset is None:
        raise ValueError(f"{address!r}: with --data-parallel-size each engine needs a port of its own, so the "
                         "address must be tcp://HOST:PORT (engine r takes PORT + r)")
    return offset


class EngineGroup:
    """N engines as one (see the module docstring)."""

    def __init__(self, config: EngineConfig, size: int, link: WorkerLinkConfig | None = None) -> None:
        configs = [member_config(config, r, link) for r in range(size)]
        with concurrent.futures.ThreadPoolExecutor(size) as pool:  # they start side by side
            futures = [pool.submit(EngineClient, c, link=lk) for c, lk in configs]
            clients: list[EngineClient] = []
            errors = []
            for f in futures:
                try:
                    clients.append(f.result())
                except BaseException as e:  # noqa: BLE001 - every engine is stopped before raising
                    errors.append(e)
        if errors:
            for c in clients:
                c.close()
            raise errors[0]
        self.members = [_Member(r, c) for r, c in enumerate(clients)]
        self.block_size = self.members[0].client.ready.block_size
        self.ready: EngineReady = self.members[0].client.ready
        self.owner: dict[int, _Member] = {}  # sample id -> the engine that runs it
        self.pending: list[EngineRequest] = []  # while no engine serves (each is restarting)
        self.procs = _GroupProcs(self)
        # Set by the frontend core: sends the named samples again (to whichever engine `add` picks).
        self.resubmit: Callable[[set[int]], int] | None = None
        self.restarted_at = 0.0
        self.whole_restart = False  # the supervisor restarts the whole group
        self.startup_timeout = config.startup_timeout
        self._checked = 0.0
        self._polled: tuple[list[zmq.Socket], zmq.Poller] | None = None

    # ---- what FrontendCore and the loops call -------------------------------------------

    @property
    def restarting(self) -> bool:
        """The supervisor restarts the whole group (an engine restarted alone is the group's affair:
        requests wait in `pending` while none serves)."""
        return self.whole_restart

    @property
    def pull(self) -> zmq.Socket:
        return self.members[0].client.pull

    def sockets(self) -> list[zmq.Socket]:
        return [m.client.pull for m in self.members]

    def add(self, req: EngineRequest) -> None:
        if self.whole_restart:
            return  # the supervisor resubmits every open request once the group is ready
        if not self.serving():
            self.pending.append(req)
            return
        digests = prefix_digests(req.prompt_token_ids, self.block_size, req.cache_salt)
        member = self._pick(digests)
        member.remember(digests)
        for s in req.samples():
            self.owner[s.req_id] = member
            member.rids.add(s.req_id)
        member.client.add(req)

    def abort(self, req_ids: list[int]) -> None:
        if self.pending:
            gone = set(req_ids)
            self.pending = [r for r in self.pending if not gone & {s.req_id for s in r.samples()}]
        by_member: dict[int, list[int]] = {}
        for rid in req_ids:
            m = self.owner.pop(rid, None)
            if m is not None:
                m.rids.discard(rid)
                by_member.setdefault(m.rank, []).append(rid)
        for rank, rids in by_member.items():
            self.members[rank].client.abort(rids)

    def query_stats(self) -> None:
        for m in self.serving():
            m.client.query_stats()

    def recv(self, timeout_ms: int) -> list[SchedulerToFrontend]:
        """Every member's messages: outputs (stats summed over the group), and the group's own
        EngineReady / EngineDead only when the whole group comes up or goes down."""
        if not self._poller().poll(timeout_ms):
            self._check_members()
            return []
        out: list[SchedulerToFrontend] = []
        for m in self.members:
            for msg in m.client.recv(0):
                if isinstance(msg, EngineOutputs):
                    self._forget_finished(m, msg)
                    if msg.stats is not None:
                        m.stats = msg.stats
                        msg.stats = self.stats()
                    out.append(msg)
                elif isinstance(msg, EngineReady):
                    if m.client.restarting:
                        self._rejoined(m, msg, out)
                elif isinstance(msg, EngineDead):
                    self._lost(m, msg.reason, out)
        self._check_members(out)
        return out

    def _poller(self) -> zmq.Poller:
        """One poller over the members' sockets, made again only when a restart replaced one."""
        sockets = self.sockets()
        if self._polled is None or self._polled[0] != sockets:
            poller = zmq.Poller()
            for s in sockets:
                poller.register(s, zmq.POLLIN)
            self._polled = (sockets, poller)
        return self._polled[1]

    def dead(self) -> str | None:
        """Why the group cannot serve: every engine is down for good (None while one serves or
        is being restarted)."""
        self._check_members()
        if all(m.down for m in self.members):
            return f"every engine of the group is down (engine 0: {self.members[0].client.dead()})"
        return None

    def restart(self) -> None:
        """Every engine down: restart them all (the supervisor's restart of the whole group)."""
        for m in self.members:
            m.client.restart()
            m.down = False
            m.rids.clear()
            m.restarts.clear()
        self.owner.clear()
        self.pending.clear()
        self.whole_restart = True
        self.restarted_at = time.monotonic()

    def on_ready(self, ready: EngineReady) -> None:
        self.ready = ready
        self.whole_restart = False

    def close(self) -> None:
        for m in self.members:
            m.client.close()

    # ---- routing, stats and losses -----------------------------------------------------

    def serving(self) -> list[_Member]:
        return [m for m in self.members if not m.down and not m.client.restarting]

    def _pick(self, digests: list[int]) -> _Member:
        live = self.serving() or self.members  # none serving: the supervisor restarts the group
        # Equal loads: the engine holding fewer prefixes, so that distinct prompts spread their
        # blocks over every cache.
        least = min(live, key=lambda m: (len(m.rids), len(m.prefixes), m.rank))
        best = max(live, key=lambda m: (m.matched(digests), -len(m.rids)))
        if best.matched(digests) == 0:
            return least
        load, low = len(best.rids), len(least.rids)
        if load - low >= BUSIER_BY and load > 2 * low:
            return least
        return best

    def stats(self) -> SchedulerStats:
        """The engines' stats summed (usage: blocks in use over all blocks)."""
        known = [m.stats for m in self.members if m.stats is not None]
        total = SchedulerStats(block_size=self.block_size)
        if not known:
            return total
        for field in SchedulerStats.__struct_fields__:
            values = [getattr(s, field) for s in known]
            if isinstance(values[0], bool):
                setattr(total, field, all(values))
            elif isinstance(values[0], int | float):
                setattr(total, field, sum(values))
            else:
                setattr(total, field, next((v for v in values if v), values[0]))
        total.kv_cache_usage = ((total.num_kv_blocks - total.num_free_blocks) / total.num_kv_blocks
                                if total.num_kv_blocks else 0.0)
        total.block_size = self.block_size
        total.enable_prefix_caching = known[0].enable_prefix_caching
        total.workers_live = any(s.workers_live for s in known)
        return total

    def member_stats(self) -> list[SchedulerStats]:
        return [m.stats or SchedulerStats() for m in self.members]

    def _forget_finished(self, m: _Member, msg: EngineOutputs) -> None:
        for u in msg.updates:
            if u.finish_reason is not None:
                m.rids.discard(u.req_id)
                self.owner.pop(u.req_id, None)

    def _check_members(self, out: list[SchedulerToFrontend] | None = None) -> None:
        now = time.monotonic()
        if now - self._checked < DEAD_CHECK_INTERVAL or self.whole_restart:
            return  # a whole restart is the supervisor's to watch
        self._checked = now
        for m in self.members:
            if m.down:
                continue
            why = m.client.dead()
            if why is None and m.client.restarting and now - m.client.restarted_at > self.startup_timeout:
                why = f"the restarted engine was not ready within {self.startup_timeout:g}s"
            if why:
                self._lost(m, why, out if out is not None else [])

    def _lost(self, m: _Member, reason: str, out: list[SchedulerToFrontend]) -> None:
        """Engine `m` died: its samples go to the engines still serving; it is restarted (within
        MAX_ENGINE_RESTARTS per RESTART_WINDOW, and not while the server drains)."""
        if m.down or self.whole_restart:
            return
        m.stats = None
        lost = set(m.rids)
        m.rids.clear()
        for rid in lost:
            self.owner.pop(rid, None)
        now = time.monotonic()
        while m.restarts and now - m.restarts[0] > RESTART_WINDOW:
            m.restarts.popleft()
        m.down = self.procs.holding or len(m.restarts) >= MAX_ENGINE_RESTARTS
        if all(x.down for x in self.members):
            log.error("engine %d died (%s): no engine of the group serves", m.rank, reason)
            out.append(EngineDead(reason))  # the supervisor restarts the whole group (or gives up)
            return
        log.warning("engine %d died (%s); %d sample(s) go to the other engines%s", m.rank, reason, len(lost),
                    "" if m.down else "; restarting it")
        if not m.down:
            m.restarts.append(now)
            m.client.restart()
        if lost and self.resubmit is not None:
            self.resubmit(lost)  # to an engine that serves, or `pending` until one does

    def _rejoined(self, m: _Member, ready: EngineReady, out: list[SchedulerToFrontend]) -> None:
        m.client.on_ready(ready)
        if self.whole_restart:
            out.append(ready)  # the supervisor ends the group's restart and resubmits everything
            return
        log.warning("engine %d is ready again", m.rank)
        pending, self.pending = self.pending, []
        for req in pending:
            self.add(req)


class _GroupProcs:
    """What the supervisor asks of a launcher, over every engine's."""

    def __init__(self, group: EngineGroup) -> None:
        self.group = group
        self.holding = False

    def hold_restarts(self) -> None:
        self.holding = True
        for m in self.group.members:
            if m.client.procs is not None:
                m.client.procs.hold_restarts()

    def scheduler_signalled(self) -> bool:
        return any(m.client.procs is not None and m.client.procs.scheduler_signalled() for m in self.group.members)

    def worker_down(self) -> str | None:
        for m in self.group.members:
            if m.client.procs is not None and (why := m.client.procs.worker_down()):
                return f"engine {m.rank}: {why}"
        return None

"""Stored responses (`store: true`): what GET, DELETE, `/cancel` and `previous_response_id`
read. In memory, bounded in entries and bytes overall and per owner, each entry kept for
a TTL from its creation.

The owner is the API key the request presented (a digest of it; "" without one): a key
never sees, continues, cancels or deletes another key's responses, and a key that fills
its own share evicts only its own oldest entries. Past the overall bounds the oldest
entries of anyone go first, so a flood of keys costs memory only up to the bounds.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from noria.frontend.bridge.responses_schema import Response

TTL = 3600.0  # s a stored response is kept
MAX_ENTRIES = 10_000
MAX_BYTES = 256 << 20  # about: the encoded response and its conversation
OWNER_ENTRIES = 2_000
OWNER_BYTES = 64 << 20


def owner_of(authorization: str) -> str:
    """The store's owner for a request's `Authorization` header."""
    token = authorization[7:] if authorization.startswith("Bearer ") else ""
    return hashlib.sha256(token.encode()).hexdigest() if token else ""


@dataclass
class Stored:
    response: Response
    # The chat messages a continuation starts from (this response's output included);
    # None until the response has finished.
    conversation: list[dict[str, Any]] | None = None
    task: asyncio.Task[None] | None = None  # a background response still running
    owner: str = ""
    expires: float = 0.0
    size: int = 0


def _size(s: Stored) -> int:
    size = len(msgspec.json.encode(s.response))
    if s.conversation:
        size += len(msgspec.json.encode(s.conversation))
    return size


class ResponseStore:
    def __init__(self, ttl: float = TTL, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES,
                 owner_entries: int = OWNER_ENTRIES, owner_bytes: int = OWNER_BYTES) -> None:
        self.ttl, self.max_entries, self.max_bytes = ttl, max_entries, max_bytes
        self.owner_entries, self.owner_bytes = owner_entries, owner_bytes
        self._all: OrderedDict[str, Stored] = OrderedDict()  # by creation: oldest (first to expire) first
        self._owned: dict[str, OrderedDict[str, Stored]] = {}
        self._owner_size: dict[str, int] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._all)

    def put(self, owner: str, stored: Stored) -> None:
        """Store (or, for an id already there, update) a response."""
        rid = stored.response.id
        old = self._all.get(rid)
        if old is not None and old.owner != owner:
            return  # ids are random: never one of another owner's
        now = time.monotonic()
        stored.owner = owner
        stored.expires = old.expires if old is not None else now + self.ttl
        stored.size = _size(stored)
        if old is not None:
            self._drop(rid)
        self._insert(rid, stored)
        self._expire(now)
        mine = self._owned.get(owner, OrderedDict())  # none left: expired the moment it came (ttl 0)
        while len(mine) > 1 and (len(mine) > self.owner_entries or self._owner_size[owner] > self.owner_bytes):
            self._evict(next(iter(mine)))
        while len(self._all) > 1 and (len(self._all) > self.max_entries or self.bytes > self.max_bytes):
            self._evict(next(iter(self._all)))

    def _insert(self, rid: str, stored: Stored) -> None:
        self._all[rid] = stored  # an update keeps its place (its expiry does not move)
        self._owned.setdefault(stored.owner, OrderedDict())[rid] = stored
        self._owner_size[stored.owner] = self._owner_size.get(stored.owner, 0) + stored.size
        self.bytes += stored.size

    def get(self, owner: str, rid: str) -> Stored | None:
        stored = self._all.get(rid)
        if stored is None or stored.owner != owner:
            return None
        if stored.expires <= time.monotonic():
            self._evict(rid)
            return None
        return stored

    def delete(self, owner: str, rid: str) -> Stored | None:
        stored = self.get(owner, rid)
        if stored is not None:
            self._evict(rid)
        return stored

    def _expire(self, now: float) -> None:
        while self._all:
            rid, stored = next(iter(self._all.items()))
            if stored.expires > now:
                return
            self._evict(rid)

    def _drop(self, rid: str) -> Stored | None:
        """Forget an entry's accounting (it may stay in `_all`, for an update in place)."""
        stored = self._all.get(rid)
        if stored is None:
            return None
        mine = self._owned.get(stored.owner)
        if mine is not None and mine.pop(rid, None) is not None:
            self._owner_size[stored.owner] -= stored.size
            self.bytes -= stored.size
            if not mine:
                del self._owned[stored.owner], self._owner_size[stored.owner]
        return stored

    def _evict(self, rid: str) -> None:
        stored = self._drop(rid)
        self._all.pop(rid, None)
        if stored is not None and stored.task is not None and not stored.task.done():
            stored.task.cancel()  # an evicted background response has nobody left to read it

    def running(self) -> list[asyncio.Task[None]]:
        return [s.task for s in self._all.values() if s.task is not None and not s.task.done()]

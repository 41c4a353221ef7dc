"""What one client of the bridge may hold, and what a slow reader may cost it.

The bridge reaches the engine through one ZMQ connection for all its clients, so
the engine's per-connection cap cannot tell them apart; the bridge says it relays
(hello `relay`) and applies the cap per client itself, here. A client is an
address: its HTTP requests and websockets share one budget, counted in sequences
(prompts x n), the unit the engine spends.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from noria.protocol.client import Delta
from noria.protocol.errors import ErrorCode

# Defaults of the bridge's flags (frontend/cli_args.py, docs/protocol.md "Limits").
DEFAULT_STREAM_BUFFER = 4 << 20  # bytes of output a stream may hold for a client that does not read
DEFAULT_HEADER_TIMEOUT = 30.0  # s to send a request's head, from connecting or from the previous response
DEFAULT_BODY_TIMEOUT = 60.0  # s to send a request's body once its head has come
DEFAULT_MAX_CONNECTIONS = 4096  # open HTTP and websocket connections
# s an SSE write may wait for a client that takes none of it (a websocket's heartbeat, 30 s,
# finds such a client on its own).
STREAM_STALL = 60.0


@dataclass(frozen=True)
class BridgeLimits:
    """The bridge's own caps; 0 (or 0.0): none."""

    per_client: int = 0  # sequences (prompts x n) in flight per client address
    stream_buffer: int = DEFAULT_STREAM_BUFFER
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS


def delta_bytes(d: Delta) -> int:
    """About what a delta costs the bridge while it waits to be sent: a bound that grows with
    its text, tokens and logprobs (exact sizes depend on how it is encoded)."""
    size = 64 + len(d.text) + 8 * len(d.token_ids)
    for lps in (d.logprobs, d.prompt_logprobs):
        if lps:
            top = next((len(lp.top_token_ids) for lp in lps if lp is not None), 0)
            size += len(lps) * (48 + 16 * top)
    return size


class ClientBudgets:
    """Sequences in flight per client address; `limit` 0: no cap."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used: Counter[str] = Counter()

    def take(self, who: str, cost: int) -> None:
        """Count `cost` sequences for `who`, or raise BadRequest (429 `overloaded` while the
        client holds too many; 400 when this request alone is over the cap)."""
        limit = self.limit
        if limit:
            # Here, not at the top: the CLI's parser reads this module's defaults without aiohttp.
            from noria.frontend.bridge.errors import BadRequest

            if cost > limit:
                raise BadRequest(f"this request asks for {cost} sequences (prompts x n), more than the {limit} one "
                                 "client may have in flight", "n")
            held = self.used[who]
            if held + cost > limit:
                raise BadRequest(f"per-client limit: {who} already has {held} of its {limit} sequences (prompts x n) "
                                 f"in flight and this request asks for {cost} more; retry later", status=429,
                                 code=ErrorCode.OVERLOADED)
        self.used[who] += cost

    def give(self, who: str, cost: int) -> None:
        left = self.used[who] - cost
        if left > 0:
            self.used[who] = left
        else:
            del self.used[who]

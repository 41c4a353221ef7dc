"""Answers to the client messages that start no request: `hello` (`Ready`), `stats`, and
`tokenize` / `detokenize`, which the frontend's tokenizer answers without the engine.

None of them waits on the engine, so the I/O loop answers them at once; a `tokenize` that
is large or brings its own chat template is answered on the server's helper thread, and
`TokenAnswers` holds it until it is done.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future

from noria.frontend.core import FrontendCore
from noria.frontend.processor import InputProcessor
from noria.protocol import PROTOCOL_VERSION
from noria.protocol.client import (
    Detokenize,
    Detokenized,
    Error,
    Ready,
    SchedulerStats,
    Stats,
    Tokenize,
    Tokenized,
)
from noria.protocol.errors import ErrorCode, NoriaError

log = logging.getLogger("noria.frontend")

MAX_RELAYS = 1024  # connections known for relays (hello `relay`), the latest ones

TokenAnswer = Tokenized | Detokenized | Error


def ready(core: FrontendCore, model_name: str) -> Ready:
    """The answer to `hello`."""
    engine = core.engine.ready
    return Ready(protocol_version=PROTOCOL_VERSION, model=model_name,
                 max_model_len=engine.max_model_len, vocab_size=engine.vocab_size)


def mark_relay(relays: dict[Hashable, None], identity: Hashable) -> None:
    """Note a connection that said in its `hello` that it relays many clients."""
    relays.pop(identity, None)
    relays[identity] = None
    if len(relays) > MAX_RELAYS:
        # A ROUTER is not told of a peer that left, so the identities of relays that
        # reconnected stay behind: the oldest go. A relay says so in every heartbeat,
        # so one still there is back within a second.
        del relays[next(iter(relays))]


def stats(core: FrontendCore, status: tuple[str, str], restarts: int) -> Stats:
    """The answer to `stats`: the latest published stats at once; asking makes the next ones fresh.
    `status`: the server's ("ok" | "draining" | "restarting", why)."""
    core.engine.query_stats()
    # Before the scheduler's first report nothing says a worker serves: /health must not
    # answer 200 from defaults (a server with no worker did, for a moment after start).
    latest = core.stats or SchedulerStats(workers_live=False, worker_status="the scheduler has not reported yet")
    member_stats = getattr(core.engine, "member_stats", None)  # an EngineGroup's engines
    return Stats(stats=latest, num_open_requests=core.num_open, status=status[0], reason=status[1],
                 scheduler_restarts=restarts, engines=member_stats() if member_stats is not None else [],
                 data_parallel_rank=core.data_parallel_rank)


def token_answer(processor: InputProcessor, msg: Tokenize | Detokenize) -> TokenAnswer:
    """The answer to a `tokenize` or `detokenize` (reads the processor only: any thread)."""
    try:
        return processor.tokenize_request(msg) if isinstance(msg, Tokenize) else processor.detokenize(msg)
    except NoriaError as e:
        return Error(request_id=msg.request_id, code=e.code, message=e.message, param=e.param)
    except Exception as e:  # a bug must cost one request, not the server
        log.exception("internal error on a %s message", type(msg).__name__.lower())
        return Error(request_id=msg.request_id, code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}"[:500])


class TokenAnswers:
    """`tokenize` / `detokenize` answers being made on the helper thread; each goes out when
    it is done, in any order (they start nothing, so there is no order to keep)."""

    def __init__(self) -> None:
        self.pending: deque[tuple[bytes, Future[TokenAnswer]]] = deque()

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add(self, identity: bytes, future: Future[TokenAnswer]) -> None:
        self.pending.append((identity, future))

    def send_done(self, sink: Callable[[bytes], Callable[[TokenAnswer], None]]) -> None:
        """Send the finished answers through `sink(identity)`; keep the others."""
        left: deque[tuple[bytes, Future[TokenAnswer]]] = deque()
        for identity, future in self.pending:
            if future.done():
                if not future.cancelled():
                    sink(identity)(future.result())
            else:
                left.append((identity, future))
        self.pending = left

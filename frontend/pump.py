"""The one loop body that moves engine outputs into a FrontendCore (ZMQ server and offline LLM)."""

from __future__ import annotations

from noria.frontend.core import FrontendCore
from noria.protocol.engine import EngineDead, EngineOutputs


def pump_engine(core: FrontendCore, timeout_ms: int) -> str | None:
    """Apply everything the engine has sent, waiting up to `timeout_ms` for the first message.

    Returns why the engine died once it has (an `EngineDead` message, or no
    message and a dead process); every open request has then failed with
    `engine_dead`, and so will every new one.
    """
    engine = core.engine
    msgs = engine.recv(timeout_ms)
    for msg in msgs:
        if isinstance(msg, EngineOutputs):
            core.on_outputs(msg)
        elif isinstance(msg, EngineDead):
            return _died(core, msg.reason)
    if not msgs:
        # Only checked when idle: a busy engine is evidently alive.
        dead = engine.dead()
        if dead:
            return _died(core, dead)
    return None


def _died(core: FrontendCore, reason: str) -> str:
    core.fail_all(f"engine died: {reason}")
    return reason

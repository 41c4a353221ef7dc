"""What every tool-call parser is: one per sample, fed the sample's text as it grows."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from noria.protocol.client import ToolCall, ToolCallDelta


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolParser:
    """Splits a sample's text into content and tool calls, incrementally: `feed(text,
    final)` takes the next piece of text (`final`: the sample has ended) and returns the
    content that is surely not part of a call, and the call pieces (OpenAI's streamed
    shape). Text that may still turn out to be part of a call is held back until it is
    known. Feeding the whole text at once gives the same content and calls as feeding it
    in any pieces (tests/test_tool_parsers.py)."""

    # The parser reads special tokens the detokenizer would otherwise drop ([TOOL_CALLS]).
    needs_special_tokens = False

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self.new_id = new_id
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

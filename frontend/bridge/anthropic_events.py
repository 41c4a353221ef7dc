"""Upstream deltas → an Anthropic message, whole or as its stream of events.

A sample's output comes as reasoning, content and tool-call pieces (frontend/chat_output.py);
each run of one kind is one content block, in the order the model wrote them: `thinking`,
`text`, `tool_use` (one per call). The whole message and the stream cut the blocks in the
same place. Text that is only white space is held until something else follows it: before
a tool call it is dropped (as the chat endpoint's content is null then), before more text
it is kept.
"""

from __future__ import annotations

import json

import msgspec

from noria.frontend.bridge.anthropic_schema import (
    Block,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ErrorDetail,
    ErrorEvent,
    Event,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
    StopInfo,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    Usage,
)
from noria.protocol.client import Delta, Done

_encode = msgspec.json.Encoder().encode
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def sse(event: Event) -> bytes:
    """One server-sent event, named by its type as Anthropic names them."""
    tag = type(event).__struct_config__.tag
    return b"event: %s\ndata: %s\n\n" % (str(tag).encode(), _encode(event))


def error_event(kind: str, message: str) -> bytes:
    return sse(ErrorEvent(error=ErrorDetail(type=kind, message=message)))


def tool_use_id(call_id: str) -> str:
    """Anthropic's spelling of the frontend's call id ("call_..." → "toolu_...")."""
    return "toolu_" + call_id.removeprefix("call_")


class _Open:
    """The block being written: its kind, its call's index for tool_use, and (for a whole
    message) what it holds so far."""

    __slots__ = ("kind", "call", "parts", "id", "name")

    def __init__(self, kind: str, call: int | None = None, id: str = "", name: str = "") -> None:
        self.kind, self.call, self.id, self.name = kind, call, id, name
        self.parts: list[str] = []

    def block(self) -> Block:
        text = "".join(self.parts)
        if self.kind == "thinking":
            return ThinkingBlock(thinking=text)
        if self.kind == "text":
            return TextBlock(text=text)
        try:
            args = json.loads(text) if text.strip() else {}
        except (ValueError, RecursionError):
            args = None
        # A call's arguments are an object under tool_choice any / tool (the grammar holds them
        # to the schema); a parser's call whose text is not one keeps it under `_raw`.
        return ToolUseBlock(id=self.id, name=self.name, input=args if isinstance(args, dict) else {"_raw": text})


class MessageBuilder:
    """`stream`: `start`, `add` and `end` give the events' bytes and the builder keeps none of
    the text; otherwise `response` gives the whole message at the end."""

    def __init__(self, mid: str, model: str, stream: bool) -> None:
        self.mid, self.model, self.stream = mid, model, stream
        self.blocks: list[Block] = []
        self.count = 0  # blocks opened so far: the next one's index
        self.open: _Open | None = None
        self.space = ""  # white space held back (see the module's doc)
        self.called = False
        self.done: Done | None = None

    def start(self) -> list[bytes]:
        head = Message(id=self.mid, model=self.model, content=[], usage=Usage(input_tokens=0, output_tokens=0))
        return [sse(MessageStart(message=head))]

    def add(self, ev: Delta | Done) -> list[bytes]:
        if isinstance(ev, Done):
            self.done = ev
            return []
        out: list[bytes] = []
        if ev.reasoning_content:
            out += self._piece("thinking", None, ev.reasoning_content)
        # A delta's text may come before its calls or after the end of the call being written.
        calls_first = self.open is not None and self.open.kind == "tool_use"
        if ev.text and not calls_first:
            out += self._text(ev.text)
        out += self._calls(ev)
        if ev.text and calls_first:
            out += self._text(ev.text)
        return out

    def _calls(self, ev: Delta) -> list[bytes]:
        out: list[bytes] = []
        for tc in ev.tool_calls or ():
            if tc.id is not None:
                self.called, self.space = True, ""
                name = tc.function.name if tc.function is not None and tc.function.name else ""
                out += self._close()
                self.open = _Open("tool_use", tc.index, tool_use_id(tc.id), name)
                out += self._start(ToolUseBlock(id=self.open.id, name=name, input={}))
            args = tc.function.arguments if tc.function is not None else None
            if args:
                out += self._piece("tool_use", tc.index, args)
        return out

    def _text(self, text: str) -> list[bytes]:
        if self.open is None or self.open.kind != "text":
            if not (self.space + text).strip():
                self.space += text
                return []
            text, self.space = self.space + text, ""
        return self._piece("text", None, text)

    def _piece(self, kind: str, call: int | None, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open.kind != kind or self.open.call != call:
            out += self._close()
            self.open = _Open(kind, call)
            out += self._start(TextBlock(text="") if kind == "text" else ThinkingBlock(thinking=""))
        if not self.stream:
            self.open.parts.append(text)
            return out
        index = self.count - 1
        if kind == "text":
            return out + [sse(ContentBlockDelta(index=index, delta=TextDelta(text=text)))]
        if kind == "thinking":
            return out + [sse(ContentBlockDelta(index=index, delta=ThinkingDelta(thinking=text)))]
        return out + [sse(ContentBlockDelta(index=index, delta=InputJsonDelta(partial_json=text)))]

    def _start(self, block: Block) -> list[bytes]:
        self.count += 1
        return [sse(ContentBlockStart(index=self.count - 1, content_block=block))] if self.stream else []

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        opened, self.open = self.open, None
        if not self.stream:
            self.blocks.append(opened.block())
            return []
        return [sse(ContentBlockStop(index=self.count - 1))]

    def _finish(self) -> list[bytes]:
        """Close the last block; white space still held is the answer's only text, or dropped."""
        out: list[bytes] = []
        if self.space and not self.called and self.count == 0:
            out += self._piece("text", None, self.space)
        self.space = ""
        return out + self._close()

    def _stop(self) -> tuple[StopInfo, Usage]:
        done = self.done
        assert done is not None, "the stream ended without its done"
        reason = _STOP_REASONS.get(done.finish_reason, "end_turn")
        stops = done.stop_strings or [None]
        sequence = stops[0]
        if sequence is not None and done.finish_reason == "stop":
            reason = "stop_sequence"
        u = done.usage
        usage = Usage(input_tokens=u.prompt_tokens - u.cached_tokens, output_tokens=u.completion_tokens,
                      cache_read_input_tokens=u.cached_tokens)
        return StopInfo(stop_reason=reason, stop_sequence=sequence if reason == "stop_sequence" else None), usage

    def end(self) -> list[bytes]:
        out = self._finish()
        info, usage = self._stop()
        return out + [sse(MessageDelta(delta=info, usage=usage)), sse(MessageStop())]

    def response(self) -> Message:
        self._finish()
        info, usage = self._stop()
        return Message(id=self.mid, model=self.model, content=self.blocks, stop_reason=info.stop_reason,
                       stop_sequence=info.stop_sequence, usage=usage)

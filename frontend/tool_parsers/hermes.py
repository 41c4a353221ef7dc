"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of
them, with content around them (Qwen2.5, Qwen3, Hermes 2/3)."""

from __future__ import annotations

from noria.frontend.tool_parsers.base import ToolParser
from noria.frontend.tool_parsers.json_scan import CallStreamer, split_at_tag
from noria.protocol.client import ToolCallDelta

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.buf = ""
        self.call: CallStreamer | None = None  # inside <tool_call> ... </tool_call>
        self.raw = ""  # the open call's text, content again if it names no function

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        content: list[str] = []
        out: list[ToolCallDelta] = []
        while True:
            buf = self.buf
            if self.call is None:
                before, self.buf, found = split_at_tag(buf, START, final)
                content.append(before)
                if not found:
                    break
                self.call = CallStreamer(len(self.calls), self.new_id)
                self.raw = ""
                continue
            body, self.buf, closed = split_at_tag(buf, END, final)
            self.raw += body
            out += self.call.feed(body)
            if not (closed or final):
                break
            out += self.call.finish()
            call = self.call.call()
            if call is None:  # it named no function: its text is content
                content.append(START + self.raw + (END if closed else ""))
            else:
                self.calls.append(call)
            self.call = None
            if not closed:
                content.append(self.buf)
                self.buf = ""
                break
        return "".join(content), out

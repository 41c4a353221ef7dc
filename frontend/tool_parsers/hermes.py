"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of
them, with content around them (Qwen2.5, Qwen3, Hermes 2/3)."""

from __future__ import annotations

from noria.frontend.tool_parsers.base import ToolParser
from noria.frontend.tool_parsers.json_scan import CallStreamer, partial_suffix
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
                k = buf.find(START)
                if k >= 0:
                    content.append(buf[:k])
                    self.buf = buf[k + len(START):]
                    self.call = CallStreamer(len(self.calls), self.new_id)
                    self.raw = ""
                    continue
                hold = 0 if final else partial_suffix(buf, START)
                content.append(buf[:len(buf) - hold])
                self.buf = buf[len(buf) - hold:]
                break
            k = buf.find(END)
            closed = k >= 0
            if closed:
                body, self.buf = buf[:k], buf[k + len(END):]
            else:
                hold = 0 if final else partial_suffix(buf, END)
                body, self.buf = buf[:len(buf) - hold], buf[len(buf) - hold:]
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

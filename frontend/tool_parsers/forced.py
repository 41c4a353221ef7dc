"""tool_choice "required" and a named function: the grammar (frontend/tools.py) makes the
output a JSON array of `{"name", "arguments"}` calls, or the named function's arguments
object, and these read it back as tool calls, piece by piece."""

from __future__ import annotations

from noria.frontend.tool_parsers.base import ToolParser
from noria.frontend.tool_parsers.json_scan import CallSequence
from noria.protocol.client import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta


class RequiredParser(ToolParser):
    """The output is `[{"name": ..., "arguments": {...}}, ...]`."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.seq = CallSequence(self.new_id, open="[", sep=",", close="]", args_keys=("arguments",))

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        ended = self.seq.ended
        out = self.seq.feed(text, final) if not ended else []
        self.calls = self.seq.calls
        if ended:
            return text, out
        return (self.seq.failed + self.seq.rest if self.seq.ended else ""), out


class NamedParser(ToolParser):
    """The output is the arguments of the one function named by tool_choice."""

    def __init__(self, name: str, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.name = name
        self.id: str | None = None
        self.args: list[str] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        out: list[ToolCallDelta] = []
        if self.id is None and (text or final):
            self.id = self.new_id()
            out.append(ToolCallDelta(index=0, id=self.id, type="function",
                                     function=FunctionCallDelta(name=self.name, arguments="")))
        if text:
            self.args.append(text)
            out.append(ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text)))
        if final and self.id is not None:
            self.calls = [ToolCall(id=self.id, function=FunctionCall(name=self.name, arguments="".join(self.args)))]
        return "", out

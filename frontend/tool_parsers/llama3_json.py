"""llama3_json: the whole answer is JSON calls, `{"name": ..., "parameters": {...}}`,
several separated by `;`, optionally after `<|python_tag|>` (Llama 3.1/3.2's JSON
tool calling). An answer that does not start with a call is content."""

from __future__ import annotations

from noria.frontend.tool_parsers.base import ToolParser
from noria.frontend.tool_parsers.json_scan import CallSequence
from noria.protocol.client import ToolCallDelta

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.head = ""  # held until it is known whether the answer is calls
        self.seq: CallSequence | None = None
        self.content_mode = False

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        if self.content_mode:
            return text, []
        if self.seq is None:
            self.head += text
            lead = self.head.lstrip()
            if lead.startswith(PYTHON_TAG):
                text = lead[len(PYTHON_TAG):]
            elif lead.startswith("{"):
                text = lead
            elif not final and (not lead or PYTHON_TAG.startswith(lead)):
                return "", []
            else:
                self.content_mode = True
                return self.head, []
            self.seq = CallSequence(self.new_id, sep=";", args_keys=("parameters", "arguments"))
        seq = self.seq
        out = seq.feed(text, final)
        self.calls = seq.calls
        if seq.ended:
            self.content_mode = True  # what follows the calls, or the text that was none
            return seq.failed + seq.rest, out
        return "", out

"""mistral: content, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments":
{...}}` (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo and Small). `[TOOL_CALLS]` is a
special token, so these requests are detokenized with special tokens kept."""

from __future__ import annotations

from noria.frontend.tool_parsers.base import ToolParser
from noria.frontend.tool_parsers.json_scan import CallSequence, partial_suffix
from noria.protocol.client import ToolCallDelta

TAG = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    needs_special_tokens = True

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.buf = ""
        self.seq: CallSequence | None = None
        self.before: list = []  # calls of earlier [TOOL_CALLS] blocks

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        content: list[str] = []
        out: list[ToolCallDelta] = []
        while True:
            if self.seq is None:
                buf = self.buf
                k = buf.find(TAG)
                if k < 0:
                    hold = 0 if final else partial_suffix(buf, TAG)
                    content.append(buf[:len(buf) - hold])
                    self.buf = buf[len(buf) - hold:]
                    break
                content.append(buf[:k])
                after = buf[k + len(TAG):]
                lead = after.lstrip()
                if not lead and not final:
                    self.buf = buf[k:]  # what follows the tag decides
                    break
                self.buf = after
                self.before = list(self.calls)
                if lead.startswith("["):
                    self.seq = CallSequence(self.new_id, open="[", sep=",", close="]", first_index=len(self.calls))
                elif lead.startswith("{"):  # a single call object, as some versions write it
                    self.seq = CallSequence(self.new_id, sep="", first_index=len(self.calls))
                else:
                    content.append(TAG)
                continue
            seq = self.seq
            piece, self.buf = self.buf, ""
            out += seq.feed(piece, final)
            self.calls = self.before + seq.calls
            if not seq.ended:
                break
            content.append(seq.failed)  # an object that names no function stays content
            self.buf, self.seq = seq.rest, None
            if not self.buf:
                break
        return "".join(content), out

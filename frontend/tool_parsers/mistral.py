"""mistral: content, then the calls in either of Mistral's two formats (vLLM's parser reads
both). Before tokenizer v11 (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo and Small):
`[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`. From v11 (Mistral
Small 3.2, Magistral, Devstral): each call is `[TOOL_CALLS]name[ARGS]{...}`, the arguments
running to the next `[TOOL_CALLS]` or the end (a tokenizer that drops `[ARGS]` leaves
`name{...}`, read the same). `[TOOL_CALLS]` and `[ARGS]` are special tokens, so these
requests are detokenized with special tokens kept."""

from __future__ import annotations

import re

from noria.frontend.tool_parsers.base import ToolParser
from noria.frontend.tool_parsers.json_scan import CallSequence, partial_suffix
from noria.protocol.client import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta

TAG = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.:-]*")
_WS = " \t\r\n"


class MistralParser(ToolParser):
    needs_special_tokens = True

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.buf = ""
        self.seq: CallSequence | None = None
        self.before: list = []  # calls of earlier [TOOL_CALLS] blocks
        self.naming = False  # v11: after [TOOL_CALLS], reading a name
        self.open: ToolCall | None = None  # v11: the call whose arguments are being written
        self.args_raw = ""  # its arguments' text as written (sent: `open.function.arguments`)

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        content: list[str] = []
        out: list[ToolCallDelta] = []
        while True:
            if self.open is not None:
                if not self._arguments(out, final):
                    break
                continue
            if self.naming:
                if not self._name(content, out, final):
                    break
                continue
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
                elif _NAME.match(after).end() > 0:  # v11: a name right after the tag
                    self.naming = True
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

    def _name(self, content: list[str], out: list[ToolCallDelta], final: bool) -> bool:
        """v11: the name after [TOOL_CALLS], complete at [ARGS] or `{`. False: wait for more."""
        buf = self.buf
        end = _NAME.match(buf).end()
        name, rest = buf[:end], buf[end:]
        if rest.startswith(ARGS) or rest.startswith("{"):
            self.naming = False
            self.buf = rest[len(ARGS):] if rest.startswith(ARGS) else rest
            self.open = ToolCall(id=self.new_id(), function=FunctionCall(name=name, arguments=""))
            self.args_raw = ""
            out.append(ToolCallDelta(index=len(self.calls), id=self.open.id, type="function",
                                     function=FunctionCallDelta(name=name, arguments="")))
            return True
        if not final and ARGS.startswith(rest):  # the name may go on, or [ARGS] is coming
            return False
        self.naming = False  # not a call: the tag and the word are content
        content.append(TAG + name)
        self.buf = rest
        return True

    def _arguments(self, out: list[ToolCallDelta], final: bool) -> bool:
        """v11: the open call's arguments, sent as they grow, without the whitespace around
        them; they end at the next [TOOL_CALLS] or with the output. False: wait for more."""
        call = self.open
        assert call is not None
        k = self.buf.find(TAG)
        ends = k >= 0 or final
        if k >= 0:
            self.args_raw += self.buf[:k]
            self.buf = self.buf[k:]
        else:
            hold = 0 if final else partial_suffix(self.buf, TAG)
            self.args_raw += self.buf[:len(self.buf) - hold]
            self.buf = self.buf[len(self.buf) - hold:]
        sendable = self.args_raw.strip(_WS)  # trailing whitespace waits: more may follow it
        if ends and not sendable:
            sendable = "{}"  # a call without arguments, as the JSON formats give it
        piece = sendable[len(call.function.arguments):]
        if piece:
            call.function.arguments += piece
            out.append(ToolCallDelta(index=len(self.calls), function=FunctionCallDelta(arguments=piece)))
        if not ends:
            return False
        self.calls.append(call)
        self.open = None
        return bool(self.buf)

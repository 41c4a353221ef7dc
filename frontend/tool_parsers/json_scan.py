"""Incremental reading of tool calls written as JSON objects, for every parser.

A model writes a call as an object such as `{"name": "f", "arguments": {...}}`, a few
characters per step. `ObjectScanner` follows one object as its text grows and records
where each top-level member's value starts and ends, in time linear in the text however
it is split; `CallStreamer` turns that into OpenAI's call pieces: the call's id and name
once the name is complete, then the arguments' text as it grows (the raw text the model
wrote, so the pieces join into exactly the `arguments` of the whole call). `CallSequence`
reads several such objects: a JSON array (`[{...}, {...}]`, mistral and tool_choice
"required") or objects separated by `;` (llama3_json).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from noria.protocol.client import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta

_WS = " \t\r\n"
# ObjectScanner states
_BEFORE, _KEY_OR_END, _KEY_NEXT, _KEY, _COLON, _VALUE, _IN_VALUE, _AFTER, _DONE, _BAD = range(10)


class ObjectScanner:
    """One JSON object's top-level members as its text grows: `members` holds
    [key, value start, value end (None while open)]; `end` is the index after the closing
    brace (-1 before it); `bad` once the text cannot be an object. Text after the
    object is kept (`rest()`) but not read."""

    __slots__ = ("text", "pos", "state", "members", "end", "_key_start", "_depth", "_in_str", "_esc", "_kind")

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.state = _BEFORE
        self.members: list[list] = []
        self.end = -1
        self._key_start = 0
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._kind = ""  # the open value: "s" string, "c" object or array, "x" number or literal

    @property
    def done(self) -> bool:
        return self.state == _DONE

    @property
    def bad(self) -> bool:
        return self.state == _BAD

    def rest(self) -> str:
        """The text after the object (empty until it closes)."""
        return self.text[self.end:] if self.end >= 0 else ""

    def feed(self, more: str) -> None:
        self.text += more
        t, i, n, st = self.text, self.pos, len(self.text), self.state
        while i < n and st != _DONE and st != _BAD:
            c = t[i]
            if st == _KEY or (st == _IN_VALUE and (self._kind == "s" or self._in_str)):
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    if st == _KEY:
                        try:
                            key = json.loads(t[self._key_start:i + 1])
                        except ValueError:
                            st = _BAD
                            continue
                        self.members.append([key, -1, None])
                        st = _COLON
                    elif self._kind == "s":
                        self.members[-1][2] = i + 1
                        st = _AFTER
                    else:
                        self._in_str = False
                i += 1
                continue
            if st == _IN_VALUE:
                if self._kind == "c":
                    if c == '"':
                        self._in_str = True
                    elif c in "{[":
                        self._depth += 1
                    elif c in "}]":
                        self._depth -= 1
                        if self._depth == 0:
                            self.members[-1][2] = i + 1
                            st = _AFTER
                    i += 1
                    continue
                if c in ",}" or c in _WS:  # a number or literal ends here
                    self.members[-1][2] = i
                    st = _AFTER
                    continue
                i += 1
                continue
            if c in _WS:
                i += 1
                continue
            if st == _BEFORE:
                st = _KEY_OR_END if c == "{" else _BAD
            elif st in (_KEY_OR_END, _KEY_NEXT):
                if c == '"':
                    self._key_start = i
                    st = _KEY
                elif c == "}" and st == _KEY_OR_END:
                    self.end, st = i + 1, _DONE
                else:
                    st = _BAD
            elif st == _COLON:
                st = _VALUE if c == ":" else _BAD
            elif st == _VALUE:
                self.members[-1][1] = i
                st = _IN_VALUE
                if c == '"':
                    self._kind = "s"
                elif c in "{[":
                    self._kind, self._depth, self._in_str = "c", 1, False
                elif c in "]},:":
                    st = _BAD
                else:
                    self._kind = "x"
            elif st == _AFTER:
                if c == ",":
                    st = _KEY_NEXT
                elif c == "}":
                    self.end, st = i + 1, _DONE
                else:
                    st = _BAD
            i += 1
        self.pos, self.state = i, st

    def member(self, keys: tuple[str, ...]) -> list | None:
        for m in self.members:
            if m[0] in keys and m[1] >= 0:
                return m
        return None


class CallStreamer:
    """One call object: its pieces as its text grows (`feed`), and the whole call."""

    __slots__ = ("index", "new_id", "name_keys", "args_keys", "scan", "id", "name", "args", "finished")

    def __init__(self, index: int, new_id: Callable[[], str], name_keys: tuple[str, ...] = ("name",),
                 args_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self.index = index
        self.new_id = new_id
        self.name_keys, self.args_keys = name_keys, args_keys
        self.scan = ObjectScanner()
        self.id: str | None = None
        self.name: str | None = None
        self.args = ""  # the arguments text sent so far
        self.finished = False

    def feed(self, more: str) -> list[ToolCallDelta]:
        scan = self.scan
        scan.feed(more)
        out: list[ToolCallDelta] = []
        if self.name is None:
            m = scan.member(self.name_keys)
            if m is not None and m[2] is not None:
                try:
                    name = json.loads(scan.text[m[1]:m[2]])
                except ValueError:
                    name = None
                if isinstance(name, str) and name:
                    self.name, self.id = name, self.new_id()
                    out.append(ToolCallDelta(index=self.index, id=self.id, type="function",
                                             function=FunctionCallDelta(name=name, arguments="")))
        if self.name is not None:
            a = scan.member(self.args_keys)
            if a is not None:
                end = a[2] if a[2] is not None else len(scan.text)
                piece = scan.text[a[1] + len(self.args):end]
                if piece:
                    self.args += piece
                    out.append(ToolCallDelta(index=self.index, function=FunctionCallDelta(arguments=piece)))
        return out

    def finish(self) -> list[ToolCallDelta]:
        """The object ended (or the output did): a call with no arguments gets `{}`."""
        if self.finished or self.name is None:
            return []
        self.finished = True
        if self.args or self.scan.member(self.args_keys) is not None:
            return []
        self.args = "{}"
        return [ToolCallDelta(index=self.index, function=FunctionCallDelta(arguments="{}"))]

    def call(self) -> ToolCall | None:
        if self.name is None or self.id is None:
            return None
        return ToolCall(id=self.id, function=FunctionCall(name=self.name, arguments=self.args))


# CallSequence states
_SEQ_OPEN, _SEQ_OBJ, _SEQ_IN, _SEQ_AFTER, _SEQ_END = range(5)


class CallSequence:
    """Call objects one after another: `open` (say "[") first unless empty, `sep` between
    them, `close` (say "]") after them unless empty. Text after the sequence, or from
    where it stops being one, is `rest` (`ended` then). `calls` are the complete calls."""

    def __init__(self, new_id: Callable[[], str], *, open: str = "", sep: str = ",", close: str = "",
                 name_keys: tuple[str, ...] = ("name",), args_keys: tuple[str, ...] = ("arguments", "parameters"),
                 first_index: int = 0) -> None:
        self.new_id = new_id
        self.open, self.sep, self.close = open, sep, close
        self.name_keys, self.args_keys = name_keys, args_keys
        self.state = _SEQ_OPEN if open else _SEQ_OBJ
        self.buf = ""
        self.current: CallStreamer | None = None
        self.calls: list[ToolCall] = []
        self.next_index = first_index
        self.rest = ""
        self.failed = ""  # the raw text of an object that named no function

    @property
    def ended(self) -> bool:
        return self.state == _SEQ_END

    def feed(self, more: str, final: bool = False) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        self.buf += more
        while self.state != _SEQ_END:
            if self.state == _SEQ_IN:
                cur = self.current
                assert cur is not None
                out += cur.feed(self.buf)
                self.buf = ""
                if cur.scan.done or cur.scan.bad or final:
                    out += self._end_call(cur)
                    continue
                break
            stripped = self.buf.lstrip(_WS)
            if not stripped:
                if final:
                    self._stop("")
                break
            c = stripped[0]
            if self.state == _SEQ_OPEN:
                if c == self.open:
                    self.buf, self.state = stripped[1:], _SEQ_OBJ
                else:
                    self._stop(self.buf)
            elif self.state == _SEQ_OBJ:
                if c == "{":
                    self.current = CallStreamer(self.next_index, self.new_id, self.name_keys, self.args_keys)
                    self.buf, self.state = stripped, _SEQ_IN
                elif self.close and c == self.close:
                    self._stop(stripped[1:])
                else:
                    self._stop(self.buf)
            else:  # _SEQ_AFTER
                if c == self.sep:
                    self.buf, self.state = stripped[1:], _SEQ_OBJ
                elif self.close and c == self.close:
                    self._stop(stripped[1:])
                else:
                    self._stop(self.buf)
        return out

    def _end_call(self, cur: CallStreamer) -> list[ToolCallDelta]:
        out = cur.finish()
        call = cur.call()
        self.current = None
        if call is None:  # not a call: it and what follows are no calls
            self.failed = cur.scan.text
            self._stop("")
            return out
        self.calls.append(call)
        self.next_index += 1
        self.buf = cur.scan.rest()
        self.state = _SEQ_AFTER
        return out

    def _stop(self, rest: str) -> None:
        self.rest, self.buf, self.state = rest, "", _SEQ_END


def split_at_tag(buf: str, tag: str, final: bool) -> tuple[str, str, bool]:
    """(the text before `tag`, what stays in the buffer, whether the tag was found). Found,
    the buffer keeps what follows the tag; not found, the end of `buf` that may become the tag
    is held back (nothing when the stream is final)."""
    k = buf.find(tag)
    if k >= 0:
        return buf[:k], buf[k + len(tag):], True
    cut = len(buf) - (0 if final else partial_suffix(buf, tag))
    return buf[:cut], buf[cut:], False


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that `tag` starts with (held back in a
    stream: it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0

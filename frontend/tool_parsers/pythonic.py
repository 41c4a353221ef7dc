"""pythonic: the answer is a Python list of calls with keyword arguments,
`[get_weather(city="Paris", days=[1, 2]), now()]` (Llama 3.2 and 4, ToolACE; vLLM's
`pythonic`). Each argument must be a literal (strings, numbers, True/False/None, lists,
tuples and dicts of them): it is read by `ast.literal_eval`, never run, and the call's
`arguments` are those values as a JSON object. An answer that does not start with `[` and a
name is content; from an element that is no such call on, the text is content too.

Streaming: a call goes out, name and arguments, as soon as its closing parenthesis is
written: the arguments are a rewrite (JSON of Python values), not the model's text, so
they are sent once they are known."""

from __future__ import annotations

import ast
import json
import re

from noria.frontend.tool_parsers.base import ToolParser
from noria.protocol.client import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta

_WS = " \t\r\n"
_IDENT = re.compile(r"[A-Za-z_]\w*")
_OPEN, _CLOSE = "([{", ")]}"
_HEAD, _ELEM, _AFTER, _CONTENT = range(4)


class _CallScan:
    """Finds where a call `name(...)` ends as its text grows: brackets counted outside Python
    string literals (single, double and triple quoted, with escapes), in linear time however
    the text is split. `end` is the index after the closing parenthesis (-1 before)."""

    __slots__ = ("text", "pos", "depth", "quote", "esc", "end")

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.depth = 0
        self.quote = ""  # the open string's closing quote(s)
        self.esc = False
        self.end = -1

    def feed(self, more: str) -> None:
        self.text += more
        t, i, n = self.text, self.pos, len(self.text)
        while i < n and self.end < 0:
            c = t[i]
            if self.quote:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == self.quote[0]:
                    q = len(self.quote)
                    if t.startswith(self.quote, i):
                        self.quote = ""
                        i += q
                        continue
                    if n - i < q:  # perhaps the start of the closing quotes: wait
                        break
                i += 1
                continue
            if c in "'\"":
                if n - i < 3:  # a triple quote or not: the next characters decide
                    break
                self.quote = c * 3 if t.startswith(c * 3, i) else c
                i += len(self.quote)
                continue
            if c in _OPEN:
                self.depth += 1
            elif c in _CLOSE:
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
            i += 1
        self.pos = i


def read_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON) of `text` if it is one call with literal keyword arguments."""
    try:
        node = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:  # **mapping
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        return node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):  # a set, bytes, a complex number, inf
        return None


class PythonicParser(ToolParser):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.state = _HEAD
        self.buf = ""
        self.prefix = ""  # up to and with the `[`: content again if no call follows
        self.elem_ws = ""  # the whitespace before the element being read
        self.scan: _CallScan | None = None

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        if self.state == _CONTENT:
            return text, []
        self.buf += text
        content: list[str] = []
        out: list[ToolCallDelta] = []
        while self.state != _CONTENT:
            buf = self.buf
            lead = buf.lstrip(_WS)
            if self.state == _HEAD:
                if not lead and not final:
                    break
                if not lead.startswith("["):
                    self._to_content(content, buf)
                    break
                self.prefix = buf[:len(buf) - len(lead) + 1]
                self.buf, self.state = lead[1:], _ELEM
            elif self.state == _AFTER:
                if not lead:
                    if final:
                        self._to_content(content, "")
                    break
                if lead[0] == ",":
                    self.buf, self.state = lead[1:], _ELEM
                else:  # "]" ends the list; anything else is content from there
                    self._to_content(content, lead[1:] if lead[0] == "]" else buf)
            elif not self._element(content, out, final):
                break
        return "".join(content), out

    def _element(self, content: list[str], out: list[ToolCallDelta], final: bool) -> bool:
        """Reads the next call of the list. False: wait for more text."""
        if self.scan is None:
            buf = self.buf
            lead = buf.lstrip(_WS)
            if not lead or (not final and _IDENT.fullmatch(lead)):  # the name may go on
                if final:
                    self._fail(content, buf)
                return False
            m = _IDENT.match(lead)
            if m is None or lead[m.end():m.end() + 1] != "(":
                self._fail(content, buf)
                return True
            self.elem_ws = buf[:len(buf) - len(lead)]
            self.scan, self.buf = _CallScan(), lead
        scan = self.scan
        scan.feed(self.buf)
        self.buf = ""
        if scan.end < 0:
            if final:
                self._fail(content, self.elem_ws + scan.text)
            return False
        call = read_call(scan.text[:scan.end])
        if call is None:
            self._fail(content, self.elem_ws + scan.text)
            return True
        name, arguments = call
        index, call_id = len(self.calls), self.new_id()
        out.append(ToolCallDelta(index=index, id=call_id, type="function",
                                 function=FunctionCallDelta(name=name, arguments="")))
        out.append(ToolCallDelta(index=index, function=FunctionCallDelta(arguments=arguments)))
        self.calls.append(ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments)))
        self.buf, self.scan, self.state = scan.text[scan.end:], None, _AFTER
        return True

    def _fail(self, content: list[str], raw: str) -> None:
        """The element is no call: it and everything after it are content (with the `[`
        before it too if no call came first)."""
        self._to_content(content, ("" if self.calls else self.prefix) + raw)

    def _to_content(self, content: list[str], text: str) -> None:
        content.append(text)
        self.buf, self.scan, self.state = "", None, _CONTENT

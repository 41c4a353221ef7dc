"""Reasoning parsers (`--reasoning-parser`, vLLM's names): the text a model writes
between `<think>` and `</think>` goes to `reasoning_content`, the rest is content.

* `deepseek_r1`: everything up to `</think>` is reasoning, with or without an opening
  `<think>` (DeepSeek-R1's template opens it in the prompt); no `</think>` at all: all
  of it is reasoning.
* `qwen3`: reasoning only from a `<think>` the model writes, up to `</think>`; with
  `chat_template_kwargs` `enable_thinking: false` there is none (the request gets no parser).

Incremental like the tool parsers: `feed(text, final)` returns (reasoning, content), holding
back a possible half tag; any split of the text gives the same result.
"""

from __future__ import annotations

from typing import Any

from noria.frontend.tool_parsers.json_scan import split_at_tag

START, END = "<think>", "</think>"
_BEFORE, _REASONING, _CONTENT = range(3)


class ReasoningParser:
    def __init__(self, implicit_start: bool) -> None:
        # implicit_start: the answer begins inside the reasoning (deepseek_r1).
        self.implicit_start = implicit_start
        self.state = _BEFORE
        self.buf = ""
        self.ended = False  # `</think>` has been seen: the content part has begun

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self.buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self.buf
            if self.state == _CONTENT:
                content.append(buf)
                self.buf = ""
                break
            if self.state == _BEFORE:
                if self.implicit_start:
                    lead = buf.lstrip()
                    if lead.startswith(START):
                        self.buf = lead[len(START):]
                    elif not final and START.startswith(lead):
                        break  # maybe an opening tag: wait
                    self.state = _REASONING
                    continue
                before, self.buf, found = split_at_tag(buf, START, final)
                content.append(before)
                if not found:
                    break
                self.state = _REASONING
                continue
            before, self.buf, found = split_at_tag(buf, END, final)
            reasoning.append(before)
            if not found:
                break
            self.state, self.ended = _CONTENT, True
        return "".join(reasoning), "".join(content)


def make_reasoning_parser(name: str | None, template_kwargs: dict[str, Any] | None) -> ReasoningParser | None:
    """The request's parser, or None: no parser configured, or thinking turned off."""
    if name is None:
        return None
    if name == "qwen3":
        if (template_kwargs or {}).get("enable_thinking", True) is False:
            return None
        return ReasoningParser(implicit_start=False)
    if name == "deepseek_r1":
        return ReasoningParser(implicit_start=True)
    raise ValueError(f"unknown reasoning parser {name!r}")

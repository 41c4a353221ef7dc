"""A chat request's upstream deltas → a Response's output items, and (streamed) OpenAI's
typed events: `response.created`, `response.in_progress`, then per item
`response.output_item.added`, its content events (`response.content_part.added`,
`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`, their `.done`s) and `response.output_item.done`,
and last `response.completed` (`response.incomplete` when max_output_tokens ran out,
`response.failed` on an error). Every event carries a `sequence_number`, from 0.

Items come in the order the model wrote them: reasoning, then a message, then function
calls; a message or reasoning item closes when the next item opens, the rest at the end.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from noria.frontend.bridge.chat_translate import ChatOutcome, Piece
from noria.frontend.bridge.responses_schema import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponseError,
    ResponseUsage,
)
from noria.protocol.client import Delta, Done

_encode = msgspec.json.Encoder().encode


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """`response` starts as the Response to announce (status in_progress, no output); `add`
    feeds it upstream events and returns the SSE bytes to send (none unless `stream`)."""

    def __init__(self, response: Response, stream: bool) -> None:
        self.response = response
        self.stream = stream
        self.outcome = ChatOutcome()
        self._seq = 0
        self._open: list[int] = []  # output indexes of items not yet done
        self._message: int | None = None  # the open message (or reasoning) item's index
        self._reasoning: int | None = None
        self._calls: dict[int, int] = {}  # tool-call index -> output index

    # ---- events ---------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> list[bytes]:
        if not self.stream:
            return []
        data = _encode({"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1
        return [b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"]

    def start(self) -> list[bytes]:
        return (self._event("response.created", response=self.response)
                + self._event("response.in_progress", response=self.response))

    def add(self, ev: Delta | Done) -> list[bytes]:
        out: list[bytes] = []
        for piece in self.outcome.add(ev):
            out += self._piece(piece)
        if isinstance(ev, Done):
            out += self._finish()
        return out

    def fail(self, code: str, message: str, param: str | None = None) -> list[bytes]:
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=message, param=param)
        return self._event("response.failed", response=self.response)

    # ---- items ----------------------------------------------------------------------

    def _add_item(self, item: OutputItem) -> tuple[int, list[bytes]]:
        self.response.output.append(item)
        index = len(self.response.output) - 1
        self._open.append(index)
        return index, self._event("response.output_item.added", output_index=index, item=item)

    def _piece(self, p: Piece) -> list[bytes]:
        out: list[bytes] = []
        output = self.response.output
        if p.kind == "reasoning":
            if self._reasoning is None:
                out += self._close_text()
                self._reasoning, events = self._add_item(ReasoningItem(id=new_id("rs"), content=[],
                                                                       status="in_progress"))
                item = output[self._reasoning]
                item.content.append(ReasoningText(text=""))  # type: ignore[union-attr]
                out += events + self._event("response.content_part.added", item_id=item.id, output_index=self._reasoning,
                                            content_index=0, part=ReasoningText(text=""))
            item = output[self._reasoning]
            item.content[0].text += p.text  # type: ignore[union-attr]
            return out + self._event("response.reasoning_text.delta", item_id=item.id, output_index=self._reasoning,
                                     content_index=0, delta=p.text)
        if p.kind == "text":
            if self._message is None:
                out += self._close_reasoning()
                self._message, events = self._add_item(OutputMessage(id=new_id("msg"), content=[],
                                                                     status="in_progress"))
                item = output[self._message]
                item.content.append(OutputText(text=""))  # type: ignore[union-attr]
                out += events + self._event("response.content_part.added", item_id=item.id, output_index=self._message,
                                            content_index=0, part=OutputText(text=""))
            item = output[self._message]
            item.content[0].text += p.text  # type: ignore[union-attr]
            return out + self._event("response.output_text.delta", item_id=item.id, output_index=self._message,
                                     content_index=0, delta=p.text, logprobs=[])
        if p.kind == "call":
            out += self._close_reasoning() + self._close_text()
            index, events = self._add_item(FunctionCallItem(id=new_id("fc"), call_id=p.call_id, name=p.name,
                                                            arguments="", status="in_progress"))
            self._calls[p.index] = index
            return out + events
        index = self._calls.get(p.index)
        if index is None:  # arguments of a call never announced: nothing to attach them to
            return out
        item = output[index]
        item.arguments += p.text  # type: ignore[union-attr]
        return out + self._event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                                 delta=p.text)

    def _close_reasoning(self) -> list[bytes]:
        index, self._reasoning = self._reasoning, None
        return [] if index is None else self._close(index)

    def _close_text(self) -> list[bytes]:
        index, self._message = self._message, None
        return [] if index is None else self._close(index)

    def _close(self, index: int, status: str = "completed") -> list[bytes]:
        if index not in self._open:
            return []
        self._open.remove(index)
        item = self.response.output[index]
        item.status = status
        out: list[bytes] = []
        if isinstance(item, ReasoningItem):
            part = item.content[0]
            out += self._event("response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0,
                               text=part.text)
            out += self._event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                               part=part)
        elif isinstance(item, OutputMessage):
            part = item.content[0]
            out += self._event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                               text=part.text, logprobs=[])
            out += self._event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                               part=part)
        else:
            out += self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                               name=item.name, arguments=item.arguments)
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def _finish(self) -> list[bytes]:
        o, r = self.outcome, self.response
        # The complete calls are the truth: a parser may still have held a call's tail back.
        by_id = {c.id: c for c in o.calls}
        for item in r.output:
            if isinstance(item, FunctionCallItem) and item.call_id in by_id:
                item.arguments = by_id[item.call_id].function.arguments
        out: list[bytes] = []
        if not r.output:  # OpenAI's answer always holds a message, if an empty one
            out += self._piece(Piece("text", ""))
        cut = o.finish_reason == "length"
        for index in list(self._open):
            item = r.output[index]
            out += self._close(index, "incomplete" if cut and isinstance(item, OutputMessage) else "completed")
        r.status = "incomplete" if cut else "completed"
        r.incomplete_details = IncompleteDetails(reason="max_output_tokens") if cut else None
        r.completed_at = int(time.time())
        r.usage = ResponseUsage(
            input_tokens=o.prompt_tokens, output_tokens=o.completion_tokens,
            total_tokens=o.prompt_tokens + o.completion_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=o.cached_tokens),
            output_tokens_details=OutputTokensDetails())
        return out + self._event("response.incomplete" if cut else "response.completed", response=r)

"""One sample's output as its client sees it: engine updates in, `Delta`s out, and the
request's `Done` made from its samples.

Each sample owns an incremental detokenizer (with the request's stop strings) and, when
tools or a reasoning parser are asked for, a `ChatOutput` that splits its text into
content, reasoning and tool calls. Which engine ids belong to which request, and when a
request is over, is the core's business (frontend/core.py); this module only says what
an update means for one sample's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from noria.frontend.chat_output import ChatOutput
from noria.frontend.detokenizer import IncrementalDetokenizer
from noria.frontend.prepare import Prepared
from noria.frontend.token_text import TokenTexts
from noria.protocol.client import Delta, Done, Logprob, Usage
from noria.protocol.engine import RequestUpdate


class Sample:
    __slots__ = ("rid", "index", "detok", "num_tokens", "finish_reason", "stream", "ids", "held_logprobs",
                 "prompt_logprobs", "chat", "drop", "prompt_text")

    def __init__(self, rid: int, index: int, detok: IncrementalDetokenizer, stream: bool) -> None:
        self.rid = rid
        self.index = index
        self.detok = detok
        self.num_tokens = 0
        self.finish_reason: str | None = None
        # Final-only samples detokenize once, when they finish.
        self.stream = stream
        # Every output id so far: a request resubmitted after a scheduler restart goes on from them.
        self.ids: list[int] = []
        self.held_logprobs: list[Logprob] | None = None
        self.prompt_logprobs: list[Logprob | None] | None = None  # until a delta carries them
        # Reasoning and tool calls split out of the text (frontend/chat_output.py), if asked for.
        self.chat: ChatOutput | None = None
        # Ids kept out of the text: EOS, where special tokens are kept for a tool parser.
        self.drop: frozenset[int] | None = None
        # The prompt's text for this sample's first delta (`return_prompt_text`), until it is sent.
        self.prompt_text: str | None = None

    @classmethod
    def start(cls, rid: int, index: int, prepared: Prepared, tokenizer: Any, eos_ids: Sequence[int],
              stream: bool) -> Sample:
        """Sample `index` of a prepared request, named `rid` in the engine."""
        params, chat = prepared.params, prepared.chat
        special = chat is not None and chat.needs_special_tokens
        detok = IncrementalDetokenizer(tokenizer, prepared.prompt_ids, prepared.stop,
                                       params.skip_special_tokens and not special)
        # Stop strings need the text as it grows, so such samples always stream inside.
        sample = cls(rid, index, detok, stream or bool(params.stop))
        sample.prompt_text = prepared.prompt_text
        if chat is not None:
            sample.chat = chat.sample_output()
            if special:
                sample.drop = frozenset(eos_ids)
        return sample

    def text_ids(self, ids: list[int]) -> list[int]:
        return ids if self.drop is None else [t for t in ids if t not in self.drop]

    def split(self, text: str, final: bool) -> dict:
        """The Delta fields of the next `text`: content, reasoning and tool-call pieces."""
        if self.chat is None:
            return {"text": text}
        content, reasoning, calls = self.chat.feed(text, final)
        out: dict = {"text": content}
        if reasoning:
            out["reasoning_content"] = reasoning
        if calls:
            out["tool_calls"] = calls
        return out

    def on_update(self, u: RequestUpdate, request_id: str, prompt_ids: list[int],
                  texts: TokenTexts) -> tuple[Delta | None, str | None, bool]:
        """What the engine's update `u` makes of this sample: the `Delta` for the client (None:
        nothing to say yet), the finish reason if the sample ends here, and whether a stop
        string ended it while the engine still runs it (the engine is then to abort it)."""
        self.num_tokens += len(u.new_token_ids)
        self.ids += u.new_token_ids
        # The engine knows ids only; token texts and bytes come from the tokenizer here.
        if u.logprobs:
            texts.fill_all(u.logprobs)
        if u.prompt_logprobs is not None:
            texts.fill_all(u.prompt_logprobs)
            self.prompt_logprobs = u.prompt_logprobs
        if not self.stream:
            return self._held(u, request_id, prompt_ids, texts), u.finish_reason, False
        self.detok.add(self.text_ids(u.new_token_ids))
        finish, cut = u.finish_reason, False
        if self.detok.stopped:
            cut = finish is None
            finish = "stop"
        parts = self.split(self.detok.take(final=finish is not None), finish is not None)
        delta = None
        if len(parts) > 1 or parts["text"] or u.new_token_ids:
            delta = Delta(request_id=request_id, token_ids=list(u.new_token_ids), index=self.index,
                          logprobs=u.logprobs, prompt_logprobs=self.prompt_logprobs,
                          prompt_tokens=self._prompt_tokens(prompt_ids, texts), prompt_text=self._take_prompt_text(),
                          **parts)
            self.prompt_logprobs = None
        return delta, finish, cut

    def _held(self, u: RequestUpdate, request_id: str, prompt_ids: list[int], texts: TokenTexts) -> Delta | None:
        """A final-only sample: its one delta, all its text and ids, once it finishes."""
        if u.logprobs:
            self.held_logprobs = (self.held_logprobs or []) + u.logprobs
        if u.finish_reason is None:
            return None
        self.detok.add(self.text_ids(self.ids))
        parts = self.split(self.detok.take(final=True), True)
        return Delta(request_id=request_id, token_ids=self.ids, index=self.index, logprobs=self.held_logprobs,
                     prompt_logprobs=self.prompt_logprobs, prompt_tokens=self._prompt_tokens(prompt_ids, texts),
                     prompt_text=self._take_prompt_text(), **parts)

    def _take_prompt_text(self) -> str | UnsetType:
        text, self.prompt_text = self.prompt_text, None
        return UNSET if text is None else text

    def _prompt_tokens(self, prompt_ids: list[int], texts: TokenTexts) -> list[str] | UnsetType:
        """The prompt tokens' texts, beside the prompt logprobs that a delta carries."""
        if self.prompt_logprobs is None:
            return UNSET
        return [texts.entry(t)[0] for t in prompt_ids]

    def finish(self, reason: str) -> None:
        if reason == "stop" and self.chat is not None and self.chat.calls:
            reason = "tool_calls"  # OpenAI's reason for an answer that calls tools
        self.finish_reason = reason


def done_message(request_id: str, prompt_ids: list[int], samples: list[Sample], num_cached_tokens: int) -> Done:
    """A request's final message once its samples are over (those still open count as aborted)."""
    reasons = [s.finish_reason or "abort" for s in samples]
    calls = [s.chat.calls if s.chat is not None else [] for s in samples]
    stops = [s.detok.stop_string for s in samples]
    return Done(
        request_id=request_id,
        finish_reason=reasons[0],
        usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=sum(s.num_tokens for s in samples),
                    cached_tokens=num_cached_tokens),
        finish_reasons=reasons if len(reasons) > 1 else None,
        prompt_token_ids=prompt_ids,
        tool_calls=calls if any(calls) else msgspec.UNSET,
        stop_strings=stops if any(s is not None for s in stops) else msgspec.UNSET,
    )

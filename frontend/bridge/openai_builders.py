"""Turn upstream deltas into OpenAI responses: whole ones, or server-sent-event chunks.

Choice index = prompt index * n + sample index, as OpenAI numbers a batch.
Token strings in logprobs are the texts the frontend put in each `Logprob` (the bridge
has no tokenizer): a token that holds part of a character is "bytes:\\xNN...", and
`bytes` holds its exact bytes. `return_tokens_as_token_ids` (vLLM's) spells them
"token_id:ID" instead, as does a server too old to send the texts.
"""

from __future__ import annotations

import codecs
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from noria.frontend.bridge.openai_schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from noria.protocol.client import Delta, Done, Logprob, ToolCall

_encode = msgspec.json.Encoder().encode


def token_str(token_id: int) -> str:
    return f"token_id:{token_id}"


def _spelled(lp: Logprob, as_ids: bool) -> str:
    return token_str(lp.token_id) if as_ids or lp.token is UNSET else lp.token


def _bytes(lp: Logprob) -> list[int] | None:
    return None if lp.bytes is UNSET else lp.bytes


# JSON has no -inf: a token a grammar forbids (logprob -inf) is given this, as vLLM's and
# OpenAI's servers give it, and not a null that typed clients refuse.
LOGPROB_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _tops(lp: Logprob, as_ids: bool) -> list[tuple[str, float, list[int] | None]]:
    """(text, logprob, bytes) of each top token."""
    n = len(lp.top_token_ids)
    texts = ([token_str(t) for t in lp.top_token_ids] if as_ids or lp.top_tokens is UNSET
             else lp.top_tokens)
    data: list[list[int] | None] = [None] * n if lp.top_bytes is UNSET else list(lp.top_bytes)
    return list(zip(texts, [_value(v) for v in lp.top_logprobs], data, strict=False))


def _bytes_of_text(text: str) -> bytes:
    """A token text's bytes (undoing the "bytes:\\xNN" spelling)."""
    if text.startswith("bytes:\\x"):
        try:
            return bytes(int(h, 16) for h in text[len("bytes:"):].split("\\x")[1:])
        except ValueError:
            pass
    return text.encode("utf-8")


class _TextCursor:
    """Where each token starts in the text that its tokens spell: the characters their
    bytes have completed so far (a token that ends inside a character counts it once
    the character is whole)."""

    __slots__ = ("chars", "decoder")

    def __init__(self) -> None:
        self.chars = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def place(self, data: bytes | None) -> int:
        at = self.chars
        if data:
            self.chars += len(self.decoder.decode(data))
        return at

    def place_logprob(self, lp: Logprob) -> int:
        return self.place(None if lp.bytes is UNSET else bytes(lp.bytes))


class _Choices:
    """What has come so far, per choice and per prompt. `keep` False (a stream): only what
    the chunks still to come need (text offsets, finish reasons, usage), none of the text
    and logprobs already sent."""

    def __init__(self, num_prompts: int, n: int, keep: bool = True) -> None:
        self.n = n
        self.keep = keep
        size = num_prompts * n
        self.texts: list[list[str]] = [[] for _ in range(size)]
        self.lengths = [0] * size
        self.logprobs: list[list[Logprob]] = [[] for _ in range(size)]
        self.offsets: list[list[int]] = [[] for _ in range(size)]
        self.cursors = [_TextCursor() for _ in range(size)]
        self.finish: list[str | None] = [None] * size
        self.reasoning: list[list[str]] = [[] for _ in range(size)]
        self.tool_calls: list[list[ToolCall]] = [[] for _ in range(size)]
        self.prompt_ids: list[list[int]] = [[] for _ in range(num_prompts)]
        self.prompt_logprobs: list[list[Logprob | None] | None] = [None] * num_prompts
        self.prompt_tokens_text: list[list[str] | None] = [None] * num_prompts
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.open_prompts = num_prompts
        self.kv_transfer_params: dict[str, Any] | UnsetType = UNSET  # a producer's answer

    def add_delta(self, prompt: int, d: Delta) -> tuple[int, list[int]]:
        """Record a delta; returns (choice index, where each of its logprobs' tokens starts
        in the text). A server that sends no token bytes: where the delta starts."""
        i = prompt * self.n + d.index
        start = self.lengths[i]
        self.lengths[i] += len(d.text)
        cursor = self.cursors[i]
        offsets = [start if lp.bytes is UNSET else cursor.place_logprob(lp) for lp in d.logprobs or ()]
        if not self.keep:
            return i, offsets
        self.texts[i].append(d.text)
        if d.reasoning_content:
            self.reasoning[i].append(d.reasoning_content)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = d.prompt_logprobs
            if d.prompt_tokens is not UNSET:
                self.prompt_tokens_text[prompt] = d.prompt_tokens
        if d.logprobs:
            self.logprobs[i].extend(d.logprobs)
            self.offsets[i].extend(offsets)
        return i, offsets

    def add_done(self, prompt: int, done: Done) -> list[int]:
        reasons = done.finish_reasons or [done.finish_reason]
        self.open_prompts -= 1
        self.prompt_tokens += done.usage.prompt_tokens
        self.completion_tokens += done.usage.completion_tokens
        self.cached_tokens += done.usage.cached_tokens
        self.kv_transfer_params = done.kv_transfer_params
        first = prompt * self.n
        if self.keep:
            self.prompt_ids[prompt] = done.prompt_token_ids or []
            for k, calls in enumerate((done.tool_calls or [])[: self.n]):
                self.tool_calls[first + k] = calls
        for k, r in enumerate(reasons[: self.n]):
            self.finish[first + k] = r
        return list(range(first, first + min(len(reasons), self.n)))

    def usage(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )


def _top_map(lp: Logprob, as_ids: bool) -> dict[str, float]:
    """OpenAI's completions shape: top tokens keyed by their text, the sampled one too."""
    top = {text: v for text, v, _ in _tops(lp, as_ids)}
    top.setdefault(_spelled(lp, as_ids), _value(lp.logprob))
    return top


def _completion_logprobs(lps: list[Logprob], offsets: list[int], as_ids: bool = False) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=[_spelled(lp, as_ids) for lp in lps],
        token_logprobs=[_value(lp.logprob) for lp in lps],
        top_logprobs=[_top_map(lp, as_ids) for lp in lps],
        text_offset=offsets,
    )


def _echo_logprobs(ids: list[int], lps: list[Logprob | None] | None, texts: list[str] | None, echo: str,
                   as_ids: bool = False) -> CompletionLogprobs:
    """The echoed prompt's part: the first token has no logprob. Each token's text_offset is
    where it starts in the echoed text, counted over the texts of the prompt tokens before
    it; a first token the text does not begin with (a BOS the tokenizer added) takes no
    room. Without the texts (an older server), 0."""
    entries = lps or [None] * len(ids)
    tokens = [token_str(t) for t in ids] if as_ids or texts is None or len(texts) != len(ids) else list(texts)
    if texts is None or len(texts) != len(ids):
        offsets = [0] * len(ids)
    else:
        cursor, head = _TextCursor(), echo.encode()
        offsets = []
        for k, t in enumerate(texts):
            data = _bytes_of_text(t)
            offsets.append(cursor.place(None if k == 0 and not head.startswith(data) else data))
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if lp is None else _value(lp.logprob) for lp in entries],
        top_logprobs=[None if lp is None else _top_map(lp, as_ids) for lp in entries],
        text_offset=offsets,
    )


def _chat_logprobs(lps: list[Logprob], as_ids: bool = False) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=_spelled(lp, as_ids),
            logprob=_value(lp.logprob),
            bytes=_bytes(lp),
            top_logprobs=[TopLogprob(token=text, logprob=v, bytes=data) for text, v, data in _tops(lp, as_ids)],
        )
        for lp in lps
    ])


class _Usage:
    choices: _Choices
    include_usage: bool

    def _usage_if_last(self, i: int, finished: list[int]) -> UsageInfo | None:
        """Usage rides on the stream's very last finish chunk unless the client asked
        for OpenAI's separate usage chunk (`stream_options.include_usage`)."""
        last = not self.include_usage and self.choices.open_prompts == 0 and i == finished[-1]
        return self.choices.usage() if last else None


class CompletionBuilder(_Usage):
    """`echo`: per prompt, the text put before its choices' completions (then with
    `logprobs` the prompt's logprobs come first, not when streaming), None where the
    frontend spells it (a token-id prompt: its first delta's `prompt_text`); `echo_only`
    (max_tokens 0): the echo without the completion."""

    def __init__(self, rid: str, model: str, created: int, num_prompts: int, n: int,
                 *, logprobs: bool, stream: bool, include_usage: bool = False,
                 echo: list[str | None] | None = None, echo_only: bool = False, token_ids: bool = False) -> None:
        """`token_ids`: logprob tokens spelled "token_id:ID" (vLLM's return_tokens_as_token_ids)."""
        self.rid, self.model, self.created = rid, model, created
        self.choices = _Choices(num_prompts, n, keep=not stream)
        self.want_logprobs = logprobs
        self.as_ids = token_ids
        self.stream = stream
        self.include_usage = include_usage
        self.echo, self.echo_only = echo, echo_only
        self.echoed: set[int] = set()

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
        return _encode(Completion(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage))

    def start(self) -> list[bytes]:
        return []

    def add(self, prompt: int, ev: Delta | Done) -> list[bytes]:
        if isinstance(ev, Delta):
            if self.echo is not None and self.echo[prompt] is None and ev.prompt_text is not UNSET:
                self.echo[prompt] = ev.prompt_text
            i, offsets = self.choices.add_delta(prompt, ev)
            if not self.stream:
                return []
            echo = ""
            if self.echo is not None and i not in self.echoed:
                self.echoed.add(i)
                echo = self._echo(prompt)
            if self.echo_only:
                return [self._chunk([CompletionChoice(index=i, text=echo)])] if echo else []
            if not (echo or ev.text or ev.logprobs):
                return []
            base = len(self._echo(prompt))
            lp = (_completion_logprobs(ev.logprobs, [o + base for o in offsets], self.as_ids)
                  if self.want_logprobs and ev.logprobs else None)
            return [self._chunk([CompletionChoice(index=i, text=echo + ev.text, logprobs=lp)])]
        finished = self.choices.add_done(prompt, ev)
        if not self.stream:
            return []
        return [self._chunk([CompletionChoice(index=i, text="", finish_reason=self.choices.finish[i])], self._usage_if_last(i, finished))
                for i in finished]

    def end(self) -> list[bytes]:
        return [self._chunk([], self.choices.usage())] if self.include_usage else []

    def _echo(self, prompt: int) -> str:
        return (self.echo[prompt] or "") if self.echo is not None else ""

    def response(self) -> Completion:
        c = self.choices
        return Completion(id=self.rid, created=self.created, model=self.model, usage=c.usage(),
                          choices=[self._choice(i) for i in range(len(c.texts))],
                          kv_transfer_params=c.kv_transfer_params)

    def _choice(self, i: int) -> CompletionChoice:
        c = self.choices
        prompt = i // c.n
        echo = self._echo(prompt)
        text = "" if self.echo_only else "".join(c.texts[i])
        if not self.want_logprobs:
            return CompletionChoice(index=i, text=echo + text, finish_reason=c.finish[i])
        lps = _completion_logprobs([] if self.echo_only else c.logprobs[i],
                                   [] if self.echo_only else [o + len(echo) for o in c.offsets[i]], self.as_ids)
        if self.echo is not None:
            head = _echo_logprobs(c.prompt_ids[prompt], c.prompt_logprobs[prompt], c.prompt_tokens_text[prompt],
                                  echo, self.as_ids)
            lps = CompletionLogprobs(tokens=head.tokens + lps.tokens,
                                     token_logprobs=head.token_logprobs + lps.token_logprobs,
                                     top_logprobs=head.top_logprobs + lps.top_logprobs,
                                     text_offset=head.text_offset + lps.text_offset)
        return CompletionChoice(index=i, text=echo + text, finish_reason=c.finish[i], logprobs=lps)


class ChatBuilder(_Usage):
    def __init__(self, rid: str, model: str, created: int, n: int,
                 *, logprobs: bool, stream: bool, include_usage: bool = False, token_ids: bool = False) -> None:
        """`token_ids`: logprob tokens spelled "token_id:ID" (vLLM's return_tokens_as_token_ids)."""
        self.rid, self.model, self.created = rid, model, created
        self.choices = _Choices(1, n, keep=not stream)
        self.want_logprobs = logprobs
        self.as_ids = token_ids
        self.stream = stream
        self.include_usage = include_usage

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        return _encode(ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage))

    def start(self) -> list[bytes]:
        # OpenAI opens every choice with a delta that carries only the role.
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in range(self.choices.n)]

    def add(self, prompt: int, ev: Delta | Done) -> list[bytes]:
        if isinstance(ev, Delta):
            i, _ = self.choices.add_delta(prompt, ev)
            extra = bool(ev.reasoning_content or ev.tool_calls)
            if not self.stream or not (ev.text or extra or (self.want_logprobs and ev.logprobs)):
                return []
            lp = _chat_logprobs(ev.logprobs, self.as_ids) if self.want_logprobs and ev.logprobs else None
            delta = ChatDelta(content=ev.text if ev.text or not extra else None,
                              reasoning_content=ev.reasoning_content or None, tool_calls=ev.tool_calls or None)
            return [self._chunk([ChatChunkChoice(index=i, delta=delta, logprobs=lp)])]
        finished = self.choices.add_done(prompt, ev)
        if not self.stream:
            return []
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(), finish_reason=self.choices.finish[i])],
                            self._usage_if_last(i, finished))
                for i in finished]

    def end(self) -> list[bytes]:
        return [self._chunk([], self.choices.usage())] if self.include_usage else []

    def response(self) -> ChatCompletion:
        c = self.choices
        return ChatCompletion(
            id=self.rid, created=self.created, model=self.model, usage=c.usage(),
            choices=[
                ChatChoice(
                    index=i, message=_message("".join(c.texts[i]), c.reasoning[i], c.tool_calls[i]),
                    finish_reason=c.finish[i],
                    logprobs=_chat_logprobs(c.logprobs[i], self.as_ids) if self.want_logprobs else None,
                )
                for i in range(len(c.texts))
            ],
            kv_transfer_params=c.kv_transfer_params,
        )


def _message(content: str, reasoning: list[str], calls: list[ToolCall]) -> ChatMessage:
    """OpenAI's answer: content null when the answer is tool calls and nothing but space besides."""
    return ChatMessage(content=None if calls and not content.strip() else content, tool_calls=calls or msgspec.UNSET,
                       reasoning_content="".join(reasoning) if reasoning else msgspec.UNSET)

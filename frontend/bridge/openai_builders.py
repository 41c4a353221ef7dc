"""Turn upstream deltas into OpenAI responses: whole ones, or server-sent-event chunks.

Choice index = prompt index * n + sample index, as OpenAI numbers a batch.
Token strings in logprobs are "token_id:ID" (the bridge has no tokenizer;
vLLM uses the same spelling for `return_tokens_as_token_ids`).
"""

from __future__ import annotations

import msgspec

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
from noria.protocol.client import Delta, Done, Logprob

_encode = msgspec.json.Encoder().encode


def token_str(token_id: int) -> str:
    return f"token_id:{token_id}"


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
        self.finish: list[str | None] = [None] * size
        self.prompt_ids: list[list[int]] = [[] for _ in range(num_prompts)]
        self.prompt_logprobs: list[list[Logprob | None] | None] = [None] * num_prompts
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.open_prompts = num_prompts

    def add_delta(self, prompt: int, d: Delta) -> tuple[int, int]:
        """Record a delta; returns (choice index, text offset where it starts)."""
        i = prompt * self.n + d.index
        start = self.lengths[i]
        self.lengths[i] += len(d.text)
        if not self.keep:
            return i, start
        self.texts[i].append(d.text)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = d.prompt_logprobs
        if d.logprobs:
            self.logprobs[i].extend(d.logprobs)
            self.offsets[i].extend([start] * len(d.logprobs))
        return i, start

    def add_done(self, prompt: int, done: Done) -> list[int]:
        reasons = done.finish_reasons or [done.finish_reason]
        self.open_prompts -= 1
        self.prompt_tokens += done.usage.prompt_tokens
        self.completion_tokens += done.usage.completion_tokens
        self.cached_tokens += done.usage.cached_tokens
        if self.keep:
            self.prompt_ids[prompt] = done.prompt_token_ids or []
        first = prompt * self.n
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


def _completion_logprobs(lps: list[Logprob], offsets: list[int]) -> CompletionLogprobs:
    tops: list[dict[str, float] | None] = []
    for lp in lps:
        top = {token_str(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=False)}
        top.setdefault(token_str(lp.token_id), lp.logprob)
        tops.append(top)
    return CompletionLogprobs(
        tokens=[token_str(lp.token_id) for lp in lps],
        token_logprobs=[lp.logprob for lp in lps],
        top_logprobs=tops,
        text_offset=offsets,
    )


def _echo_logprobs(ids: list[int], lps: list[Logprob | None] | None) -> CompletionLogprobs:
    """The echoed prompt's part: the first token has no logprob. Without a tokenizer the
    bridge cannot place prompt tokens in the text, so their text_offset is 0."""
    entries = lps or [None] * len(ids)
    return CompletionLogprobs(
        tokens=[token_str(t) for t in ids],
        token_logprobs=[None if lp is None else lp.logprob for lp in entries],
        top_logprobs=[None if lp is None else _completion_logprobs([lp], [0]).top_logprobs[0] for lp in entries],
        text_offset=[0] * len(ids),
    )


def _chat_logprobs(lps: list[Logprob]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=token_str(lp.token_id),
            logprob=lp.logprob,
            top_logprobs=[TopLogprob(token=token_str(t), logprob=v)
                          for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=False)],
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
    `logprobs` the prompt's logprobs come first, not when streaming); `echo_only`
    (max_tokens 0): the echo without the completion."""

    def __init__(self, rid: str, model: str, created: int, num_prompts: int, n: int,
                 *, logprobs: bool, stream: bool, include_usage: bool = False,
                 echo: list[str] | None = None, echo_only: bool = False) -> None:
        self.rid, self.model, self.created = rid, model, created
        self.choices = _Choices(num_prompts, n, keep=not stream)
        self.want_logprobs = logprobs
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
            i, start = self.choices.add_delta(prompt, ev)
            if not self.stream:
                return []
            echo = ""
            if self.echo is not None and i not in self.echoed:
                self.echoed.add(i)
                echo = self.echo[prompt]
            if self.echo_only:
                return [self._chunk([CompletionChoice(index=i, text=echo)])] if echo else []
            if not (echo or ev.text or ev.logprobs):
                return []
            lp = _completion_logprobs(ev.logprobs, [start + len(echo)] * len(ev.logprobs)) if self.want_logprobs and ev.logprobs else None
            return [self._chunk([CompletionChoice(index=i, text=echo + ev.text, logprobs=lp)])]
        finished = self.choices.add_done(prompt, ev)
        if not self.stream:
            return []
        return [self._chunk([CompletionChoice(index=i, text="", finish_reason=self.choices.finish[i])], self._usage_if_last(i, finished))
                for i in finished]

    def end(self) -> list[bytes]:
        return [self._chunk([], self.choices.usage())] if self.include_usage else []

    def response(self) -> Completion:
        c = self.choices
        return Completion(id=self.rid, created=self.created, model=self.model, usage=c.usage(),
                          choices=[self._choice(i) for i in range(len(c.texts))])

    def _choice(self, i: int) -> CompletionChoice:
        c = self.choices
        prompt = i // c.n
        echo = "" if self.echo is None else self.echo[prompt]
        text = "" if self.echo_only else "".join(c.texts[i])
        if not self.want_logprobs:
            return CompletionChoice(index=i, text=echo + text, finish_reason=c.finish[i])
        lps = _completion_logprobs([] if self.echo_only else c.logprobs[i],
                                   [] if self.echo_only else [o + len(echo) for o in c.offsets[i]])
        if self.echo is not None:
            head = _echo_logprobs(c.prompt_ids[prompt], c.prompt_logprobs[prompt])
            lps = CompletionLogprobs(tokens=head.tokens + lps.tokens,
                                     token_logprobs=head.token_logprobs + lps.token_logprobs,
                                     top_logprobs=head.top_logprobs + lps.top_logprobs,
                                     text_offset=head.text_offset + lps.text_offset)
        return CompletionChoice(index=i, text=echo + text, finish_reason=c.finish[i], logprobs=lps)


class ChatBuilder(_Usage):
    def __init__(self, rid: str, model: str, created: int, n: int,
                 *, logprobs: bool, stream: bool, include_usage: bool = False) -> None:
        self.rid, self.model, self.created = rid, model, created
        self.choices = _Choices(1, n, keep=not stream)
        self.want_logprobs = logprobs
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
            if not self.stream or not (ev.text or (self.want_logprobs and ev.logprobs)):
                return []
            lp = _chat_logprobs(ev.logprobs) if self.want_logprobs and ev.logprobs else None
            return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=ev.text), logprobs=lp)])]
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
                    index=i, message=ChatMessage(content="".join(c.texts[i])), finish_reason=c.finish[i],
                    logprobs=_chat_logprobs(c.logprobs[i]) if self.want_logprobs else None,
                )
                for i in range(len(c.texts))
            ],
        )

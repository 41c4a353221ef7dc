"""Result objects returned by `LLM.generate` and `Client.generate` (vLLM's shapes),
and the one place that assembles them from a request's deltas and its `done`."""

from __future__ import annotations

import msgspec

from noria.protocol.client import Delta, Done, Error, Logprob, ToolCall


class CompletionOutput(msgspec.Struct, kw_only=True):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Logprob] | None = None
    # With tools (`text` is then the content outside the calls) or a reasoning parser.
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With `prompt_logprobs`: per prompt token, its Logprob (the first is None).
    prompt_logprobs: list[Logprob | None] | None = None


class OutputBuilder:
    """Collects one request's deltas (any order across samples) and its final
    message; `output()` is the RequestOutput once that final message was a `done`.

    Callable, so that it can be the sink a FrontendCore request reports to.
    """

    __slots__ = ("request_id", "prompt", "_texts", "_ids", "_logprobs", "final", "prompt_logprobs", "_reasoning")

    def __init__(self, request_id: str, prompt: str | None, n: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        # Pieces joined once at the end: appending to a str per delta is quadratic.
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._ids: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[list[Logprob] | None] = [None] * n
        self._reasoning: list[list[str] | None] = [None] * n
        self.final: Done | Error | None = None
        self.prompt_logprobs: list[Logprob | None] | None = None

    def add(self, msg: Delta | Done | Error) -> None:
        if isinstance(msg, Delta):
            i = msg.index
            self._texts[i].append(msg.text)
            self._ids[i].extend(msg.token_ids)
            if msg.reasoning_content:
                parts = self._reasoning[i]
                if parts is None:
                    parts = self._reasoning[i] = []
                parts.append(msg.reasoning_content)
            if msg.prompt_logprobs is not None:
                self.prompt_logprobs = msg.prompt_logprobs
            if msg.logprobs:
                lps = self._logprobs[i]
                if lps is None:
                    lps = self._logprobs[i] = []
                lps.extend(msg.logprobs)
        else:
            self.final = msg

    __call__ = add

    def output(self) -> RequestOutput:
        done = self.final
        assert isinstance(done, Done), "output() needs the request's `done`"
        reasons = done.finish_reasons or [done.finish_reason]
        calls = done.tool_calls or []
        outs = [
            CompletionOutput(index=i, text="".join(self._texts[i]), token_ids=self._ids[i],
                             finish_reason=reasons[i], logprobs=self._logprobs[i],
                             tool_calls=(calls[i] or None) if i < len(calls) else None,
                             reasoning_content=None if self._reasoning[i] is None else "".join(self._reasoning[i]))
            for i in range(len(self._texts))
        ]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=done.prompt_token_ids or [], outputs=outs,
                             num_cached_tokens=done.usage.cached_tokens, prompt_logprobs=self.prompt_logprobs)

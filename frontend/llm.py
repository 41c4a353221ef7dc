"""Offline inference: `LLM(model="demo", **engine_flags).generate(prompts, params)`.

The frontend runs in this process; the scheduler and workers are child
processes that `LLM` shuts down when it is closed or leaves its `with`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import msgspec
from tqdm import tqdm

from noria.frontend.core import FrontendCore
from noria.frontend.outputs import CompletionOutput, RequestOutput
from noria.frontend.startup import make_config, start_core
from noria.protocol.client import Delta, Done, Error, Generate, Logprob, SchedulerStats
from noria.protocol.engine import EngineDead, EngineOutputs
from noria.protocol.errors import ErrorCode, NoriaError
from noria.protocol.sampling import SamplingParams

Prompt = str | list[int]


class _Collector:
    """Accumulates one request's messages into a RequestOutput."""

    def __init__(self, request_id: str, prompt: str | None, n: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.texts = [""] * n
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[Logprob] | None] = [None] * n
        self.final: Done | Error | None = None

    def __call__(self, msg: Delta | Done | Error) -> None:
        if isinstance(msg, Delta):
            self.texts[msg.index] += msg.text
            self.ids[msg.index].extend(msg.token_ids)
            if msg.logprobs:
                lp = self.logprobs[msg.index]
                if lp is None:
                    lp = self.logprobs[msg.index] = []
                lp.extend(msg.logprobs)
        else:
            self.final = msg

    def output(self, num_cached_tokens: int = 0) -> RequestOutput:
        assert isinstance(self.final, Done)
        reasons = self.final.finish_reasons or [self.final.finish_reason]
        outs = [
            CompletionOutput(index=i, text=self.texts[i], token_ids=self.ids[i],
                             finish_reason=reasons[i], logprobs=self.logprobs[i])
            for i in range(len(self.texts))
        ]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.final.prompt_token_ids or [], outputs=outs,
                             num_cached_tokens=num_cached_tokens)


class LLM:
    def __init__(self, model: str = "demo", **engine_flags: Any) -> None:
        self.config = make_config(model, **engine_flags)
        self.core: FrontendCore = start_core(self.config)
        self._counter = 0
        self._closed = False

    @property
    def tokenizer(self) -> Any:
        return self.core.processor.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        items = _as_prompt_list(prompts)
        plist = _as_params_list(params, len(items))
        msgs = []
        for i, (prompt, p) in enumerate(zip(items, plist, strict=True)):
            fields = msgspec.structs.asdict(p)
            if isinstance(prompt, str):
                fields["prompt"] = prompt
            else:
                fields["prompt_token_ids"] = list(prompt)
            msgs.append(Generate(request_id=self._next_id(), priority=priority[i] if priority else 0, **fields))
        return self._run(msgs, [m.prompt for m in msgs], use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        plist = _as_params_list(params, len(convs))
        msgs = [
            Generate(request_id=self._next_id(), messages=list(c), **msgspec.structs.asdict(p))
            for c, p in zip(convs, plist, strict=True)
        ]
        return self._run(msgs, [None] * len(msgs), use_tqdm)

    def _run(self, msgs: list[Generate], prompts: list[str | None], use_tqdm: bool) -> list[RequestOutput]:
        core = self.core
        collectors = [_Collector(m.request_id, pr, m.n) for m, pr in zip(msgs, prompts, strict=True)]
        for m, c in zip(msgs, collectors, strict=True):
            core.submit(m.request_id, m, c, stream=False)
        bar = tqdm(total=len(msgs), desc="generate", unit="req", disable=not use_tqdm or len(msgs) < 2, leave=False)
        done = sum(c.final is not None for c in collectors)
        bar.update(done)
        try:
            while done < len(msgs):
                self._pump(500)
                now_done = sum(c.final is not None for c in collectors)
                bar.update(now_done - done)
                done = now_done
        except BaseException:
            for m in msgs:
                core.abort(m.request_id)
            raise
        finally:
            bar.close()
        errors = [c.final for c in collectors if isinstance(c.final, Error)]
        if errors:
            e = errors[0]
            raise NoriaError(e.code, f"request {e.request_id}: {e.message}")
        return [c.output() for c in collectors]

    def _pump(self, timeout_ms: int) -> None:
        core = self.core
        msgs = core.engine.recv(timeout_ms)
        for msg in msgs:
            if isinstance(msg, EngineOutputs):
                core.on_outputs(msg)
            elif isinstance(msg, EngineDead):
                core.fail_all(f"engine died: {msg.reason}")
        if not msgs:
            dead = core.engine.dead()
            if dead:
                core.fail_all(f"engine died: {dead}")

    def stats(self, timeout: float = 10.0) -> SchedulerStats:
        """The scheduler's counters (preemptions, prefix-cache hits, blocks...)."""
        self.core.stats = None
        self.core.engine.query_stats()
        deadline = time.monotonic() + timeout
        while self.core.stats is None:
            if time.monotonic() > deadline:
                raise NoriaError(ErrorCode.TIMEOUT, "no stats from the scheduler")
            self._pump(100)
        return self.core.stats

    def _next_id(self) -> str:
        self._counter += 1
        return str(self._counter - 1)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.core.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    plist = list(params)
    if len(plist) != n:
        raise ValueError(f"got {len(plist)} SamplingParams for {n} prompts")
    return plist

"""Offline inference: `LLM(model="demo", **engine_flags).generate(prompts, params)`.

The frontend runs in this process; the scheduler and workers are child
processes that `LLM` shuts down when it is closed or leaves its `with`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from noria.frontend.core import FrontendCore
from noria.frontend.inputs import Prompt, make_embed, make_generate, prompt_list
from noria.frontend.outputs import OutputBuilder, RequestOutput
from noria.frontend.pump import pump_engine
from noria.frontend.startup import make_config, start_core
from noria.protocol.client import Delta, Done, Embed, Embedding, Error, Generate, SchedulerStats
from noria.protocol.errors import ErrorCode, NoriaError
from noria.protocol.sampling import SamplingParams


class LLM:
    def __init__(self, model: str = "demo", **engine_flags: Any) -> None:
        self.config = make_config(model, **engine_flags)
        self.core: FrontendCore = start_core(self.config)
        # The caller is this process: the chat templates it passes are its own code (vLLM's
        # LLM.chat takes them too), unlike a server's clients'.
        self.core.processor.trust_request_chat_template = True
        self._counter = 0
        self._closed = False

    @property
    def tokenizer(self) -> Any:
        return self.core.processor.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use with no params (vLLM's method): vLLM's defaults with
        the checkpoint's generation_config.json values over them (--generation-config auto)."""
        return SamplingParams(**self.core.processor.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        items = prompt_list(prompts)
        plist = _as_params_list(params, len(items))
        msgs = [
            make_generate(self._next_id(), prompt, p, priority=priority[i] if priority else 0)
            for i, (prompt, p) in enumerate(zip(items, plist, strict=True))
        ]
        return self._run(msgs, [m.prompt for m in msgs], use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation or several; the chat template controls (vLLM's) and OpenAI's
        `tools` / `tool_choice` apply to each (the calls come back in each output's `tool_calls`).
        `tools` without a `tool_choice` on an engine made without `enable_auto_tool_choice` and a
        `tool_call_parser` only reach the template, as vLLM's `LLM.chat` hands them on: the
        text is the model's, unread (`tool_choice="required"` or a named one still constrain)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        chat_config = self.core.chat
        if tools and tool_choice is None and not (chat_config.enable_auto_tool_choice
                                                  and chat_config.tool_call_parser is not None):
            tool_choice = "none"
        plist = _as_params_list(params, len(convs))
        chat = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                "chat_template": chat_template, "chat_template_kwargs": chat_template_kwargs,
                "tools": tools, "tool_choice": tool_choice}
        msgs = [make_generate(self._next_id(), None, p, messages=list(c), **chat)
                for c, p in zip(convs, plist, strict=True)]
        return self._run(msgs, [None] * len(msgs), use_tqdm)

    def embed(self, texts: Prompt | Sequence[Prompt], *, dimensions: int | None = None,
              use_tqdm: bool = True) -> list[list[float]]:
        """One embedding per input (a text or token ids), in input order, from an engine made
        with `runner="pooling"`; `dimensions` keeps that many components, normalized again."""
        inputs = prompt_list(texts)
        msgs = [make_embed(self._next_id(), p, dimensions=dimensions) for p in inputs]
        finals: dict[str, Embedding | Error | Done] = {}

        def sink(out: Delta | Done | Error | Embedding) -> None:
            if not isinstance(out, Delta):
                finals[out.request_id or ""] = out

        for m in msgs:
            self.core.submit(m.request_id, m, sink, stream=False)
        self._wait(msgs, lambda: len(finals), "embed", use_tqdm)
        out = [finals[m.request_id] for m in msgs]
        vectors = []
        for e in out:
            if isinstance(e, Error):
                raise NoriaError(e.code, f"request {e.request_id}: {e.message}", param=e.param)
            if not isinstance(e, Embedding):
                raise NoriaError(ErrorCode.INTERNAL, f"request {e.request_id} ended without an embedding")
            vectors.append(e.embedding)
        return vectors

    def _wait(self, msgs: Sequence[Generate | Embed], finished: Callable[[], int], desc: str,
              use_tqdm: bool) -> None:
        """Pump the engine until `finished()` counts every message, with a progress bar; any
        exception on the way (Ctrl-C too) aborts them all."""
        bar = tqdm(total=len(msgs), desc=desc, unit="req", disable=not use_tqdm or len(msgs) < 2, leave=False)
        done = finished()
        bar.update(done)
        try:
            while done < len(msgs):
                self._pump(500)
                now_done = finished()
                bar.update(now_done - done)
                done = now_done
        except BaseException:
            for m in msgs:
                self.core.abort(m.request_id)
            raise
        finally:
            bar.close()

    def _run(self, msgs: list[Generate], prompts: list[str | None], use_tqdm: bool) -> list[RequestOutput]:
        core = self.core
        builders = [OutputBuilder(m.request_id, pr, m.n) for m, pr in zip(msgs, prompts, strict=True)]
        for m, c in zip(msgs, builders, strict=True):
            core.submit(m.request_id, m, c, stream=False)
        self._wait(msgs, lambda: sum(c.final is not None for c in builders), "generate", use_tqdm)
        errors = [c.final for c in builders if isinstance(c.final, Error)]
        if errors:
            e = errors[0]
            raise NoriaError(e.code, f"request {e.request_id}: {e.message}", param=e.param)
        return [c.output() for c in builders]

    def _pump(self, timeout_ms: int) -> None:
        # A dead engine needs nothing more here: its requests have failed, and so will new ones.
        pump_engine(self.core, timeout_ms)

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


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None,
                    n: int) -> list[SamplingParams | None]:
    if params is None:  # the server's defaults (get_default_sampling_params), as vLLM's LLM
        return [None] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    plist = list(params)
    if len(plist) != n:
        raise ValueError(f"got {len(plist)} SamplingParams for {n} prompts")
    return plist

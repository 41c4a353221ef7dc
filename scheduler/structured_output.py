"""Grammar state for structured output, kept in the scheduler (as vLLM V1 does).

The scheduler owns every request's accepted tokens, so it also owns each
constrained request's llguidance `LLMatcher`: the matcher advances when a step's
sampled token is applied, and `fill_bitmask` computes the allowed-token mask of
exactly the requests that sample in the step being planned, which travels in
that StepPlan. Preemption (recompute or swap) and a lost worker need nothing:
the matcher already reflects every accepted token, and a step whose result is
never applied never advanced it.

llguidance is a Rust library with no torch dependency (the scheduler stays
torch-free). Compiling a grammar can take from microseconds to a second, so it
runs on a thread pool (llguidance drops the GIL while it compiles); the request
waits until its grammar is ready, and a pipe wakes the scheduler's poll loop.
Compiled grammars are cached by their canonical text: a request gets a cheap
`deep_copy` of the cached matcher. The llguidance tokenizer is built from the
model's tokenizer.json on the first constrained request (a few ms for small
vocabularies, about a second for 150k-token ones), so start-up pays nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from noria.protocol.model_spec import read_spec
from noria.protocol.step import GrammarBitmask
from noria.protocol.structured import StructuredOutput, spec_text

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
COMPILE_THREADS = 2

Matcher = Any  # llguidance.LLMatcher (imported lazily: most engines never need it)


class StructuredOutputManager:
    """Compiles grammars off the step loop and computes per-step token bitmasks."""

    def __init__(self, tokenizer_path: str, model_path: str | None = None, vocab_size: int | None = None) -> None:
        """The tokenizer.json in `tokenizer_path`; the mask width is `vocab_size`, else the
        vocabulary size in `model_path`'s config.json (the model's, which may exceed the tokenizer's)."""
        self.tokenizer_path = tokenizer_path
        self.model_path = model_path or tokenizer_path
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[str, Future[Matcher]] = OrderedDict()
        self._done: deque[tuple[int, Future[Matcher]]] = deque()
        self._tokenizer: Any = None
        self._tok_lock = threading.Lock()
        self._executor: Any = None
        self._wake: tuple[int, int] | None = None  # a pipe, made before the first compile
        self.num_pending = 0

    @property
    def wake_fd(self) -> int:
        """Readable when a compile has finished: poll it beside the sockets."""
        if self._wake is None:
            self._wake = os.pipe()
            os.set_blocking(self._wake[0], False)
        return self._wake[0]

    # ---- compiling ---------------------------------------------------------

    def submit(self, req_id: int, so: StructuredOutput, eos_token_ids: list[int]) -> Matcher | None:
        """The request's matcher at once when its grammar is cached and compiled (None when
        it does not compile either: `take_ready` reports it); otherwise None, and the
        matcher comes out of `take_ready` later."""
        key = spec_text(so)
        fut = self._cache.get(key)
        if fut is None:
            # The pipe must exist before a compile can finish, or its wake-up is lost.
            _ = self.wake_fd
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="noria-grammar")
            fut = self._pool.submit(self._compile, so, eos_token_ids)
            self._cache[key] = fut
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if fut.done() and not _error_of(fut):
            return fut.result().deep_copy()
        self.num_pending += 1
        fut.add_done_callback(lambda f: self._finished(req_id, f))
        return None

    def _finished(self, req_id: int, fut: Future[Matcher]) -> None:
        # Runs on a pool thread (or here, if already done): hand over and wake the loop.
        self._done.append((req_id, fut))
        if self._wake is not None:
            with contextlib.suppress(OSError):  # closed at shutdown
                os.write(self._wake[1], b"!")

    def take_ready(self) -> list[tuple[int, Matcher | None, str | None]]:
        """(req_id, matcher, None) for each compiled grammar, (req_id, None, error) for each
        that failed, since the last call."""
        if self._wake is not None:
            try:
                while os.read(self._wake[0], 4096):
                    pass
            except BlockingIOError:
                pass
        out: list[tuple[int, Matcher | None, str | None]] = []
        while self._done:
            req_id, fut = self._done.popleft()
            self.num_pending -= 1
            error = _error_of(fut)
            out.append((req_id, None, error) if error else (req_id, fut.result().deep_copy(), None))
        return out

    def _compile(self, so: StructuredOutput, eos_token_ids: list[int]) -> Matcher:
        import llguidance as llg

        tokenizer = self._llg_tokenizer(eos_token_ids)
        matcher = llg.LLMatcher(tokenizer, _grammar(so), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def _llg_tokenizer(self, eos_token_ids: list[int]) -> Any:
        with self._tok_lock:
            if self._tokenizer is None:
                import llguidance as llg

                path = os.path.join(self.tokenizer_path, "tokenizer.json")
                if not os.path.isfile(path):
                    raise ValueError(f"structured output needs a fast tokenizer (tokenizer.json) in {self.tokenizer_path}")
                with open(path) as f:
                    text = f.read()
                vocab = self.vocab_size or read_spec(self.model_path).vocab_size
                # n_vocab is the model's (logits) width, which may exceed the tokenizer's.
                self._tokenizer = llg.LLTokenizer(text, n_vocab=vocab, eos_token=list(eos_token_ids) or None)
            return self._tokenizer

    # ---- per step ----------------------------------------------------------

    def fill_bitmask(self, rows: list[tuple[int, Matcher]]) -> GrammarBitmask:
        """One packed row per (req_id, matcher), computed in parallel inside llguidance."""
        import llguidance as llg
        import numpy as np
        from llguidance.numpy import fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = llg.LLExecutor()
        words = (self._tokenizer.vocab_size + 31) // 32
        mask = np.empty((len(rows), words), dtype="<i4")
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, (_, m) in enumerate(rows)], mask)
        return GrammarBitmask([rid for rid, _ in rows], mask.tobytes())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None


def resume(matcher: Matcher, tokens: list[int]) -> bool:
    """Bring a fresh matcher to where a request's earlier outputs left it; False if they break it."""
    return all(matcher.consume_token(t) for t in tokens)


def grammar_draft(req: Any, draft: list[int]) -> tuple[list[int], list[Matcher]]:
    """A constrained request's draft (speculative decoding) cut where its grammar would reject a
    token or be complete, and the matcher of each of the k + 1 positions its step samples (the
    request's own, then copies that have taken the draft's first 1 .. k tokens): their masks
    go with the step, row by row. While the request reasons (the grammar holds only after the
    reasoning's end token) the draft stops before that token, and nothing is masked."""
    if req.matcher is None:
        return [], []
    if req.grammar_wait is not None:
        return (draft[:draft.index(req.grammar_wait)] if req.grammar_wait in draft else draft), []
    states = [req.matcher]
    matcher = req.matcher
    for i, token in enumerate(draft):
        matcher = matcher.deep_copy()
        if not matcher.consume_token(token) or matcher.is_stopped():
            return draft[:i], states
        states.append(matcher)
    return draft, states


def advance(matcher: Matcher, token: int) -> str | None:
    """Accept a sampled token: "stop" when the grammar is complete (nothing may follow),
    "error" when the token breaks it (the mask was not applied), else None."""
    if not matcher.consume_token(token):
        return "error"
    return "stop" if matcher.is_stopped() else None


def _grammar(so: StructuredOutput) -> str:
    import json

    import llguidance as llg

    M = llg.LLMatcher
    # Compact JSON (no free whitespace between tokens): a model may otherwise pad with
    # whitespace until max_tokens runs out, a known failure of flexible JSON grammars.
    compact = {"whitespace_flexible": False}
    if so.json is not None:
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        return M.grammar_from_json_schema(schema, defaults=compact)
    if so.json_object:
        return M.grammar_from_json_schema({"type": "object"}, defaults=compact)
    if so.regex is not None:
        return M.grammar_from_regex(so.regex)
    if so.choice is not None:
        # Lark string literals take JSON's escapes, so json.dumps quotes any choice safely.
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    assert so.grammar is not None
    from llguidance.gbnf_to_lark import any_to_lark

    # Lark as llguidance reads it; GBNF (llama.cpp's, xgrammar's EBNF) is converted.
    return M.grammar_from_lark(any_to_lark(so.grammar))


def _error_of(fut: Future[Matcher]) -> str | None:
    e = fut.exception()
    return None if e is None else (str(e) or type(e).__name__)

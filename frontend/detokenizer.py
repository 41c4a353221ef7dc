"""Incremental detokenization and stop strings for one sample.

Each new token re-decodes only a short window (from the last point where the
text was complete): text is released once it no longer ends in an unfinished
character (U+FFFD), so a multi-byte character is never split across deltas,
and bytes that never complete are still flushed on the final call. The
window starts inside the prompt so leading spaces come out as in a full
decode. Stop strings are checked on the text; the last
`max(len(stop)) - 1` characters are held back from the stream so that a stop
string is never partly sent before it is recognised.

A request's stop strings are indexed once (`StopStrings`) for all its samples:
each new character costs one set lookup per distinct stop-string length, not
one search per stop string, so thousands of them cost what a few do.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class StopStrings:
    """Stop strings grouped by length."""

    __slots__ = ("by_length", "longest")

    def __init__(self, stop: list[str]) -> None:
        by_length: dict[int, set[str]] = {}
        for s in stop:
            if s:
                by_length.setdefault(len(s), set()).add(s)
        self.by_length = sorted(by_length.items())
        self.longest = self.by_length[-1][0] if self.by_length else 0

    def first_hit(self, text: str, new_from: int) -> int:
        """Where the earliest stop string that ends at or after `new_from` starts in
        `text`; -1 if none does. Strings that end earlier were looked for before."""
        hit = -1
        for end in range(new_from + 1, len(text) + 1):
            for length, words in self.by_length:
                start = end - length
                if start < 0:
                    break
                if (hit == -1 or start < hit) and text[start:end] in words:
                    hit = start
        return hit


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        stop: StopStrings | list[str] | None,
        skip_special_tokens: bool = True,
    ) -> None:
        """`stop`: a request's `StopStrings`, made once for its samples (or a list of them)."""
        self._decode = tokenizer.backend_tokenizer.decode
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0  # window start
        self._read_offset = len(self._ids)  # tokens before this are in `text`
        self._stop = stop if isinstance(stop, StopStrings) or stop is None else StopStrings(stop)
        if self._stop is not None and not self._stop.longest:
            self._stop = None
        self._hold = max(1, self._stop.longest if self._stop else 1) - 1
        self.text = ""
        self._sent = 0
        self.stopped = False
        self.stop_string: str | None = None  # the one that ended the text (Anthropic's stop_sequence)

    def add(self, token_ids: list[int]) -> None:
        """Append tokens; sets `stopped` (and truncates `text`) on a stop string."""
        for tok in token_ids:
            self._ids.append(tok)
            chunk = self._advance(final=False)
            if chunk and self._append(chunk):
                return

    def _advance(self, final: bool) -> str:
        window = self._ids[self._prefix_offset :]
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        full = self._decode(window, skip_special_tokens=self._skip)
        if len(full) > len(prefix) and (final or not full.endswith(_REPLACEMENT)):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def _append(self, chunk: str) -> bool:
        new_from = len(self.text)
        self.text += chunk
        return self._stop is not None and self._check_stop(self._stop, new_from)

    def _check_stop(self, stop: StopStrings, new_from: int) -> bool:
        hit = stop.first_hit(self.text, new_from)
        if hit == -1:
            return False
        # The hit's shortest string that ends in the new text is the one first_hit found (it
        # scans ends in order).
        self.stop_string = next(self.text[hit:hit + n] for n, words in stop.by_length
                                if hit + n > new_from and self.text[hit:hit + n] in words)
        self.text = self.text[:hit]
        self.stopped = True
        return True

    def take(self, final: bool) -> str:
        """The text not yet sent; on the final call, all of it (pending bytes included)."""
        if final and not self.stopped and self._read_offset < len(self._ids):
            chunk = self._advance(final=True)
            if chunk:
                self._append(chunk)
        end = len(self.text) if final or self.stopped else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent : end]
        self._sent = end
        return out

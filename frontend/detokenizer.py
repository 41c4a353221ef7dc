"""Incremental detokenization and stop strings for one sample.

Each new token re-decodes only a short window (from the last point where the
text was complete): text is released once it no longer ends in an unfinished
character (U+FFFD), so a multi-byte character is never split across deltas,
and bytes that never complete are still flushed on the final call. The
window starts inside the prompt so leading spaces come out as in a full
decode. Stop strings are checked on the text; the last
`max(len(stop)) - 1` characters are held back from the stream so that a stop
string is never partly sent before it is recognised.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        stop: list[str] | None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = tokenizer.backend_tokenizer.decode
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0  # window start
        self._read_offset = len(self._ids)  # tokens before this are in `text`
        self._stop = stop or []
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._sent = 0
        self.stopped = False

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
        start = max(0, len(self.text) - self._hold)
        self.text += chunk
        return bool(self._stop) and self._check_stop(start)

    def _check_stop(self, start: int) -> bool:
        hit = -1
        for s in self._stop:
            i = self.text.find(s, start)
            if i != -1 and (hit == -1 or i < hit):
                hit = i
        if hit == -1:
            return False
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

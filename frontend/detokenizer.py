"""Incremental detokenization and stop strings for one sample.

Text is produced with the tokenizers library's DecodeStream (seeded with the
prompt's tail so leading spaces come out right), which never splits a
multi-byte character. Stop strings are checked on the text; the last
`max(len(stop)) - 1` characters are held back from the stream so that a stop
string is never partly sent before it is recognised.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

_PROMPT_CONTEXT = 4


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        stop: list[str] | None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=prompt_ids[-_PROMPT_CONTEXT:], skip_special_tokens=skip_special_tokens)
        self._stop = stop or []
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._sent = 0
        self.stopped = False

    def add(self, token_ids: list[int]) -> None:
        """Append tokens; sets `stopped` (and truncates `text`) on a stop string."""
        for tok in token_ids:
            chunk = self._stream.step(self._backend, tok)
            if chunk:
                start = max(0, len(self.text) - self._hold)
                self.text += chunk
                if self._stop and self._check_stop(start):
                    return

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
        """The text not yet sent; on the final call, all of it."""
        end = len(self.text) if final or self.stopped else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent : end]
        self._sent = end
        return out

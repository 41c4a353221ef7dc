"""`bad_words` → the token-id sequences the worker bans (vLLM's rule).

A word may start the text or follow a space, and a tokenizer spells those two
differently, so each word is tokenized both ways: without and with a leading
space. The spaced spelling is kept when it is a different first token and the
same number of tokens (else it is not the same word in another position, and
banning it could ban unrelated text).
"""

from __future__ import annotations

from typing import Any

from noria.protocol.errors import ParamError


def bad_words_token_ids(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    out: list[list[int]] = []
    for word in words:
        word = word.lstrip()
        plain = list(tokenizer.encode(word, add_special_tokens=False))
        if not plain:
            raise ParamError("bad_words", f"bad word {word!r} has no tokens")
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word, add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    bad = sorted({t for ids in out for t in ids if not 0 <= t < vocab_size})
    if bad:
        raise ParamError("bad_words", f"bad_words tokenize to ids outside the vocabulary [0, {vocab_size}): {bad[:8]}")
    return out

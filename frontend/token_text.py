"""Each token's exact UTF-8 bytes and its text as OpenAI spells it in logprobs.

A token's bytes are read from the tokenizer's vocabulary entry through its decoder's
rules, not from `decode([id])`: decoding one token that holds part of a multi-byte
character gives U+FFFD and loses the bytes. Two families of decoders are read exactly:

* byte-level BPE (GPT-2, Llama 3, Qwen): each character of the entry stands for one byte;
* SentencePiece-style pieces (Llama 2, Mistral): "▁" is a space and `<0xNN>` is byte NN.

Added tokens (specials such as "<|eot_id|>") are their own text. Any other decoder falls
back to `decode([id])`, exact whenever that decodes to whole characters.

The text is the bytes decoded when they are whole UTF-8 characters, else "bytes:" and
each byte as `\\xNN` (OpenAI's spelling for a token that holds part of a character), so
that the texts of consecutive tokens join to the generated text wherever they hold whole
characters, and their bytes always do.
"""

from __future__ import annotations

import json
import re
from typing import Any

from noria.protocol.client import Logprob

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves, the other bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    kept = set(printable)
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in kept:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _decoder_kind(tokenizer: Any) -> str:
    """"byte_level", "pieces" (SentencePiece style) or "other", from the tokenizer's decoder."""
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except (AttributeError, ValueError, TypeError):
        return "other"
    parts = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
    types = {p.get("type") for p in parts if isinstance(p, dict)}
    if "ByteLevel" in types:
        return "byte_level"
    if "Metaspace" in types or "ByteFallback" in types:
        return "pieces"
    return "other"


def spell(data: bytes) -> str:
    """A token's text: its bytes decoded, or "bytes:\\xNN..." when they are not whole characters."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TokenTexts:
    """Per tokenizer: token id -> (text, bytes), computed once per id on first use."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind = _decoder_kind(tokenizer)
        self._alphabet = _byte_level_alphabet() if self.kind == "byte_level" else {}
        try:
            self._added = {int(i): t.content for i, t in tokenizer.added_tokens_decoder.items()}
        except AttributeError:
            self._added = {}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def bytes_of(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:  # an id the vocabulary does not have
            return b""
        if self.kind == "byte_level" and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        if self.kind == "pieces":
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def entry(self, token_id: int) -> tuple[str, list[int]]:
        got = self._cache.get(token_id)
        if got is None:
            data = self.bytes_of(token_id)
            got = self._cache[token_id] = (spell(data), list(data))
        return got

    def fill(self, lp: Logprob) -> None:
        """Give an engine `Logprob` its token texts and bytes (in place)."""
        lp.token, lp.bytes = self.entry(lp.token_id)
        tops = [self.entry(t) for t in lp.top_token_ids]
        lp.top_tokens = [t for t, _ in tops]
        lp.top_bytes = [b for _, b in tops]

    def fill_all(self, lps: list[Logprob] | list[Logprob | None] | None) -> None:
        for lp in lps or ():
            if lp is not None:
                self.fill(lp)

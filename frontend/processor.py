"""Turns client `Generate` messages into token ids and validated sampling params."""

from __future__ import annotations

import json
import os
from typing import Any

from noria.frontend.bad_words import bad_words_token_ids
from noria.protocol.client import Generate
from noria.protocol.errors import ErrorCode, NoriaError
from noria.protocol.sampling import SamplingParams, check_sampling


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def eos_token_ids(model_path: str, tokenizer: Any) -> list[int]:
    """EOS ids from generation_config.json (may be a list), else the tokenizer's."""
    ids: set[int] = set()
    gen = os.path.join(model_path, "generation_config.json")
    if os.path.exists(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


class InputProcessor:
    def __init__(self, tokenizer: Any, eos_ids: list[int], vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # No token spells more characters than the longest vocabulary entry, so a longer
        # text cannot fit and is refused before the tokenizer spends seconds on it.
        self.max_prompt_chars = max_model_len * _longest_token(tokenizer)

    def process(self, msg: Generate) -> tuple[list[int], SamplingParams]:
        """Tokenize and validate; raises NoriaError naming the problem."""
        given = [x is not None for x in (msg.prompt, msg.messages, msg.prompt_token_ids)]
        if sum(given) != 1:
            raise NoriaError(
                ErrorCode.INVALID_REQUEST, "exactly one of prompt, messages, prompt_token_ids must be given"
            )
        if not msg.request_id:
            raise NoriaError(ErrorCode.INVALID_REQUEST, "request_id must be a non-empty string")
        params = msg.sampling_params()
        check_sampling(params, self.vocab_size)
        params.bad_words_token_ids = (
            bad_words_token_ids(self.tokenizer, params.bad_words, self.vocab_size) if params.bad_words else None
        )
        ids = self.tokenize(msg)
        if not ids:
            raise NoriaError(ErrorCode.INVALID_REQUEST, "prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise NoriaError(
                ErrorCode.INVALID_REQUEST, f"prompt_token_ids out of vocabulary range [0, {self.vocab_size}): {bad[:5]}"
            )
        if len(ids) >= self.max_model_len:
            raise NoriaError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {len(ids)} tokens but this engine accepts at most {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len})",
            )
        return ids, params

    def tokenize(self, msg: Generate) -> list[int]:
        if msg.prompt_token_ids is not None:
            return list(msg.prompt_token_ids)
        if msg.prompt is not None:
            if not msg.prompt:
                return []
            if len(msg.prompt) > self.max_prompt_chars:
                raise NoriaError(ErrorCode.PROMPT_TOO_LONG, f"prompt has {len(msg.prompt)} characters, more than "
                                 f"max_model_len {self.max_model_len} tokens can spell")
            return list(self.tokenizer(msg.prompt)["input_ids"])
        assert msg.messages is not None
        if not msg.messages:
            raise NoriaError(ErrorCode.INVALID_REQUEST, "messages is empty")
        if sum(len(c) for m in msg.messages if isinstance(m, dict) and isinstance(c := m.get("content"), str)) > self.max_prompt_chars:
            raise NoriaError(ErrorCode.PROMPT_TOO_LONG, f"messages hold more characters than max_model_len "
                             f"{self.max_model_len} tokens can spell")
        for m in msg.messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise NoriaError(ErrorCode.INVALID_REQUEST, "each message needs 'role' and 'content'")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise NoriaError(ErrorCode.INVALID_REQUEST, "this model has no chat template")
        try:
            text = self.tokenizer.apply_chat_template(
                msg.messages, add_generation_prompt=msg.add_generation_prompt, tokenize=False
            )
        except Exception as e:  # template errors are the user's input problem
            raise NoriaError(ErrorCode.INVALID_REQUEST, f"chat template failed: {e}") from e
        # The template already holds the special tokens it wants.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _longest_token(tokenizer: Any) -> int:
    try:
        return max(16, max(len(t) for t in tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):
        return 1024  # a tokenizer without a vocabulary list: a generous bound

"""Sampling parameters: the public `SamplingParams` and its validation.

The same Struct travels inside engine requests, so the scheduler and the worker
see exactly what the user asked for.
"""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's sampling parameters with vLLM's meanings and defaults."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # A single stop string is accepted for convenience, as vLLM does.
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


MAX_LOGPROBS = 20


def sampling_error(p: SamplingParams, vocab_size: int | None = None) -> str | None:
    """Return a message naming the first invalid value, or None when all are valid."""
    checks: list[tuple[bool, str]] = [
        (p.n >= 1, f"n must be at least 1, got {p.n}"),
        (p.n <= 64, f"n must be at most 64, got {p.n}"),
        (p.max_tokens is None or p.max_tokens >= 1, f"max_tokens must be at least 1, got {p.max_tokens}"),
        (p.temperature >= 0.0, f"temperature must be non-negative, got {p.temperature}"),
        (0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}"),
        (p.top_k >= -1, f"top_k must be -1 or 0 (disabled) or positive, got {p.top_k}"),
        (0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}"),
        (p.min_tokens >= 0, f"min_tokens must be non-negative, got {p.min_tokens}"),
        (
            p.max_tokens is None or p.min_tokens <= p.max_tokens,
            f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})",
        ),
        (
            p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS,
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}",
        ),
        (-2.0 <= p.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"),
        (-2.0 <= p.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"),
        (p.repetition_penalty > 0.0, f"repetition_penalty must be positive, got {p.repetition_penalty}"),
        (p.seed is None or -(2**63) <= p.seed < 2**64, f"seed out of range: {p.seed}"),
        (
            p.stop is None or all(isinstance(s, str) and s for s in p.stop),
            "stop must be a list of non-empty strings",
        ),
    ]
    for ok, message in checks:
        if not ok:
            return message
    if vocab_size is not None and p.stop_token_ids:
        bad = [t for t in p.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            return f"stop_token_ids out of vocabulary range [0, {vocab_size}): {bad}"
    return None

"""Sampling parameters: the public `SamplingParams`, its validation, and the engine's part.

`SamplingParams` is what a client asks for, text included (stop strings, bad words).
The scheduler and the workers get `EngineSamplingParams` instead: only the fields they
read, with text already turned into token ids by the frontend, made once per client
request and shared by its n samples (each sample's seed follows from its index,
`sample_seed`). Stop strings never leave the frontend.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

from noria.protocol.errors import ParamError
from noria.protocol.structured import StructuredOutput, check_structured
from noria.protocol.validation import check_fields

MAX_LOGPROBS = 20
MAX_N = 64
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias, [-100, 100]
# Outside it, dividing or multiplying a logit by the penalty vanishes or overflows in
# float32/bf16 (1e-300 is 0 there, and every logit then became inf).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# The wire types of integer fields: what msgpack carries as a signed 64-bit integer. A
# larger one (JSON has no bound) then fails where it is decoded, naming its field, instead
# of overflowing when the message is encoded again on its way to the engine.
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
# A seed is signed or unsigned 64 bits, as torch takes one; msgspec bounds no integer past
# int64, so below 2**64 is checked in `check_sampling`.
Seed = Annotated[int, Meta(ge=-(2**63))]
TokenId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's sampling parameters with vLLM's meanings and defaults."""

    n: Int64 = 1
    max_tokens: Int64 | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int64 = 0
    min_p: float = 0.0
    seed: Seed | None = None
    stop: list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    logprobs: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # Added to the logits of the named token ids before penalties and sampling.
    logit_bias: dict[Int64, float] | None = None
    # Per prompt token: its logprob and the top-k alternatives (the first is None).
    prompt_logprobs: Int64 | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[Int64] | None = None
    # Words never to generate (vLLM's meaning: see worker/logits_processors.py).
    bad_words: list[str] | None = None
    structured_output: StructuredOutput | None = None  # guided decoding (protocol/structured.py)

    # The range each field must fall in, checked through msgspec by `check_sampling`
    # (`check_fields` reads this ClassVar).
    # They are not the fields' own types on purpose: a `generate` message with n=0
    # must still decode (its request id is then known) and fail as `invalid_request`,
    # while a wrongly typed field fails to decode as `invalid_message`.
    CHECKED: ClassVar[dict[str, Any]] = {
        "n": Annotated[int, Meta(ge=1, le=MAX_N)],
        "max_tokens": Annotated[int, Meta(ge=1, le=2**63 - 1)] | None,
        "temperature": Annotated[float, Meta(ge=0.0)],
        "top_p": Annotated[float, Meta(gt=0.0, le=1.0)],
        "top_k": Annotated[int, Meta(ge=-1, le=2**63 - 1)],  # 0 and -1 both mean off
        "min_p": Annotated[float, Meta(ge=0.0, le=1.0)],
        "seed": Seed | None,
        "stop": list[Annotated[str, Meta(min_length=1)]] | None,
        "stop_token_ids": list[TokenId] | None,
        "min_tokens": Count,
        "logprobs": Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None,
        "presence_penalty": Penalty,
        "frequency_penalty": Penalty,
        "repetition_penalty": Annotated[float, Meta(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)],
        "logit_bias": dict[TokenId, Annotated[float, Meta(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None,
        "prompt_logprobs": Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None,
        "allowed_token_ids": Annotated[list[TokenId], Meta(min_length=1)] | None,
        "bad_words": list[Annotated[str, Meta(min_length=1)]] | None,
    }

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


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def check_sampling(p: SamplingParams, vocab_size: int | None = None) -> None:
    """Raise a ParamError naming the first invalid field; return when all are valid."""
    check_fields(p)
    for name in _FLOAT_FIELDS:
        value = getattr(p, name)
        if not math.isfinite(value):  # inf passes `ge=0` and would turn logits into nan
            raise ParamError(name, f"{name} must be a finite number, got {value}")
    # Rules that span fields or need the model, which a field's type cannot say.
    if p.seed is not None and p.seed >= 2**64:
        raise ParamError("seed", f"seed must be below 2**64, got {p.seed}")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ParamError("min_tokens", f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})")
    if p.structured_output is not None:
        check_structured(p.structured_output)
    if p.bad_words and any(not w.strip() for w in p.bad_words):
        raise ParamError("bad_words", "bad_words must not hold empty or blank words")
    if vocab_size is None:
        return
    token_lists = {
        "stop_token_ids": p.stop_token_ids,
        "logit_bias": list(p.logit_bias or ()),
        "allowed_token_ids": p.allowed_token_ids,
    }
    for name, ids in token_lists.items():
        bad = [t for t in ids or () if t >= vocab_size]
        if bad:
            raise ParamError(name, f"{name} out of vocabulary range [0, {vocab_size}): {bad[:8]}")


# The largest encoded `EngineSamplingParams` a request may have: it crosses to the
# scheduler once, and to the workers once in every plan that starts one of its samples,
# so one request can never make a plan too big to send in time.
MAX_ENGINE_PARAMS_BYTES = 4 << 20


class EngineSamplingParams(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """What the scheduler and the workers read of a request's sampling parameters.

    Made by the frontend from `SamplingParams` (`engine_params`), once per client
    request, for all of its samples: no text (stop strings and bad words stay in the
    frontend), token-id lists without repeats, and the request's own `seed`, from which
    each sample derives its own (`sample_seed`). Sample 0 alone computes
    `prompt_logprobs`. The workers get it without `structured_output` (the scheduler
    sends them the grammar's masks instead).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    # The token-id sequences never to generate: `bad_words` as the frontend's tokenizer
    # spells them (frontend/bad_words.py).
    bad_words_token_ids: list[list[int]] | None = None
    structured_output: StructuredOutput | None = None
    # With a reasoning parser (vLLM's way): `structured_output` holds only from the token after
    # this one (`</think>`); the reasoning before it is free. None: from the first token.
    reasoning_end_token_id: int | None = None

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def engine_params(p: SamplingParams, bad_words_token_ids: list[list[int]] | None = None) -> EngineSamplingParams:
    """The engine's part of checked parameters; `bad_words_token_ids`: `p.bad_words` tokenized."""
    return EngineSamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        seed=p.seed, stop_token_ids=_unique(p.stop_token_ids), ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens, logprobs=p.logprobs, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
        logit_bias=p.logit_bias or None, prompt_logprobs=p.prompt_logprobs,
        allowed_token_ids=_unique(p.allowed_token_ids),
        bad_words_token_ids=[list(w) for w in dict.fromkeys(map(tuple, bad_words_token_ids or ()))] or None,
        structured_output=p.structured_output,
    )


def _unique(ids: list[int] | None) -> list[int] | None:
    # Both lists are sets in meaning; a client's repeats would only fatten every message.
    return sorted(set(ids)) if ids else None


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed: the request's seed + index, as vLLM does; past 2**64 - 1 it
    wraps (a seed is 64 bits on the wire and in torch)."""
    if seed is None or index == 0:
        return seed
    seed += index
    return seed - 2**64 if seed >= 2**64 else seed

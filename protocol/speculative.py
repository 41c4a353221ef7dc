"""Speculative decoding: `--speculative-config` with vLLM's keys, and what a plan carries of it.

A proposer guesses the next k tokens of a request; the worker computes the request's last token
and the k guesses in one forward pass (a decode row of k + 1 tokens) and samples every one of
those k + 1 positions as it would have sampled it alone. The output is the sampled tokens up to
and including the first that differs from its guess: a guess is kept only where the target
itself sampled it, so the output distribution is the target's (for a proposer whose guesses are
fixed tokens, sampling from the target and comparing is the rejection-sampling rule), greedy
output equals speculation off token for token, and a seeded request draws each position's noise
from its output index (worker/sampler.py), so its tokens equal speculation off too.

Built: `ngram` (prompt lookup over the request's own prompt and output: the scheduler proposes),
`suffix` (suffix trees over the prompt and the tenant's responses: scheduler/suffix_decoding.py)
`draft_model` (a smaller checkpoint with the target's tokenizer, run greedily by the worker
over its own KV cache in the same blocks: worker/draft_model.py) and `eagle3` (an EAGLE-3 head
over the target's hidden states, on the worker too: worker/eagle3.py) and `mtp` (the target's
own multi-token-prediction layer, MiMo's layout: worker/mtp.py). `eagle` (EAGLE-1) is vLLM's
name too and is refused in one sentence.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from noria.protocol.validation import json_flag

Method = Literal["ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp"]
BUILT: tuple[str, ...] = ("ngram", "suffix", "draft_model", "eagle3", "mtp")
# The methods whose proposals the worker makes, at the start of the step that verifies them.
ON_WORKER: tuple[str, ...] = ("draft_model", "eagle3", "mtp")
# The worker's proposers that are another checkpoint, named by `model` (mtp is the served one's).
NAMED: dict[str, str] = {"draft_model": "the draft checkpoint's folder", "eagle3": "the EAGLE-3 head's folder"}
_NOT_BUILT = {
    "eagle": "EAGLE-1 heads are not read; an EAGLE-3 head is ({\"method\": \"eagle3\", \"model\": ...})",
}
# vLLM leaves the n-gram window to the user; both ends default to this when neither is given.
DEFAULT_LOOKUP = 5
SUFFIX_DEPTH = 24  # vLLM's suffix_decoding_max_tree_depth


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's SpeculativeConfig keys that mean something here; `parse_speculative_config` also
    accepts (and ignores) the ones that only tune vLLM's own drafters."""

    method: Method = "ngram"
    num_speculative_tokens: Annotated[int, Meta(ge=1, le=32)]
    # draft_model, eagle3: the draft checkpoint or head (a local folder, or `demo`); mtp: the target's
    # own folder (the default)
    model: str | None = None
    # The draft model's context (its checkpoint's at most): no request is drafted past it.
    max_model_len: Annotated[int, Meta(ge=1)] | None = None
    prompt_lookup_min: Annotated[int, Meta(ge=1)] = DEFAULT_LOOKUP
    prompt_lookup_max: Annotated[int, Meta(ge=1)] = DEFAULT_LOOKUP
    # No speculation in a step that runs more requests than this (None: any number).
    disable_by_batch_size: Annotated[int, Meta(ge=1)] | None = None
    # suffix: the trees' depth (the longest match, and num_speculative_tokens' default), the
    # responses kept once their requests end, the proposal's length at most this times the
    # match's, and the least probability of a proposed run (vLLM's defaults).
    suffix_decoding_max_tree_depth: Annotated[int, Meta(ge=1, le=64)] = SUFFIX_DEPTH
    suffix_decoding_max_cached_requests: Annotated[int, Meta(ge=0)] = 10000
    suffix_decoding_max_spec_factor: Annotated[float, Meta(ge=0)] = 1.0
    suffix_decoding_min_token_prob: Annotated[float, Meta(ge=0, le=1)] = 0.1

    def describe(self) -> str:
        """The start-up line's words for it."""
        source = {"draft_model": f"draft model {self.model}", "eagle3": f"EAGLE-3 head {self.model}",
                  "mtp": f"the MTP layer of {self.model}",
                  "suffix": f"suffix trees of depth {self.suffix_decoding_max_tree_depth}, "
                            f"{self.suffix_decoding_max_cached_requests} responses kept"
                  }.get(self.method, f"n-grams of {self.prompt_lookup_min}-{self.prompt_lookup_max}")
        return (f"speculative decoding: {self.method}, {self.num_speculative_tokens} tokens, {source}"
                + (f", off above {self.disable_by_batch_size} running" if self.disable_by_batch_size else ""))

    @property
    def on_worker(self) -> bool:
        """The worker proposes (`Draft.propose`), past the scheduler's grammar masks."""
        return self.method in ON_WORKER


# vLLM's keys that tune its drafters only: accepted so that a vLLM command line starts here.
_IGNORED = ("draft_tensor_parallel_size", "quantization", "revision", "code_revision",
            "enforce_eager", "disable_padded_drafter_batch", "speculative_token_tree", "parallel_drafting",
            "disable_logprobs", "target_model_config", "target_parallel_config")
_FIELDS = [f.name for f in msgspec.structs.fields(SpeculativeConfig)]


def parse_speculative_config(value: str | dict[str, Any]) -> dict[str, Any]:
    """`--speculative-config JSON` (or `LLM(speculative_config={...})`), checked and with vLLM's
    defaults filled in; ValueError says in one sentence what is wrong."""
    value = {k: v for k, v in json_flag(value, "--speculative-config", "vLLM's SpeculativeConfig keys").items()
             if k not in _IGNORED}
    for key in value:
        if key not in _FIELDS:
            raise ValueError(f"--speculative-config has no key {key!r}; it takes {', '.join(_FIELDS)}")
    method = value.get("method")
    if method is None and value.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling
        value["method"], value["model"] = "ngram", None
    elif method is None and value.get("model"):  # vLLM infers a draft model from a model alone
        value["method"] = "draft_model"
    method = value.setdefault("method", "ngram")
    if method in _NOT_BUILT:
        raise ValueError(f"--speculative-config method {method!r} is not built in noria: {_NOT_BUILT[method]}")
    if method not in BUILT:
        raise ValueError(f"--speculative-config method {method!r} is not built in noria yet; it speculates "
                         f"with {', '.join(BUILT)}")
    if method in NAMED and not value.get("model"):
        raise ValueError(f"--speculative-config method {method!r} needs model ({NAMED[method]})")
    if method == "suffix":  # vLLM's default: as many as the trees are deep
        value.setdefault("num_speculative_tokens", min(32, value.get("suffix_decoding_max_tree_depth", SUFFIX_DEPTH)))
    if "num_speculative_tokens" not in value:
        raise ValueError("--speculative-config needs num_speculative_tokens (how many tokens to propose)")
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    value["prompt_lookup_min"] = lo if lo is not None else hi if hi is not None else DEFAULT_LOOKUP
    value["prompt_lookup_max"] = hi if hi is not None else value["prompt_lookup_min"]
    try:
        config = msgspec.convert(value, SpeculativeConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"--speculative-config: {e}") from None
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise ValueError(f"--speculative-config prompt_lookup_min {config.prompt_lookup_min} is above "
                         f"prompt_lookup_max {config.prompt_lookup_max}")
    return value


class Draft(msgspec.Struct, array_like=True, gc=False):
    """Tokens proposed for a request in this step: its scheduled row is its last known token and
    these, `len(token_ids) + 1` tokens, and the worker samples at every one of those positions.
    With a draft model the scheduler names only how many (`propose`, `token_ids` empty) and the
    worker's draft model proposes them at the start of the step."""

    req_id: int
    token_ids: list[int]
    propose: int = 0

    @property
    def length(self) -> int:
        """The draft's tokens, however they are proposed."""
        return self.propose or len(self.token_ids)

"""Why the scheduler refuses an engine request at the door, if it does."""

from __future__ import annotations

from noria.protocol.engine import EngineRequest, EngineSample
from noria.protocol.errors import ErrorCode


def refusal(msg: EngineRequest, sample: EngineSample, max_model_len: int, token_budget: int,
            chunked_prefill: bool, pooling: bool = False) -> tuple[str, str] | None:
    """(error code, message) for a sample of `msg` this engine cannot take, else None.
    `pooling`: a pooling engine's request, which needs no room for an output token."""
    n_prompt = len(msg.prompt_token_ids)
    if n_prompt == 0:
        return ErrorCode.INVALID_REQUEST, "prompt is empty"
    if pooling and n_prompt > max_model_len:
        return (ErrorCode.PROMPT_TOO_LONG,
                f"input has {n_prompt} tokens but this engine embeds at most {max_model_len} (max_model_len)")
    if pooling:
        return None if chunked_prefill or n_prompt <= token_budget else (
            ErrorCode.PROMPT_TOO_LONG, f"input has {n_prompt} tokens, more than max_num_batched_tokens "
            f"{token_budget} with chunked prefill disabled")
    if n_prompt >= max_model_len:
        return (ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {n_prompt} tokens but this engine accepts at most {max_model_len - 1} "
                f"(max_model_len {max_model_len} leaves room for at least one output token)")
    if not chunked_prefill and n_prompt > token_budget:
        return (ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {n_prompt} tokens, more than max_num_batched_tokens {token_budget} "
                "with chunked prefill disabled")
    if sample.output_token_ids and n_prompt + len(sample.output_token_ids) >= max_model_len:
        return ErrorCode.INVALID_REQUEST, "a resumed request's prompt and outputs fill max_model_len"
    return None

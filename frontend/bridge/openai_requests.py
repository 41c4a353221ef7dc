"""OpenAI request bodies → noria `generate` messages, rejecting what noria cannot honour."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from noria.frontend.bridge.errors import UNDECODABLE, BadRequest, undecodable_message
from noria.frontend.bridge.openai_refused import unsupported_field
from noria.frontend.bridge.openai_schema import ChatRequest, CompletionRequest, SamplingFields
from noria.frontend.bridge.openai_structured import structured_output
from noria.frontend.inputs import make_generate
from noria.protocol.client import GENERATION_DEFAULT_FIELDS, Generate, cache_salt_problem
from noria.protocol.errors import ErrorCode, ParamError
from noria.protocol.sampling import SamplingParams, check_sampling
from noria.protocol.validation import field_error

R = TypeVar("R", CompletionRequest, ChatRequest)
_CHAT_ACCEPTS = frozenset({"tools", "tool_choice"})  # checked by the frontend (frontend/tools.py)
MAX_PROMPTS = 128
# Samples one completions request may draw (n x prompts): each is an engine request.
MAX_SAMPLES = 256


async def read_body(request: web.Request, kind: type[R]) -> R:
    """Decode a JSON body: one that is not JSON raises msgspec's DecodeError, one that
    does not fit `kind` a BadRequest naming the field (OpenAI's `param`)."""
    return decode_body(await request.read(), kind)


def decode_body(body: bytes, kind: type[R]) -> R:
    """`read_body` once the body is read (touches nothing shared: may run on a thread)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        try:
            bad = field_error(kind, msgspec.json.decode(body))
        except UNDECODABLE:  # of the right shape for a moment only: nested too deeply further in
            bad = None
        raise BadRequest(f"invalid request body: {e}", bad.param if bad else None,
                         code=ErrorCode.INVALID_MESSAGE) from None
    except UNDECODABLE as e:  # not JSON, not UTF-8, nested too deeply
        raise BadRequest(f"invalid request body: {undecodable_message(e)}", code=ErrorCode.INVALID_MESSAGE) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's keys are token ids written as strings."""
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise BadRequest("logit_bias keys must be token ids (integers written as strings)", "logit_bias") from None


def _sampling(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
              names: dict[str, str] | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from a request; `names` maps a SamplingParams field to the request
    field it came from where the two differ, so that an error names what the client sent."""
    refused = unsupported_field(req, _CHAT_ACCEPTS if isinstance(req, ChatRequest) else frozenset())
    if refused:
        raise BadRequest(refused[1], refused[0])
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or None)
    params = SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        skip_special_tokens=req.skip_special_tokens,
        logit_bias=_logit_bias(req.logit_bias),
        prompt_logprobs=prompt_logprobs,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        structured_output=structured_output(req),
    )
    # Checked here, before anything goes upstream, so that a batch fails as a whole
    # with 400 and the error names the parameter.
    try:
        check_sampling(params)
    except ParamError as e:
        param = (names or {}).get(e.param or "", e.param)
        raise BadRequest(e.message, param) from None
    return params


def _cache_salt(req: SamplingFields) -> str | None:
    problem = cache_salt_problem(req.cache_salt)
    if problem:
        raise BadRequest(problem, "cache_salt")
    return req.cache_salt


def completion_generates(req: CompletionRequest, new_id: Callable[[], str]) -> list[Generate]:
    if req.suffix:
        raise BadRequest("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise BadRequest("best_of must equal n (noria returns every sample it draws)", "best_of")
    prompts = prompts_of(req.prompt)
    max_tokens = req.max_tokens
    if req.echo:
        echo_prompts(req, prompts)
        if max_tokens == 0:  # the prompt alone (scoring): one token is drawn and dropped, as vLLM does
            max_tokens = 1
    prompt_logprobs = req.logprobs if req.echo else None
    params = _sampling(req, max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)
    if params.n * len(prompts) > MAX_SAMPLES:
        raise BadRequest(f"n ({params.n}) x prompts ({len(prompts)}) is {params.n * len(prompts)} samples, more "
                         f"than the {MAX_SAMPLES} one request may draw", "n")
    salt = _cache_salt(req)
    if req.kv_transfer_params is not None and len(prompts) > 1:
        raise BadRequest("kv_transfer_params go with one prompt", "kv_transfer_params")
    messages = [_server_defaults(make_generate(new_id(), p, params, priority=req.priority, cache_salt=salt), req)
                for p in prompts]
    if req.echo:
        for msg in messages:
            # A token-id prompt's text comes from the frontend, which has the tokenizer.
            msg.return_prompt_text = msg.prompt_token_ids is not None
    return messages


def _server_defaults(msg: Generate, req: SamplingFields) -> Generate:
    """The sampling fields the body left out go upstream unset: the server's defaults fill them
    (--generation-config), as vLLM's server does; vLLM's stood in only for the check above.
    The request's kv_transfer_params go with it."""
    msg.kv_transfer_params = req.kv_transfer_params
    for name in GENERATION_DEFAULT_FIELDS:
        if getattr(req, name) is None:
            setattr(msg, name, msgspec.UNSET)
    return msg


def echo_prompts(req: CompletionRequest, prompts: list[str | list[int]]) -> list[str | None] | None:
    """The texts `echo` puts before each completion (None without echo): a text prompt
    itself; None for a token-id prompt, whose text the frontend sends with the first delta
    (`return_prompt_text`). Raises for what the bridge cannot echo."""
    if not req.echo:
        return None
    if req.stream and req.logprobs is not None:
        raise BadRequest("echo with logprobs is not supported when streaming", "echo")
    return [p if isinstance(p, str) else None for p in prompts]


def prompts_of(prompt: str | list[Any]) -> list[str | list[int]]:
    """OpenAI's four prompt forms: a string, strings, token ids, lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt must not be empty", "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if all(isinstance(s, str) for s in prompt):
        prompts: list[str | list[int]] = list(prompt)
    elif all(isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids) for ids in prompt):
        prompts = [list(ids) for ids in prompt]
    else:
        raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    return prompts


def chat_generate(req: ChatRequest, new_id: Callable[[], str]) -> Generate:
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    names = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    if req.echo:
        raise BadRequest("echo is not supported on chat completions", "echo")
    params = _sampling(req, max_tokens=max_tokens, logprobs=logprobs, names=names)
    # The shapes here (a wrong type is the body's fault); what they say, in the frontend.
    if req.tools is not None and not (isinstance(req.tools, list) and all(isinstance(t, dict) for t in req.tools)):
        raise BadRequest("tools must be a list of tool objects", "tools", code=ErrorCode.INVALID_MESSAGE)
    if req.tool_choice is not None and not isinstance(req.tool_choice, str | dict):
        raise BadRequest("tool_choice must be a string or an object", "tool_choice", code=ErrorCode.INVALID_MESSAGE)
    msg = make_generate(new_id(), None, params, messages=[_message(m) for m in req.messages],
                        priority=req.priority, add_generation_prompt=req.add_generation_prompt,
                        cache_salt=_cache_salt(req), continue_final_message=req.continue_final_message,
                        chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs,
                        tools=req.tools, tool_choice=req.tool_choice,
                        parallel_tool_calls=req.parallel_tool_calls is not False)
    return _server_defaults(msg, req)


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """Text-only content: a string, or a list of {"type": "text"} parts joined."""
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str):
        raise BadRequest("each message needs a string role", "messages")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRequest("only text content parts are supported", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise BadRequest("message content must be a string or a list of text parts", "messages")
    return {**m, "content": content}

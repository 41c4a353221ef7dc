"""Turns client `Generate` messages into token ids and validated sampling params."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from noria.frontend.bad_words import bad_words_token_ids
from noria.frontend.chat_template import RenderError, render_chat, template_kwargs
from noria.frontend.generation_config import read_generation_config
from noria.frontend.token_text import TokenTexts
from noria.frontend.tools import template_messages
from noria.protocol.client import (
    Detokenize,
    Detokenized,
    Generate,
    Tokenize,
    Tokenized,
    cache_salt_problem,
)
from noria.protocol.config import SchedulingPolicy
from noria.protocol.errors import ErrorCode, NoriaError, ParamError
from noria.protocol.kv_transfer import read_params
from noria.protocol.sampling import (
    MAX_ENGINE_PARAMS_BYTES,
    EngineSamplingParams,
    SamplingParams,
    check_sampling,
    engine_params,
)

Positive = Annotated[int, Meta(ge=1)]


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    # noria runs no checkpoint's own code: a config.json naming some (MiMo's `auto_map`) would
    # otherwise have transformers ask on the terminal whether to run it.
    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)


def eos_token_ids(model_path: str, tokenizer: Any) -> list[int]:
    """EOS ids from generation_config.json (may be a list), else the tokenizer's."""
    ids: set[int] = set()
    eos = read_generation_config(model_path).get("eos_token_id")
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(int(e) for e in eos)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


# Lower runs first (vLLM's meaning); honoured only with --scheduling-policy priority.
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1


class InputLimits(msgspec.Struct, frozen=True, kw_only=True):
    """How large one request may be. Each is checked before any tokenizing, in time
    proportional to the request's size: the frontend's one thread serves every client,
    and a request that kept it busy for seconds stalled them all. `noria serve` flags
    set them (frontend/cli_args.py); docs/protocol.md lists them."""

    # Characters of a text prompt, or of chat messages counted over every field (roles,
    # names, content parts, tool calls...). None: max_model_len times the longest
    # vocabulary entry, more than any prompt that fits can spell.
    max_prompt_chars: Positive | None = None
    max_messages: Positive = 4096
    max_stop_strings: Positive = 256
    max_bad_words: Positive = 1024
    # Characters of the stop strings together, and of the bad words together.
    max_word_chars: Positive = 65536
    max_logit_bias: Positive = 1024
    # Characters of a request's own `chat_template` (a server's --chat-template is not held to it).
    max_chat_template_chars: Positive = 65536
    # OpenAI `tools` of a chat request: each is checked, rendered and, under tool_choice
    # "required", turned into one branch of the output's grammar.
    max_tools: Positive = 1024


class InputProcessor:
    def __init__(self, tokenizer: Any, eos_ids: list[int], vocab_size: int, max_model_len: int,
                 limits: InputLimits | None = None, scheduling_policy: SchedulingPolicy = "fcfs",
                 chat_template: str | None = None, trust_request_chat_template: bool = False,
                 sampling_defaults: dict[str, Any] | None = None) -> None:
        """`chat_template`: the server's (--chat-template, already read), else the tokenizer's is
        used; `trust_request_chat_template`: requests may bring their own (vLLM's flag);
        `sampling_defaults`: the values of the fields a request leaves unset
        (frontend/generation_config.py), vLLM's where absent."""
        self.sampling_defaults = dict(sampling_defaults or {})
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.limits = limits or InputLimits()
        self.scheduling_policy = scheduling_policy
        # No token spells more characters than the longest vocabulary entry, so a longer
        # text cannot fit and is refused before the tokenizer spends seconds on it.
        longest = max_model_len * _longest_token(tokenizer)
        given = self.limits.max_prompt_chars
        self.max_prompt_chars = longest if given is None else min(given, longest)

    def process(self, msg: Generate, sizes_checked: bool = False) -> tuple[list[int], SamplingParams]:
        """Tokenize and validate; raises NoriaError naming the problem. `sizes_checked`: the
        caller has already run `check_sizes` on `msg`."""
        given = [x is not None for x in (msg.prompt, msg.messages, msg.prompt_token_ids)]
        if sum(given) != 1:
            raise NoriaError(
                ErrorCode.INVALID_REQUEST, "exactly one of prompt, messages, prompt_token_ids must be given"
            )
        if not msg.request_id:
            raise NoriaError(ErrorCode.INVALID_REQUEST, "request_id must be a non-empty string")
        if not sizes_checked:
            self.check_sizes(msg)
        self.check_priority(msg.priority)
        salt_problem = cache_salt_problem(msg.cache_salt)
        if salt_problem:
            raise ParamError("cache_salt", salt_problem)
        try:
            read_params(msg.kv_transfer_params)
        except ValueError as e:
            raise ParamError("kv_transfer_params", str(e)) from None
        params = msg.sampling_params(self.sampling_defaults)
        check_sampling(params, self.vocab_size)
        ids = self.tokenize(msg)
        if not ids:
            raise NoriaError(ErrorCode.INVALID_REQUEST, "prompt is empty")
        if len(ids) >= self.max_model_len:
            raise NoriaError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {len(ids)} tokens but this engine accepts at most {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len})",
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ParamError("prompt_token_ids", f"prompt_token_ids out of vocabulary range [0, {self.vocab_size}): "
                             f"{bad[:5]}")
        default_max = self.sampling_defaults.get("max_tokens")
        if default_max is not None and (msg.max_tokens is msgspec.UNSET or msg.max_tokens is None):
            # generation_config.json's max_new_tokens stands in for the request's max_tokens, as
            # in vLLM: never past the room the prompt leaves (a default the request did not
            # choose must not fail it).
            params = msgspec.structs.replace(params, max_tokens=max(1, min(default_max, self.max_model_len - len(ids))))
        # As vLLM's OpenAI server: a length that cannot fit is an error, not silently cut.
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ParamError("max_tokens", f"max_tokens ({params.max_tokens}) + prompt tokens ({len(ids)}) > "
                             f"max_model_len ({self.max_model_len}): ask for at most "
                             f"{self.max_model_len - len(ids)} tokens, or send a shorter prompt")
        return ids, params

    def engine_params(self, params: SamplingParams) -> EngineSamplingParams:
        """The engine's part of checked `params` (bad words as token ids), for all of a
        request's samples; refused past MAX_ENGINE_PARAMS_BYTES encoded, so that no
        request's parameters can make a step's plan too large to send in time."""
        words = bad_words_token_ids(self.tokenizer, params.bad_words, self.vocab_size) if params.bad_words else None
        out = engine_params(params, words)
        size = len(msgspec.msgpack.encode(out))
        if size > MAX_ENGINE_PARAMS_BYTES:
            raise NoriaError(ErrorCode.INVALID_REQUEST, f"the sampling parameters take {size} bytes in the engine, "
                             f"more than the {MAX_ENGINE_PARAMS_BYTES} it accepts per request (logit_bias, "
                             "allowed_token_ids, stop_token_ids, bad_words and structured_output together)")
        return out

    def check_priority(self, priority: int) -> None:
        if not priority:
            return
        if self.scheduling_policy != "priority":
            raise ParamError("priority", f"priority {priority} needs a server started with --scheduling-policy "
                             "priority (this one schedules first come, first served)")
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise ParamError("priority", f"priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority}")

    def check_sizes(self, msg: Generate) -> None:
        """Refuse a request larger than `self.limits` allow, naming the field; each check
        reads lengths only, or stops counting at its limit."""
        lim = self.limits
        self.check_text_sizes(msg)
        if msg.prompt_token_ids is not None and len(msg.prompt_token_ids) >= self.max_model_len:
            raise ParamError("prompt_token_ids", f"prompt has {len(msg.prompt_token_ids)} tokens but this engine "
                             f"accepts at most {self.max_model_len - 1} (max_model_len {self.max_model_len})",
                             ErrorCode.PROMPT_TOO_LONG)
        for name, words, cap in (("stop", msg.stop, lim.max_stop_strings), ("bad_words", msg.bad_words,
                                                                           lim.max_bad_words)):
            if words is None:
                continue
            if len(words) > cap:
                raise ParamError(name, f"{name} has {len(words)} entries, more than the {cap} this server accepts")
            if sum(len(w) for w in words) > lim.max_word_chars:
                raise ParamError(name, f"{name} holds more than {lim.max_word_chars} characters together, more "
                                 "than this server accepts")
        if msg.logit_bias is not None and len(msg.logit_bias) > lim.max_logit_bias:
            raise ParamError("logit_bias", f"logit_bias has {len(msg.logit_bias)} entries, more than the "
                             f"{lim.max_logit_bias} this server accepts")
        for name, ids in (("allowed_token_ids", msg.allowed_token_ids), ("stop_token_ids", msg.stop_token_ids)):
            if ids is not None and len(ids) > self.vocab_size:
                raise ParamError(name, f"{name} has {len(ids)} entries, more than the vocabulary's {self.vocab_size}")

    def check_text_sizes(self, msg: Generate | Tokenize) -> None:
        """The prompt's, the messages' and the chat template's sizes (`check_sizes`)."""
        lim = self.limits
        if msg.prompt is not None and len(msg.prompt) > self.max_prompt_chars:
            raise ParamError("prompt", f"prompt has {len(msg.prompt)} characters, more than the "
                             f"{self.max_prompt_chars} this server accepts (max_model_len {self.max_model_len})",
                             ErrorCode.PROMPT_TOO_LONG)
        if msg.chat_template is not None and len(msg.chat_template) > lim.max_chat_template_chars:
            raise ParamError("chat_template", f"chat_template has {len(msg.chat_template)} characters, more than "
                             f"the {lim.max_chat_template_chars} this server accepts (--max-chat-template-chars)")
        if msg.messages is not None:
            if len(msg.messages) > lim.max_messages:
                raise ParamError("messages", f"{len(msg.messages)} messages, more than the {lim.max_messages} "
                                 "this server accepts")
            if msg.tools is not None and len(msg.tools) > lim.max_tools:
                raise ParamError("tools", f"{len(msg.tools)} tools, more than the {lim.max_tools} this server "
                                 "accepts (--max-tools)")
            # The template's variables and tools are rendered into the prompt too.
            extra = [v for v in (msg.chat_template_kwargs, msg.tools) if v]
            size = json_size([msg.messages, *extra], self.max_prompt_chars)
            if size > self.max_prompt_chars:
                # Name the tools when they alone are too large: they are what to cut.
                field = "tools" if msg.tools and json_size(msg.tools, self.max_prompt_chars) > self.max_prompt_chars \
                    else "messages"
                raise ParamError(field, f"messages hold more than {self.max_prompt_chars} characters (every "
                                 "field counted, with chat_template_kwargs and tools), more than max_model_len "
                                 f"{self.max_model_len} tokens can spell", ErrorCode.PROMPT_TOO_LONG)

    def tokenize(self, msg: Generate) -> list[int]:
        if msg.prompt_token_ids is not None:
            return list(msg.prompt_token_ids)
        if msg.prompt is not None:
            if not msg.prompt:
                return []
            return list(self.tokenizer(msg.prompt)["input_ids"])
        assert msg.messages is not None
        text = self.render(msg)
        # The template already holds the special tokens it wants.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(self, msg: Generate | Tokenize) -> str:
        """`msg.messages` through the chat template, with the request's template controls;
        raises NoriaError naming the field at fault."""
        messages = msg.messages
        if not messages:
            raise ParamError("messages", "messages is empty")
        for m in messages:
            # An assistant message that calls tools may have no content (OpenAI's shape).
            if not isinstance(m, dict) or "role" not in m or ("content" not in m and not m.get("tool_calls")):
                raise ParamError("messages", "each message needs 'role' and 'content'")
        messages = template_messages(messages)
        try:
            kwargs = template_kwargs(msg.chat_template_kwargs)
        except RenderError as e:
            raise ParamError(e.param, e.message) from None
        # vLLM's merge: the kwargs may carry the template and the two switches too.
        template = kwargs.pop("chat_template", None) if msg.chat_template is None else msg.chat_template
        kwargs.pop("chat_template", None)
        generation_prompt = bool(kwargs.pop("add_generation_prompt", msg.add_generation_prompt))
        continue_final = bool(kwargs.pop("continue_final_message", msg.continue_final_message))
        tools = kwargs.pop("tools", None) or msg.tools
        if continue_final and generation_prompt:
            raise ParamError("continue_final_message", "continue_final_message and add_generation_prompt cannot "
                             "both be true: continuing the last message adds no generation prompt (send "
                             "add_generation_prompt: false)")
        from_request = template is not None
        if from_request:
            if not isinstance(template, str):
                raise ParamError("chat_template", "chat_template must be a string")
            if not self.trust_request_chat_template:
                raise ParamError("chat_template", "this server does not take chat templates from requests (start "
                                 "it with --trust-request-chat-template to allow them); drop chat_template to use "
                                 "the model's")
            if len(template) > self.limits.max_chat_template_chars:
                raise ParamError("chat_template", f"chat_template has {len(template)} characters, more than the "
                                 f"{self.limits.max_chat_template_chars} this server accepts")
        else:
            template = self.chat_template
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ParamError("messages", "this model has no chat template (start the server with --chat-template)")
        try:
            text = render_chat(self.tokenizer, messages, template=template, from_request=from_request,
                               add_generation_prompt=generation_prompt, continue_final_message=continue_final,
                               kwargs=kwargs, tools=tools)
        except RenderError as e:
            raise ParamError(e.param, e.message) from None
        if len(text) > self.max_prompt_chars:
            raise ParamError("messages", f"the chat template rendered {len(text)} characters, more than the "
                             f"{self.max_prompt_chars} this server accepts", ErrorCode.PROMPT_TOO_LONG)
        return text

    def tokenize_request(self, msg: Tokenize) -> Tokenized:
        """Answer a `tokenize` message; raises NoriaError naming the field at fault."""
        if (msg.prompt is None) == (msg.messages is None):
            raise NoriaError(ErrorCode.INVALID_REQUEST, "exactly one of prompt, messages must be given")
        self.check_text_sizes(msg)
        if msg.prompt is not None:
            special = True if msg.add_special_tokens is None else msg.add_special_tokens
            text = msg.prompt
        else:
            special = bool(msg.add_special_tokens)
            text = self.render(msg)
        ids = list(self.tokenizer(text, add_special_tokens=special)["input_ids"])
        strs = list(self.tokenizer.convert_ids_to_tokens(ids)) if msg.return_token_strs else None
        return Tokenized(request_id=msg.request_id, count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                         token_strs=strs)

    def detokenize(self, msg: Detokenize) -> Detokenized:
        """Answer a `detokenize` message: the ids' text, special tokens included (vLLM's)."""
        if len(msg.tokens) > self.max_prompt_chars:
            raise ParamError("tokens", f"{len(msg.tokens)} tokens, more than the {self.max_prompt_chars} this "
                             "server accepts", ErrorCode.PROMPT_TOO_LONG)
        bad = [t for t in msg.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ParamError("tokens", f"token ids out of vocabulary range [0, {self.vocab_size}): {bad[:5]}")
        return Detokenized(request_id=msg.request_id, prompt=self.tokenizer.decode(msg.tokens))


def json_size(value: Any, limit: int) -> int:
    """The characters of every string in a decoded JSON/msgpack value (keys included), and
    one for every other item, so that no field or nesting goes uncounted; counting stops
    once past `limit`. A loop, not recursion: the value may nest thousands deep."""
    total, todo = 0, [value]
    while todo and total <= limit:
        v = todo.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            total += len(v)
            for k, x in v.items():
                total += len(k) if isinstance(k, str) else 1
                todo.append(x)
        elif isinstance(v, list | tuple):
            total += len(v)
            todo.extend(v)
        else:
            total += 1
    return total


def _longest_token(tokenizer: Any) -> int:
    try:
        return max(16, max(len(t) for t in tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):
        return 1024  # a tokenizer without a vocabulary list: a generous bound

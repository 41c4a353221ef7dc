"""What the engine needs of a request, made once for all its samples: token ids,
`EngineSamplingParams`, the indexed stop strings, and how tools and reasoning split its
text. `prepare` touches no frontend state, so a server may run it on another thread.
"""

from __future__ import annotations

import msgspec

from noria.frontend.chat_output import ChatConfig, ChatSetup, chat_setup
from noria.frontend.detokenizer import StopStrings
from noria.frontend.embeddings import (
    CLASSIFY_ON_GENERATE,
    EMBED_ON_GENERATE,
    GENERATE_ON_POOLING,
    Embedder,
)
from noria.frontend.processor import InputProcessor
from noria.protocol.client import Embed, Generate
from noria.protocol.errors import ErrorCode, NoriaError
from noria.protocol.sampling import EngineSamplingParams, SamplingParams


class Prepared:
    """A `Generate` turned into what its engine request is made of (`FrontendCore.prepare`)."""

    __slots__ = ("prompt_ids", "params", "engine_params", "stop", "embed", "chat", "prompt_text")

    def __init__(self, prompt_ids: list[int], params: SamplingParams, engine_params: EngineSamplingParams,
                 stop: StopStrings | None, embed: Embed | None = None) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.engine_params = engine_params
        self.stop = stop
        self.embed = embed  # an `embed` request: it ends with one `Embedding`
        self.chat: ChatSetup | None = None  # tools and reasoning: how its samples' text is split
        self.prompt_text: str | None = None  # `return_prompt_text`: what each sample's first delta carries


def prepare(msg: Generate | Embed, processor: InputProcessor, embedder: Embedder | None,
            chat: ChatConfig) -> Prepared:
    """Validate, template and tokenize `msg`; raises NoriaError naming the problem.
    `embedder`: the engine pools and takes `embed` requests only."""
    if isinstance(msg, Embed):
        if embedder is None:
            raise NoriaError(ErrorCode.INVALID_REQUEST, EMBED_ON_GENERATE if msg.task == "embed" else CLASSIFY_ON_GENERATE)
        ids = embedder.input_ids(processor, msg)
        return Prepared(ids, _EMBED_PARAMS, _EMBED_ENGINE_PARAMS, None, msg)
    if embedder is not None:
        raise NoriaError(ErrorCode.INVALID_REQUEST, GENERATE_ON_POOLING)
    # Sizes first, in time proportional to the request's size: reading the tools (and building
    # the grammar of tool_choice "required") costs more per character.
    processor.check_sizes(msg)
    setup = chat_setup(msg, chat)  # tools checked before the template sees them
    prompt_ids, params = processor.process(msg, sizes_checked=True)
    if setup is not None and setup.structured is not None:  # tool_choice "required" or a named function
        params = msgspec.structs.replace(params, structured_output=setup.structured)
    engine_params = processor.engine_params(params)
    if setup is not None and setup.grammar_after is not None:  # the grammar waits for the reasoning's end
        engine_params = msgspec.structs.replace(engine_params, reasoning_end_token_id=setup.grammar_after)
    prepared = Prepared(prompt_ids, params, engine_params, StopStrings(params.stop) if params.stop else None)
    prepared.chat = setup
    if msg.return_prompt_text:
        # vLLM's echo of a token-id prompt: decoded with its special tokens (BOS included).
        prepared.prompt_text = msg.prompt if msg.prompt is not None else processor.tokenizer.decode(prompt_ids)
    return prepared


# What an `embed` request's engine request carries: it samples nothing, so nothing to say.
_EMBED_PARAMS = SamplingParams(max_tokens=None)
_EMBED_ENGINE_PARAMS = EngineSamplingParams(max_tokens=None)

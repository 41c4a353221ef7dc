"""What a chat request's text becomes: reasoning, content and tool calls.

`ChatConfig` is the server's side (--enable-auto-tool-choice, --tool-call-parser,
--reasoning-parser); `chat_setup` checks a request's tools against it and says what each
of its samples needs (`ChatSetup`); `ChatOutput` is one sample's pipeline, fed the
detokenized text as it comes: the reasoning parser first, then on the content after the
reasoning the tool parser (tool_choice "auto"), or the reader of the constrained output
(tool_choice "required" or a named function).
"""

from __future__ import annotations

from typing import Any

import msgspec

from noria.frontend import tools as tooling
from noria.frontend.reasoning import END as REASONING_END
from noria.frontend.reasoning import ReasoningParser, make_reasoning_parser
from noria.frontend.tool_parsers import PARSERS, NamedParser, RequiredParser, ToolParser
from noria.protocol.client import Generate, ToolCall, ToolCallDelta
from noria.protocol.errors import ParamError
from noria.protocol.structured import MAX_SPEC_CHARS, StructuredOutput, json_problem, spec_text


class ChatConfig(msgspec.Struct, frozen=True, kw_only=True):
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # `</think>` as one token of the vocabulary, where it is one (as in every reasoning model's):
    # a grammar then starts after it (`EngineSamplingParams.reasoning_end_token_id`).
    reasoning_end_token_id: int | None = None


class ChatSetup:
    """A request's tool choice ("auto", "required", "function:NAME") and reasoning parser."""

    __slots__ = ("choice", "parser", "reasoning", "parallel", "template_kwargs", "structured", "grammar_after")

    def __init__(self, choice: str | None, parser: str | None, reasoning: str | None, parallel: bool,
                 template_kwargs: dict[str, Any] | None, structured: StructuredOutput | None,
                 grammar_after: int | None = None) -> None:
        self.grammar_after = grammar_after  # the token after which a grammar holds (the reasoning's end)
        self.choice = choice
        self.parser = parser
        self.reasoning = reasoning
        self.parallel = parallel
        self.template_kwargs = template_kwargs
        self.structured = structured  # the grammar of "required" / a named function

    @property
    def needs_special_tokens(self) -> bool:
        return self.choice == "auto" and self.parser is not None and PARSERS[self.parser].needs_special_tokens

    def sample_output(self) -> ChatOutput | None:
        reasoning = make_reasoning_parser(self.reasoning, self.template_kwargs)
        tools: ToolParser | None = None
        if self.choice == "auto":
            assert self.parser is not None
            tools = PARSERS[self.parser]()
        elif self.choice == "required":
            tools = RequiredParser()
        elif self.choice is not None:
            tools = NamedParser(self.choice.removeprefix("function:"))
        if reasoning is None and tools is None:
            return None
        return ChatOutput(reasoning, tools, single_call=not self.parallel)


def chat_setup(msg: Generate, config: ChatConfig) -> ChatSetup | None:
    """Check the request's tools; None when its text is only content."""
    if msg.messages is None:
        if msg.tools:
            raise ParamError("tools", "tools need chat messages (a `generate` with `messages`)")
        if msg.tool_choice not in (None, "none"):
            raise ParamError("tool_choice", "tool_choice needs chat messages and tools")
        return None
    auto = config.enable_auto_tool_choice and config.tool_call_parser is not None
    choice = tooling.resolve_choice(msg.tools, msg.tool_choice, auto)
    structured = None
    if choice in ("required",) or (choice or "").startswith("function:"):
        if msg.structured_output is not None:
            raise ParamError("tool_choice", f"tool_choice {msg.tool_choice!r} cannot be combined with another "
                                            "output constraint (structured_output, response_format, guided_*)")
        assert msg.tools is not None
        try:
            schema = (tooling.required_schema(msg.tools, msg.parallel_tool_calls) if choice == "required"
                      else tooling.named_schema(msg.tools, choice.removeprefix("function:")))  # type: ignore[union-attr]
        except RecursionError:
            raise ParamError("tools", "a tool's parameters nest too deeply") from None
        # As a request's own schema is checked (protocol/structured.py): JSON data, not too large.
        problem = json_problem(schema)
        if problem is not None:
            raise ParamError("tools", f"a tool's parameters are not a JSON schema: {problem}")
        structured = StructuredOutput(json=schema)
        if len(spec_text(structured)) > MAX_SPEC_CHARS:
            raise ParamError("tools", f"the tools' parameters make a schema larger than {MAX_SPEC_CHARS} characters")
    kwargs = getattr(msg, "chat_template_kwargs", None)
    template_kwargs = kwargs if isinstance(kwargs, dict) else None
    reasoning = config.reasoning_parser
    thinks = make_reasoning_parser(reasoning, template_kwargs) is not None
    constrained = structured is not None or msg.structured_output is not None
    grammar_after = None
    if constrained and thinks:
        if config.reasoning_end_token_id is not None:
            # As vLLM: the reasoning is free, the grammar holds from the token after `</think>`.
            grammar_after = config.reasoning_end_token_id
        elif reasoning == "deepseek_r1":
            # No `</think>` token to start the grammar at: it holds from the first token, and a
            # parser that reads everything before `</think>` as reasoning would take the whole
            # constrained answer for reasoning; so the answer is all content.
            reasoning = None
    if choice is None and reasoning is None:
        return None
    return ChatSetup(choice, config.tool_call_parser, reasoning, msg.parallel_tool_calls, template_kwargs,
                     structured, grammar_after)


def reasoning_end_token(tokenizer: Any) -> int | None:
    """The id of `</think>` if the vocabulary has it as one token."""
    try:
        token_id = tokenizer.get_vocab().get(REASONING_END)
    except (AttributeError, TypeError):
        return None
    return token_id if isinstance(token_id, int) else None


class ChatOutput:
    """One sample's text split into content, reasoning and tool calls as it comes."""

    __slots__ = ("reasoning", "tools", "single_call")

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, single_call: bool) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.single_call = single_call  # parallel_tool_calls false: the first call only

    @property
    def reasoning_ended(self) -> bool:
        return self.reasoning is None or self.reasoning.ended

    def feed(self, text: str, final: bool) -> tuple[str, str, list[ToolCallDelta]]:
        """(content, reasoning, tool-call pieces) of the next `text`; `final`: the sample ended."""
        reasoning = ""
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, final)
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
            if self.single_call:
                calls = [c for c in calls if c.index == 0]
        return content, reasoning, calls

    @property
    def calls(self) -> list[ToolCall]:
        calls = self.tools.calls if self.tools is not None else []
        return calls[:1] if self.single_call else list(calls)

"""Tool-call parsers (`--tool-call-parser`, vLLM's names), one small file each, and the
readers of tool_choice "required" and named-function outputs. Each parser is made per
sample and fed the sample's text as it is detokenized (frontend/chat_output.py)."""

from __future__ import annotations

from noria.frontend.tool_parsers.base import ToolParser, new_call_id
from noria.frontend.tool_parsers.forced import NamedParser, RequiredParser
from noria.frontend.tool_parsers.hermes import HermesParser
from noria.frontend.tool_parsers.llama3_json import Llama3JsonParser
from noria.frontend.tool_parsers.mistral import MistralParser
from noria.frontend.tool_parsers.pythonic import PythonicParser

# --tool-call-parser NAME -> its class (protocol/config.py's ToolCallParserName lists the names)
PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}

__all__ = ["PARSERS", "NamedParser", "RequiredParser", "ToolParser", "new_call_id"]

"""Rendering chat messages through a chat template, with vLLM's controls.

The render is transformers' `apply_chat_template` (a Jinja `ImmutableSandboxedEnvironment`:
no attribute access to Python internals, no mutation of the inputs, `range` capped), with:

* `chat_template_kwargs`: extra template variables (e.g. `enable_thinking`); a key that would
  change the call itself rather than the template (`tokenize`, `return_tensors`, ...) is refused;
* a per-request `chat_template`, or the server's (`--chat-template FILE`, a file or the
  template itself, as vLLM reads it), or the tokenizer's own;
* `continue_final_message`: no generation prompt, the last message left open.

Templates from requests are hostile code, so a render also runs under a deadline: a trace
function watches the template's own frames (Jinja compiles a template to Python code
named "<template>") and ends a render that runs past `RENDER_SECONDS`, however its loops
are written. The sandbox cannot bound one huge builtin operation (a string repeated a
billion times), which is why request templates are refused unless the operator trusts the
clients (`--trust-request-chat-template`, vLLM's flag) and are capped in size.
"""

from __future__ import annotations

import codecs
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

RENDER_SECONDS = 2.0
# apply_chat_template's own parameters that would change what the call returns, not what the
# template sees; a request may not set them through chat_template_kwargs.
RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs", "documents",
})
_TEMPLATE_FILE = "<template>"  # the file name of code that Jinja compiles from a string


class RenderError(Exception):
    """The template could not render these messages; `param` names the field to blame."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class RenderTimeout(Exception):
    pass


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: the contents of a file, or the template itself when no such file
    exists and the text looks like a template (has "{", "}" or a newline; escapes such as
    "\\n" are then read as a shell user wrote them), as vLLM reads it."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value!r} looks like a file path but cannot be read: {e}") from None
        return codecs.decode(value, "unicode_escape")


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The request's `chat_template_kwargs` as template variables; raises RenderError for a
    key that names a parameter of the render call itself."""
    if not kwargs:
        return {}
    bad = sorted(k for k in kwargs if k in RESERVED_KWARGS)
    if bad:
        raise RenderError("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(bad)}: these "
                          "change the render call, not the template's variables")
    return dict(kwargs)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, template: str | None, from_request: bool,
                add_generation_prompt: bool, continue_final_message: bool, kwargs: dict[str, Any],
                tools: list[dict[str, Any]] | None = None, seconds: float = RENDER_SECONDS) -> str:
    """The prompt text; raises RenderError naming the field at fault. `template` None: the
    tokenizer's own; `from_request`: the template came with the request (errors name it)."""
    blame = "chat_template" if from_request else "messages"
    call: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                            "continue_final_message": continue_final_message}
    if tools:
        call["tools"] = tools
    if template is not None:
        call["chat_template"] = template
    try:
        text = within(seconds, lambda: tokenizer.apply_chat_template(messages, tokenize=False, **kwargs, **call))
    except RenderTimeout:
        raise RenderError(blame, f"the chat template ran for more than {seconds:g}s and was stopped") from None
    except RecursionError:
        raise RenderError(blame, "the chat template recursed too deeply") from None
    except Exception as e:  # noqa: BLE001 - whatever a template raises is this request's problem
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:500]
        if continue_final_message and "continue_final_message" in str(e):
            blame = "continue_final_message"
        raise RenderError(blame, f"the chat template failed: {first}") from None
    if not isinstance(text, str):
        raise RenderError(blame, "the chat template did not render to text")
    return text


def within(seconds: float, fn: Callable[[], str]) -> str:
    """`fn()`, stopped with RenderTimeout once a Jinja template's code has run `seconds`.

    Only the template's frames are traced line by line (every loop of a template goes
    through them), so the rest of the call runs untraced; the thread's previous trace
    function (a coverage tool's, a debugger's) is back afterwards."""
    deadline = time.monotonic() + seconds
    lines = 0

    def local(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal lines
        lines += 1
        if not lines & 255 and time.monotonic() > deadline:
            raise RenderTimeout
        return local

    def calls(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        return fn()
    finally:
        sys.settrace(previous)

"""Keeps torch out of the processes that run the frontend alone (`noria serve`, `noria generate`).

The frontend uses transformers for its tokenizer and chat template only, and neither needs
torch; but transformers 5 imports torch whenever it is installed (its config and rope utilities
import it as soon as a tokenizer loads). In `noria serve`'s frontend process that was ~230 MiB
of RSS (torch's libraries, a thousand modules, sympy) of the ~300 MiB the process held, for a
process that runs no model; the model runs in the worker processes.

`sys.modules["torch"] = None` is Python's own way to make a module unimportable:
`importlib.util.find_spec("torch")` answers None, so transformers takes torch for absent and
gives the same tokenizers (they are the `tokenizers` library's, whatever transformers thinks of
torch), and any other `import torch` in the process fails loudly instead of quietly costing the
memory again.

Only a process that runs nothing else may be changed: transformers remembers the answer, so in a
host program (`LLM` inside a user's script, the tests) a later `AutoModel...` would find no
torch. The CLI's frontend commands call it; `LLM` and `start_core` do not.
"""

from __future__ import annotations

import logging
import sys

# transformers' one warning when it finds no torch; here the absence is deliberate.
_TRANSFORMERS_NO_TORCH = "PyTorch was not found"


class _DropNoTorchWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TRANSFORMERS_NO_TORCH)


def keep_torch_out() -> bool:
    """Make torch unimportable in this process; False (and nothing changed) where it is already
    imported."""
    if "torch" in sys.modules:
        return sys.modules["torch"] is None
    sys.modules["torch"] = None  # type: ignore[assignment]
    logging.getLogger("transformers").addFilter(_DropNoTorchWarning())
    return True

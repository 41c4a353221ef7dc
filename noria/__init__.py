"""noria: an LLM inference server built around continuous batching.

Public names only; the logic lives in noria.frontend, noria.scheduler and noria.worker.
The names load lazily: `python -m noria.worker` and `python -m noria.scheduler` import
this package first, and the worker must set its OpenMP settings before torch loads,
while the scheduler must never load torch at all.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "LLM": "noria.frontend.llm",
    "AsyncClient": "noria.frontend.client",
    "Client": "noria.frontend.client",
    "CompletionOutput": "noria.frontend.outputs",
    "RequestOutput": "noria.frontend.outputs",
    "NoriaError": "noria.protocol.errors",
    "SamplingParams": "noria.protocol.sampling",
    "StructuredOutput": "noria.protocol.structured",
}
__all__ = ["LLM", "AsyncClient", "Client", "CompletionOutput", "NoriaError", "RequestOutput", "SamplingParams",
           "StructuredOutput"]

if TYPE_CHECKING:
    from noria.frontend.client import AsyncClient, Client
    from noria.frontend.llm import LLM
    from noria.frontend.outputs import CompletionOutput, RequestOutput
    from noria.protocol.errors import NoriaError
    from noria.protocol.sampling import SamplingParams
    from noria.protocol.structured import StructuredOutput


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'noria' has no attribute {name!r}")

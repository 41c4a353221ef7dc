"""noria: an LLM inference server built around continuous batching.

Public names only; the logic lives in frontend/, scheduler/, worker/.
"""

from frontend.client import AsyncClient, Client
from frontend.llm import LLM
from frontend.outputs import CompletionOutput, RequestOutput
from protocol.errors import NoriaError
from protocol.sampling import SamplingParams

__all__ = ["LLM", "AsyncClient", "Client", "CompletionOutput", "NoriaError", "RequestOutput", "SamplingParams"]

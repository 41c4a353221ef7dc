"""The frontend's side of a pooling engine (`--runner pooling`): `embed` requests in, vectors out.

An `Embed` becomes an engine request like a one-sample `generate` whose prompt is the input;
the scheduler ends it with the pooled hidden state (worker/pooling.py), which is turned here
into what the client gets: the first `dimensions` components (all by default), L2-normalized
(unless the checkpoint's sentence-transformers modules hold no Normalize), as float32 values.
"""

from __future__ import annotations

import numpy as np

from noria.frontend.processor import InputProcessor
from noria.protocol.client import Embed, cache_salt_problem
from noria.protocol.errors import ErrorCode, NoriaError, ParamError
from noria.protocol.pooling import PoolingSpec

GENERATE_ON_POOLING = ("this server runs the pooling runner (--runner pooling): it serves embeddings "
                       "(/v1/embeddings, `embed`), not text generation")
EMBED_ON_GENERATE = ("this server runs the generate runner: it serves text generation, not embeddings "
                     "(start it with --runner pooling for /v1/embeddings)")


class Embedder:
    def __init__(self, spec: PoolingSpec, hidden_size: int | None) -> None:
        self.spec = spec
        self.hidden_size = hidden_size

    def input_ids(self, processor: InputProcessor, msg: Embed) -> list[int]:
        """Check `msg` and tokenize its input; raises NoriaError naming the problem."""
        if (msg.prompt is None) == (msg.prompt_token_ids is None):
            raise NoriaError(ErrorCode.INVALID_REQUEST, "exactly one of prompt, prompt_token_ids must be given")
        if not msg.request_id:
            raise NoriaError(ErrorCode.INVALID_REQUEST, "request_id must be a non-empty string")
        processor.check_priority(msg.priority)
        salt_problem = cache_salt_problem(msg.cache_salt)
        if salt_problem:
            raise ParamError("cache_salt", salt_problem)
        self.check_dimensions(msg.dimensions)
        limit = processor.max_model_len
        if msg.prompt is not None:
            if len(msg.prompt) > processor.max_prompt_chars:
                raise ParamError("prompt", f"input has {len(msg.prompt)} characters, more than the "
                                 f"{processor.max_prompt_chars} this server accepts (max_model_len {limit})",
                                 ErrorCode.PROMPT_TOO_LONG)
            ids = list(processor.tokenizer(msg.prompt)["input_ids"]) if msg.prompt else []
            field = "prompt"
        else:
            assert msg.prompt_token_ids is not None
            ids, field = list(msg.prompt_token_ids), "prompt_token_ids"
        if not ids:
            raise ParamError(field, "input is empty")
        if len(ids) > limit:
            raise ParamError(field, f"input has {len(ids)} tokens but this engine embeds at most {limit} "
                             f"(max_model_len {limit}); send a shorter input", ErrorCode.PROMPT_TOO_LONG)
        bad = [t for t in ids if not 0 <= t < processor.vocab_size]
        if bad:
            raise ParamError(field, f"token ids out of vocabulary range [0, {processor.vocab_size}): {bad[:5]}")
        return ids

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        size = self.hidden_size
        if dimensions < 1 or (size is not None and dimensions > size):
            upper = f"the model's hidden size {size}" if size is not None else "the model's hidden size"
            raise ParamError("dimensions", f"dimensions must be between 1 and {upper}, got {dimensions}")

    def vector(self, pooled: bytes, dimensions: int | None) -> list[float]:
        """The client's embedding of a pooled hidden state (little-endian float32 bytes)."""
        v = np.frombuffer(pooled, dtype="<f4")
        if dimensions is not None:
            v = v[:dimensions]
        v = v.astype(np.float64)
        if self.spec.normalize:
            norm = float(np.linalg.norm(v))
            v = v / max(norm, 1e-12)  # as torch's F.normalize: an all-zero vector stays zero
        return v.astype(np.float32).tolist()

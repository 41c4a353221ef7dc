"""The frontend's side of a pooling engine (`--runner pooling`): `embed` requests in, vectors out.

An `Embed` becomes an engine request like a one-sample `generate` whose prompt is the input;
the scheduler ends it with the pooled hidden state (worker/pooling.py), which is turned here
into what the client gets: the first `dimensions` components (all by default), L2-normalized
(unless the checkpoint's sentence-transformers modules hold no Normalize), as float32 values.

An engine that classifies (protocol/score.py) takes `classify` requests only: a text, or a
cross-encoder pair tokenized as one sequence by the tokenizer's pair encoding (the Qwen3-Reranker
template around it where configured), and answers the label probabilities of its logits.
"""

from __future__ import annotations

import math

import numpy as np
from msgspec import UNSET, UnsetType

from noria.frontend.processor import InputProcessor
from noria.protocol.client import Embed, cache_salt_problem
from noria.protocol.errors import ErrorCode, NoriaError, ParamError
from noria.protocol.pooling import PoolingSpec
from noria.protocol.score import ScoreSpec, pair_texts

GENERATE_ON_POOLING = ("this server runs the pooling runner (--runner pooling): it serves embeddings "
                       "(/v1/embeddings, `embed`) or scores, not text generation")
EMBED_ON_GENERATE = ("this server runs the generate runner: it serves text generation, not embeddings "
                     "(start it with --runner pooling for /v1/embeddings)")
CLASSIFY_ON_GENERATE = ("this server runs the generate runner: it serves text generation, not scores "
                        "(start a sequence-classification model with --runner pooling for /v1/score, "
                        "/v1/rerank and /classify)")
_CLASSIFY_ON_EMBEDDER = ("this server's model embeds: /v1/score, /v1/rerank and /classify need a "
                         "sequence-classification model (a ...ForSequenceClassification checkpoint, or a "
                         "reranker through --hf-overrides)")


class Embedder:
    def __init__(self, spec: PoolingSpec, hidden_size: int | None, score: ScoreSpec | None = None) -> None:
        """`score`: the engine classifies (protocol/score.py) rather than embeds."""
        self.spec = spec
        self.hidden_size = hidden_size
        self.score = score
        self.labels: list[str] | UnsetType = list(score.labels) if score is not None else UNSET

    def input_ids(self, processor: InputProcessor, msg: Embed) -> list[int]:
        """Check `msg` and tokenize its input; raises NoriaError naming the problem."""
        self._check_task(msg)
        if msg.text_pair is not None:
            return self._pair_ids(processor, msg)
        ids = self._embed_ids(processor, msg)
        return self._last_non_pad(ids)

    def _check_task(self, msg: Embed) -> None:
        if msg.task == "classify" and self.score is None:
            raise NoriaError(ErrorCode.INVALID_REQUEST, _CLASSIFY_ON_EMBEDDER)
        if msg.task == "embed" and self.score is not None:
            raise NoriaError(ErrorCode.INVALID_REQUEST, f"this server's model classifies ({self.score.architecture}): "
                             "it serves /v1/score, /v1/rerank, /rerank and /classify, not embeddings")
        if msg.text_pair is not None and (msg.task != "classify" or msg.prompt is None):
            raise ParamError("text_pair", "text_pair goes with a text prompt and task \"classify\"")
        if msg.task == "classify" and msg.dimensions is not None:
            raise ParamError("dimensions", "dimensions applies to embeddings, not scores")

    def _pair_ids(self, processor: InputProcessor, msg: Embed) -> list[int]:
        assert self.score is not None and msg.prompt is not None and msg.text_pair is not None
        self._check_request(processor, msg)
        first, second = pair_texts(self.score, msg.prompt, msg.text_pair)
        limit, chars = processor.max_model_len, len(first) + len(second)
        if chars > processor.max_prompt_chars:
            raise ParamError("prompt", f"the pair has {chars} characters, more than the {processor.max_prompt_chars} "
                             f"this server accepts (max_model_len {limit})", ErrorCode.PROMPT_TOO_LONG)
        # One sequence, as the tokenizer encodes a pair for the checkpoint (its special tokens between).
        ids = self._last_non_pad(list(processor.tokenizer(first, second)["input_ids"]))
        if not ids:
            raise ParamError("prompt", "input is empty")
        if len(ids) > limit:
            raise ParamError("prompt", f"the pair has {len(ids)} tokens but this engine scores at most {limit} "
                             f"(max_model_len {limit}); send shorter texts", ErrorCode.PROMPT_TOO_LONG)
        return ids

    def _last_non_pad(self, ids: list[int]) -> list[int]:
        """A classifier checkpoint scores its last non-pad token (transformers' rule); the causal
        model never lets later positions change it, so the padding after it need not run."""
        pad = self.score.pad_token_id if self.score is not None else None
        if pad is None or not ids or ids[-1] != pad:
            return ids
        end = len(ids)
        while end and ids[end - 1] == pad:
            end -= 1
        return ids[: max(end, 1)]  # all padding: transformers takes position 0

    def _check_request(self, processor: InputProcessor, msg: Embed) -> None:
        if not msg.request_id:
            raise NoriaError(ErrorCode.INVALID_REQUEST, "request_id must be a non-empty string")
        processor.check_priority(msg.priority)
        salt_problem = cache_salt_problem(msg.cache_salt)
        if salt_problem:
            raise ParamError("cache_salt", salt_problem)

    def _embed_ids(self, processor: InputProcessor, msg: Embed) -> list[int]:
        if (msg.prompt is None) == (msg.prompt_token_ids is None):
            raise NoriaError(ErrorCode.INVALID_REQUEST, "exactly one of prompt, prompt_token_ids must be given")
        self._check_request(processor, msg)
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
        """The client's embedding of a pooled hidden state (little-endian float32 bytes), or
        for a classifying engine the label probabilities of its logits."""
        v = np.frombuffer(pooled, dtype="<f4")
        if self.score is not None:
            return self._probabilities(v.astype(np.float64))
        if dimensions is not None:
            v = v[:dimensions]
        v = v.astype(np.float64)
        if self.spec.normalize:
            norm = float(np.linalg.norm(v))
            v = v / max(norm, 1e-12)  # as torch's F.normalize: an all-zero vector stays zero
        return v.astype(np.float32).tolist()

    def _probabilities(self, logits: np.ndarray) -> list[float]:
        """vLLM's classify activation (transformers' loss for the config's problem_type):
        sigmoid for one label or multi-label, softmax over several, none for regression."""
        assert self.score is not None
        if self.score.activation == "sigmoid":
            return [1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x)) for x in logits.tolist()]
        if self.score.activation == "softmax":
            e = np.exp(logits - logits.max())
            return (e / e.sum()).tolist()
        return logits.tolist()

"""Batched token sampling with vLLM semantics.

Order of operations per row (vLLM V1):
raw logprobs (log_softmax of the model's logits) -> allowed_token_ids, bad_words,
logit_bias (worker/logits_processors.py) -> penalties -> min_tokens mask -> greedy
argmax, or temperature -> min_p -> top_k -> top_p -> exponential race.

Seeded requests draw their noise from a generator reseeded for every output
position from (seed, position): the same seed gives the same tokens whatever
else shares the batch, and also after a request is preempted and recomputed.
"""

from __future__ import annotations

import torch

from noria.protocol.client import Logprob
from noria.protocol.sampling import EngineSamplingParams, sample_seed
from noria.worker.fused_kernels import argmax_rows
from noria.worker.logits_processors import apply_processors, make_processors

_MASK64 = (1 << 64) - 1
# Up to this top_k in every row, top-k/top-p take torch.topk's k largest and sort only those,
# not the whole [rows, vocab]; past it a full sort is as cheap.
TOPK_SMALL = 1024


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, output_index: int) -> int:
    """A well-mixed 63-bit seed for the noise of one output position."""
    return _splitmix64((seed & _MASK64) ^ _splitmix64(output_index)) >> 1


class SamplingState:
    """Per-request sampling state that lives as long as the request does."""

    def __init__(
        self,
        params: EngineSamplingParams,
        token_ids: list[int],
        num_prompt_tokens: int,
        eos_token_ids: list[int],
        vocab_size: int,
        device: torch.device,
        sample_index: int = 0,
    ) -> None:
        """`params` may be shared by the samples of one client request: this one's seed
        follows from its `sample_index`."""
        self.params = params
        self.seed = sample_seed(params.seed, sample_index)
        self.greedy = params.temperature < 1e-5
        self.num_outputs = len(token_ids) - num_prompt_tokens
        stop = [] if params.ignore_eos else list(eos_token_ids)
        stop += params.stop_token_ids or []
        # Ids outside the vocabulary cannot be sampled anyway.
        self.min_tokens_stop_ids = sorted({t for t in stop if 0 <= t < vocab_size})
        self.generator: torch.Generator | None = None
        if self.seed is not None:
            self.generator = torch.Generator(device=device)
        self.prompt_mask: torch.Tensor | None = None
        self.output_counts: torch.Tensor | None = None
        if params.has_penalties:
            self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            prompt = [t for t in token_ids[:num_prompt_tokens] if 0 <= t < vocab_size]
            if prompt:
                self.prompt_mask[torch.tensor(prompt, device=device)] = True
            self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            for t in token_ids[num_prompt_tokens:]:
                self.output_counts[t] += 1
        self.processors = make_processors(params, token_ids[num_prompt_tokens:], vocab_size, device)

    @property
    def min_tokens_active(self) -> bool:
        return self.num_outputs < self.params.min_tokens and bool(self.min_tokens_stop_ids)

    def record(self, token_id: int) -> None:
        self.num_outputs += 1
        if self.output_counts is not None:
            self.output_counts[token_id] += 1
        if self.processors is not None:
            self.processors.record(token_id)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # Noise for unseeded requests: one stream, seeded by the engine seed.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, states: list[SamplingState], record: bool = True
    ) -> tuple[list[int], list[Logprob | None] | None]:
        """logits: [B, V] float32, one row per state (may be modified in place).

        Returns the sampled ids and, if any row asked for logprobs, one entry per row.
        Each state's output count is advanced, unless `record` is False (speculative decoding
        records only the tokens it keeps: worker/spec_decode.py).
        """
        logprob_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            raw_logprobs = torch.log_softmax(logits[logprob_rows].float(), dim=-1)
        if any(s.processors is not None for s in states):
            apply_processors(logits, [s.processors for s in states])
        if all(s.greedy and s.output_counts is None and not s.min_tokens_active for s in states):
            tokens = argmax_rows(logits)
        else:
            tokens = self._sample_general(logits, states)
        token_list = self._to_host(tokens)
        if record:
            for state, token in zip(states, token_list, strict=True):
                state.record(token)
        if raw_logprobs is None:
            return token_list, None
        return token_list, self._logprobs(raw_logprobs, logprob_rows, tokens, token_list, states)

    def _to_host(self, tokens: torch.Tensor) -> list[int]:
        """The sampled ids on the host. On CUDA they travel by a non-blocking copy into pinned
        memory and the host waits on that copy's event alone, not on the whole device."""
        if tokens.device.type != "cuda":
            return tokens.tolist()
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        copied.synchronize()
        return host.tolist()

    def _sample_general(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        penalized = [i for i, s in enumerate(states) if s.output_counts is not None]
        if penalized:
            logits[penalized] = apply_penalties(logits[penalized], [states[i] for i in penalized])
        rows, cols = [], []
        for i, s in enumerate(states):
            if s.min_tokens_active:
                rows += [i] * len(s.min_tokens_stop_ids)
                cols += s.min_tokens_stop_ids
        if rows:
            logits[rows, cols] = float("-inf")
        tokens = argmax_rows(logits)
        random_rows = [i for i, s in enumerate(states) if not s.greedy]
        if random_rows:
            tokens[random_rows] = self._sample_random(logits[random_rows], [states[i] for i in random_rows])
        return tokens

    def _sample_random(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        params = [s.params for s in states]
        device = logits.device
        logits = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
        use_top_k = any(p.top_k > 0 and p.top_k < self.vocab_size for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        if use_top_k or use_top_p:
            logits = self._top_k_top_p(logits, params, use_top_k, use_top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(states) if s.generator is None]
        if len(unseeded) == len(states):
            noise.exponential_(generator=self.generator)
        elif unseeded:
            noise[unseeded] = torch.empty(
                (len(unseeded), probs.shape[1]), device=device
            ).exponential_(generator=self.generator)
        for i, s in enumerate(states):
            if s.generator is not None:
                assert s.seed is not None
                s.generator.manual_seed(step_seed(s.seed, s.num_outputs))
                noise[i].exponential_(generator=s.generator)
        # Exponential race: argmax p_i / E_i picks i with probability p_i. A zero
        # draw would turn a masked 0/0 into NaN, so keep the noise positive.
        return (probs / noise.clamp_min_(1e-30)).argmax(dim=-1)

    def _top_k_top_p(
        self, logits: torch.Tensor, params: list[EngineSamplingParams], use_top_k: bool, use_top_p: bool
    ) -> torch.Tensor:
        """`logits` with every token outside each row's top-k and top-p set to -inf."""
        k_max = max((p.top_k for p in params), default=0)
        if use_top_k and all(p.top_k > 0 for p in params) and k_max <= min(TOPK_SMALL, logits.shape[1]):
            # Every row keeps at most k_max tokens: only those are sorted (topk returns them sorted).
            top, order = logits.topk(k_max, dim=-1)
            top = self._mask_sorted(top, params, True, use_top_p)
            return torch.full_like(logits, float("-inf")).scatter_(-1, order, top)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_logits = self._mask_sorted(sorted_logits, params, use_top_k, use_top_p)
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    def _mask_sorted(
        self, sorted_logits: torch.Tensor, params: list[EngineSamplingParams], use_top_k: bool, use_top_p: bool
    ) -> torch.Tensor:
        """Rows sorted in descending order, each a prefix of its row's sorted logits: the ranks
        past top_k and the tail past top_p's mass set to -inf, in place."""
        device = sorted_logits.device
        if use_top_k:
            k = torch.tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in params], device=device)
            ranks = torch.arange(sorted_logits.shape[1], device=device)
            sorted_logits.masked_fill_(ranks[None, :] >= k[:, None], float("-inf"))
        if use_top_p:
            # Keep the smallest prefix whose mass reaches top_p: drop a token when
            # the mass strictly before it already does. top_p == 1 keeps all.
            top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device)
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            sorted_logits.masked_fill_(mass_before >= top_p[:, None], float("-inf"))
        return sorted_logits

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, rows: list[int], tokens: torch.Tensor, token_list: list[int], states: list[SamplingState]
    ) -> list[Logprob | None]:
        sampled = raw.gather(1, tokens[rows][:, None])[:, 0].tolist()
        k_max = max(states[i].params.logprobs or 0 for i in rows)
        top_values: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if k_max > 0:
            values, ids = raw.topk(k_max, dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        out: list[Logprob | None] = [None] * len(states)
        for j, i in enumerate(rows):
            k = states[i].params.logprobs or 0
            out[i] = Logprob(
                token_id=token_list[i],
                logprob=sampled[j],
                top_token_ids=top_ids[j][:k],
                top_logprobs=top_values[j][:k],
            )
        return out


def apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt + output tokens (divide positive
    logits, multiply negative ones), then frequency and presence over outputs."""
    counts = torch.stack([s.output_counts for s in states])  # type: ignore[misc]
    prompt_mask = torch.stack([s.prompt_mask for s in states])  # type: ignore[misc]
    device = logits.device
    rep = torch.tensor([s.params.repetition_penalty for s in states], device=device)[:, None]
    freq = torch.tensor([s.params.frequency_penalty for s in states], device=device)[:, None]
    pres = torch.tensor([s.params.presence_penalty for s in states], device=device)[:, None]
    output_mask = counts > 0
    seen = prompt_mask | output_mask
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - freq * counts - pres * output_mask

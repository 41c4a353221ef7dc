"""Engine configuration shared by every process (sent to children as JSON)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

# Accepted spellings, as vLLM accepts them; the worker maps them to torch dtypes.
Dtype = Literal["auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32"]
Device = Literal["auto", "cpu", "cuda"]
PreemptionMode = Literal["recompute", "swap"]
BlockSize = Literal[8, 16, 32, 64, 128]
AtLeastOne = Annotated[int, Meta(ge=1)]
GiB = Annotated[float, Meta(ge=0.0)]


class EngineConfig(msgspec.Struct, kw_only=True):
    """Engine flags; names follow vLLM's CLI flags in snake_case.

    The types are the rules: `make_config` (and every child process decoding its
    `--config`) checks them through msgspec. The constructor checks nothing, so
    tests can build configs directly. Secrets (the API key) are not engine flags:
    this Struct travels to every child process on its command line.
    """

    model: str = "demo"
    tokenizer: str | None = None
    dtype: Dtype = "auto"
    device: Device = "auto"
    seed: int = 0
    block_size: BlockSize = 16
    max_num_seqs: AtLeastOne = 256
    max_num_batched_tokens: AtLeastOne | None = None
    max_model_len: AtLeastOne | None = None
    num_kv_blocks: AtLeastOne | None = None  # override the computed number of device KV blocks
    kv_cache_memory: Annotated[float, Meta(gt=0.0)] | None = None  # GiB for the device KV cache; None = computed
    swap_space: GiB = 4.0  # GiB of CPU memory for swapped KV blocks
    preemption_mode: PreemptionMode = "recompute"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: AtLeastOne = 1
    num_threads: AtLeastOne | None = None  # torch intra-op threads in the worker
    startup_timeout: Annotated[float, Meta(gt=0.0)] = 300.0

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return 2048
        return max(max_model_len, 2048)


class EngineAddresses(msgspec.Struct, kw_only=True):
    """Where each link lives; the scheduler binds all four, the others connect."""

    requests: str  # frontend -> scheduler (PUSH -> PULL)
    outputs: str  # scheduler -> frontend (PUSH -> PULL)
    plans: list[str]  # scheduler -> worker rank i (PUSH -> PULL), one per rank
    results: str  # workers -> scheduler (PUSH -> PULL)

"""Engine configuration shared by every process (sent to children as msgpack)."""

from __future__ import annotations

import msgspec


class EngineConfig(msgspec.Struct, kw_only=True):
    """Engine flags; names follow vLLM's CLI flags in snake_case."""

    model: str = "demo"
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory: float | None = None  # GiB for the device KV cache; None = computed
    swap_space: float = 4.0  # GiB of CPU memory for swapped KV blocks
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    api_key: str | None = None
    num_threads: int | None = None  # torch intra-op threads in the worker
    startup_timeout: float = 300.0

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return 2048
        return max(max_model_len, 2048)


def config_error(c: EngineConfig) -> str | None:
    checks = [
        (c.block_size in (8, 16, 32, 64, 128), f"block_size must be one of 8, 16, 32, 64, 128, got {c.block_size}"),
        (c.max_num_seqs >= 1, "max_num_seqs must be at least 1"),
        (c.max_num_batched_tokens is None or c.max_num_batched_tokens >= 1, "max_num_batched_tokens must be at least 1"),
        (c.num_kv_blocks is None or c.num_kv_blocks >= 1, "num_kv_blocks must be at least 1"),
        (c.preemption_mode in ("recompute", "swap"), f"preemption_mode must be recompute or swap, got {c.preemption_mode}"),
        (c.swap_space >= 0, "swap_space must be non-negative"),
        (c.tensor_parallel_size >= 1, "tensor_parallel_size must be at least 1"),
        (c.dtype in ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32"), f"unknown dtype {c.dtype}"),
        (c.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {c.device}"),
    ]
    for ok, message in checks:
        if not ok:
            return message
    return None


class EngineAddresses(msgspec.Struct, kw_only=True):
    """Where each link lives; the scheduler binds all four, the others connect."""

    requests: str  # frontend -> scheduler (PUSH -> PULL)
    outputs: str  # scheduler -> frontend (PUSH -> PULL)
    plans: list[str]  # scheduler -> worker rank i (PUSH -> PULL), one per rank
    results: str  # workers -> scheduler (PUSH -> PULL)

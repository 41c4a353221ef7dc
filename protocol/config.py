"""Engine configuration shared by every process (sent to children as JSON)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from noria.protocol.kv_events import KVEventsConfig
from noria.protocol.kv_transfer import KVTransferConfig
from noria.protocol.pooling import PoolingType, Runner
from noria.protocol.speculative import SpeculativeConfig

# Accepted spellings, as vLLM accepts them; the worker maps them to torch dtypes.
Dtype = Literal["auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32"]
Device = Literal["auto", "cpu", "cuda"]
PreemptionMode = Literal["recompute", "swap"]
SchedulingPolicy = Literal["fcfs", "priority"]  # vLLM's --scheduling-policy
BlockSize = Literal[8, 16, 32, 64, 128]
# auto: the CUDA kernels where they work, else torch (said once at start-up); kernels: refuse
# to start without them; torch: never the kernels.
AttentionBackendChoice = Literal["auto", "kernels", "torch"]
# Chat output parsers (frontend/tool_parsers/, frontend/reasoning.py), vLLM's names.
ToolCallParserName = Literal["hermes", "llama3_json", "mistral", "pythonic"]
ReasoningParserName = Literal["qwen3", "deepseek_r1"]
GenerationConfigMode = Literal["auto", "vllm", "none"]  # vLLM's --generation-config
QuantizationChoice = Literal["fp8"]  # vLLM's --quantization: weights quantized at load
KvCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]  # vLLM's --kv-cache-dtype
LoadFormat = Literal["auto", "dummy"]  # vLLM's --load-format
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
    # Share of the GPU's memory the worker may use in all (weights, activations, KV cache);
    # the KV cache takes what the profiling pass leaves of it (worker/kv_cache.py). Unused on a CPU.
    gpu_memory_utilization: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.9
    attention_backend: AttentionBackendChoice = "auto"
    # Online quantization of a float checkpoint's linear weights at load (vLLM's --quantization);
    # None: the checkpoint's own quantization_config, if any, else float weights.
    quantization: QuantizationChoice | None = None
    # auto: the KV cache in the model's dtype; fp8 (= fp8_e4m3): one byte per value with a scale
    # per layer (the checkpoint's where it has them, else 1.0), as vLLM stores it.
    kv_cache_dtype: KvCacheDtype = "auto"
    # auto: the checkpoint's weights; dummy: config.json alone, seeded random weights made on the
    # device (worker/dummy_weights.py), for benchmarks that must not read a 16 GB checkpoint.
    load_format: LoadFormat = "auto"
    swap_space: GiB = 4.0  # GiB of CPU memory for swapped KV blocks
    preemption_mode: PreemptionMode = "recompute"
    # fcfs: arrival order, a request's `priority` is refused; priority: lower `priority` first,
    # then arrival (the frontend refuses a non-zero priority under fcfs, the scheduler ignores it).
    scheduling_policy: SchedulingPolicy = "fcfs"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Plan step N+1 while the worker runs step N (scheduler/process.py); on by default, as in
    # vLLM: it hides the engine's per-step work (bench/RESULTS.md, "Async scheduling").
    async_scheduling: bool = True
    tensor_parallel_size: AtLeastOne = 1
    # vLLM's data parallelism: `data_parallel_size` engines (a scheduler and its workers each)
    # behind one frontend, which routes each request (frontend/engine_group.py). With
    # `data_parallel_rank` given, this server is that one rank of the size, balanced from outside
    # (a router addresses each rank itself); within a group each engine gets its rank.
    data_parallel_size: AtLeastOne = 1
    data_parallel_rank: Annotated[int, Meta(ge=0)] | None = None
    num_threads: AtLeastOne | None = None  # torch intra-op threads in the worker
    # Decode steps replay CUDA graphs captured at start-up (worker/cuda_graphs.py); True: always eager.
    enforce_eager: bool = False
    # Batch sizes to capture; None: 1, 2, 4, 8 and every multiple of 8 up to max_num_seqs.
    cuda_graph_sizes: list[AtLeastOne] | None = None
    startup_timeout: Annotated[float, Meta(gt=0.0)] = 300.0
    # generate: text generation; pooling: one embedding per prompt (/v1/embeddings), no sampling.
    runner: Runner = "generate"
    # How a pooling engine pools; None: the checkpoint's sentence-transformers files, else the
    # last token (protocol/pooling.py). Resolved once when the engine starts.
    pooling: PoolingType | None = None
    # vLLM's --hf-overrides: config.json keys that say how a pooling engine classifies (a causal
    # LM scored by two tokens' logits, the Qwen3-Reranker way: protocol/score.py).
    hf_overrides: dict[str, Any] | None = None
    # Chat (read by the frontend): tool_choice "auto" needs both of the first two; the
    # reasoning parser moves <think>...</think> text into `reasoning_content`.
    enable_auto_tool_choice: bool = False
    tool_call_parser: ToolCallParserName | None = None
    reasoning_parser: ReasoningParserName | None = None
    # The chat template instead of the tokenizer's: a file, or the template itself (vLLM's
    # --chat-template); read by the frontend at start-up (frontend/chat_template.py).
    chat_template: str | None = None
    # Requests may bring their own `chat_template` (vLLM's flag): off, templates are code.
    trust_request_chat_template: bool = False
    # Sampling defaults for requests that leave them unset (frontend/generation_config.py): auto,
    # the checkpoint's generation_config.json; vllm and none, vLLM's defaults.
    generation_config: GenerationConfigMode = "auto"
    # vLLM's --kv-events-config: the scheduler publishes prefix-cache changes for routers
    # (protocol/kv_events.py, scheduler/kv_events.py).
    kv_events_config: KVEventsConfig | None = None
    # vLLM's --kv-transfer-config: this engine computes prompts for others (kv_producer), pulls
    # the blocks of prompts computed elsewhere (kv_consumer), or both (protocol/kv_transfer.py).
    kv_transfer_config: KVTransferConfig | None = None
    # vLLM's --speculative-config: the scheduler proposes tokens, the worker verifies them in one
    # pass (protocol/speculative.py); None: one token per request per step.
    speculative_config: SpeculativeConfig | None = None

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return 2048
        return max(max_model_len, 2048)


class EngineAddresses(msgspec.Struct, kw_only=True):
    """Where each link lives; the scheduler binds all three, the others connect."""

    requests: str  # frontend -> scheduler (PUSH -> PULL)
    outputs: str  # scheduler -> frontend (PUSH -> PULL)
    workers: str  # every worker rank's DEALER -> the scheduler's one ROUTER (protocol/worker_link.py)


Seconds = Annotated[float, Meta(gt=0.0)]


class WorkerLinkConfig(msgspec.Struct, kw_only=True):
    """How `noria serve` runs its worker link: `noria serve`'s worker flags in snake_case.

    The scheduler gets it as JSON on its command line (it uses `worker_timeout`,
    `worker_wait`, `curve_keys` and whether local workers start with it); the launcher
    uses the rest. No secret is in it: `curve_keys` is a folder name.
    """

    worker_listen: str | None = None  # tcp://HOST:PORT for remote workers; None: ipc:// in a private folder
    num_local_workers: Annotated[int, Meta(ge=0)] | None = None  # None: tensor_parallel_size, or 0 with worker_listen
    worker_timeout: Seconds = 5.0  # a worker (or the scheduler) silent this long is lost
    worker_wait: Seconds = 30.0  # without a live worker group this long, waiting requests fail
    max_worker_restarts: Annotated[int, Meta(ge=0)] = 5  # per rank per RESTART_WINDOW seconds
    curve_keys: str | None = None  # CURVE key folder (`noria keygen`); None: no encryption
    insecure: bool = False  # allow worker_listen on a network address without curve_keys

    def local_workers(self, tensor_parallel_size: int) -> int:
        if self.num_local_workers is not None:
            return self.num_local_workers
        return 0 if self.worker_listen else tensor_parallel_size


RESTART_WINDOW = 60.0
"""Seconds over which `max_worker_restarts` counts a local rank's restarts."""

"""The template instances noria compiles: which kernels, for which dtypes, head sizes and
block sizes, grouped into modules (one RawModule per source and configuration)."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES: dict[str, str] = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 128, 256)
BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128)
SLOT_TYPES: dict[str, str] = {"int32": "int", "int64": "long long"}
COPY_UNITS: dict[int, str] = {16: "uint4", 4: "unsigned int"}

CACHE_OPS = "cache_ops.cu"
DECODE = "decode_attention.cu"
DECODE_GQA = "decode_attention_gqa.cu"
PREFILL = "prefill_attention.cu"
PREFILL_TC = "prefill_attention_tc.cu"
FUSED = "fused_ops.cu"
SOURCES: tuple[str, ...] = (CACHE_OPS, DECODE, DECODE_GQA, PREFILL, PREFILL_TC, FUSED)
# Dtypes whose decode runs on tensor cores (decode_attention_gqa.cu); float32 keeps the
# CUDA-core kernel (decode_attention.cu).
TENSOR_CORE_DTYPES: tuple[str, ...] = ("float16", "bfloat16")


@dataclass(frozen=True)
class AttentionConfig:
    dtype: str  # a key of DTYPES
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; one of {sorted(DTYPES)}")
        if self.head_dim not in HEAD_SIZES:
            raise ValueError(f"unsupported head size {self.head_dim}; one of {HEAD_SIZES}")
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"unsupported block size {self.block_size}; one of {BLOCK_SIZES}")

    @property
    def ctype(self) -> str:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class ModuleSpec:
    """One compiled module: a source file and the name expressions instantiated from it."""

    source: str
    names: tuple[str, ...]


def decode_name(cfg: AttentionConfig) -> str:
    return f"paged_attention_decode<{cfg.ctype}, {cfg.head_dim}, {cfg.block_size}>"


def reduce_name(cfg: AttentionConfig) -> str:
    return f"paged_attention_reduce<{cfg.ctype}, {cfg.head_dim}>"


def decode_gqa_name(cfg: AttentionConfig) -> str:
    return f"paged_attention_decode_gqa<{cfg.ctype}, {cfg.head_dim}, {cfg.block_size}>"


def decode_gqa_merge_name(cfg: AttentionConfig) -> str:
    return f"paged_attention_decode_gqa_merge<{cfg.ctype}, {cfg.head_dim}>"


def uses_gqa_decode(cfg: AttentionConfig) -> bool:
    return cfg.dtype in TENSOR_CORE_DTYPES


def prefill_name(cfg: AttentionConfig) -> str:
    return f"paged_attention_prefill<{cfg.ctype}, {cfg.head_dim}, {cfg.block_size}>"


def prefill_tc_name(cfg: AttentionConfig) -> str:
    return f"paged_attention_prefill_tc<{cfg.ctype}, {cfg.head_dim}, {cfg.block_size}>"


def uses_tc_prefill(cfg: AttentionConfig) -> bool:
    """16-bit prefill runs on tensor cores (prefill_attention_tc.cu, every head size and block
    size); float32 keeps the CUDA-core kernel (prefill_attention.cu)."""
    return cfg.dtype in TENSOR_CORE_DTYPES


def reshape_name(dtype: str, slot_type: str) -> str:
    return f"reshape_and_cache<{DTYPES[dtype]}, {SLOT_TYPES[slot_type]}>"


def copy_name(unit_bytes: int) -> str:
    return f"copy_blocks<{COPY_UNITS[unit_bytes]}>"


def decode_module(cfg: AttentionConfig) -> ModuleSpec:
    """The decode kernels of a configuration: the tensor-core GQA kernel and its merge for
    16-bit dtypes, the CUDA-core kernel and its split-K reduce for float32."""
    if uses_gqa_decode(cfg):
        return ModuleSpec(DECODE_GQA, (decode_gqa_name(cfg), decode_gqa_merge_name(cfg)))
    return ModuleSpec(DECODE, (decode_name(cfg), reduce_name(cfg)))


def prefill_module(cfg: AttentionConfig) -> ModuleSpec:
    if uses_tc_prefill(cfg):
        return ModuleSpec(PREFILL_TC, (prefill_tc_name(cfg),))
    return ModuleSpec(PREFILL, (prefill_name(cfg),))


def reshape_module(dtype: str) -> ModuleSpec:
    return ModuleSpec(CACHE_OPS, tuple(reshape_name(dtype, s) for s in SLOT_TYPES))


def copy_module() -> ModuleSpec:
    return ModuleSpec(CACHE_OPS, tuple(copy_name(u) for u in COPY_UNITS))


def fused_vec(dtype: str) -> int:
    """Elements per 16-byte access of the fused elementwise kernels (their aligned instance)."""
    return 16 // {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]


def add_rms_norm_name(dtype: str, vec: int) -> str:
    return f"fused_add_rms_norm<{DTYPES[dtype]}, {vec}>"


def silu_and_mul_name(dtype: str, vec: int) -> str:
    return f"silu_and_mul<{DTYPES[dtype]}, {vec}>"


def rotary_name(dtype: str, slot_type: str) -> str:
    return f"rotary_qkv_cache<{DTYPES[dtype]}, {SLOT_TYPES[slot_type]}>"


def fused_module(dtype: str) -> ModuleSpec:
    """A dtype's fused elementwise kernels: residual add + RMSNorm and SiLU-and-mul, each
    with 16-byte and one-element accesses; rotary + KV-cache write per slot type."""
    vecs = (fused_vec(dtype), 1)
    return ModuleSpec(
        FUSED,
        (
            *(add_rms_norm_name(dtype, v) for v in vecs),
            *(silu_and_mul_name(dtype, v) for v in vecs),
            *(rotary_name(dtype, s) for s in SLOT_TYPES),
        ),
    )


def all_configs() -> list[AttentionConfig]:
    return [AttentionConfig(d, h, b) for d in DTYPES for h in HEAD_SIZES for b in BLOCK_SIZES]


def all_instances() -> dict[str, tuple[str, ...]]:
    """Every name expression of every source, for the compile check."""
    out: dict[str, list[str]] = {s: [] for s in SOURCES}
    for cfg in all_configs():
        for spec in (decode_module(cfg), prefill_module(cfg)):
            out[spec.source].extend(n for n in spec.names if n not in out[spec.source])
    for spec in (*(reshape_module(d) for d in DTYPES), copy_module(), *(fused_module(d) for d in DTYPES)):
        out[spec.source].extend(n for n in spec.names if n not in out[spec.source])
    return {s: tuple(v) for s, v in out.items()}

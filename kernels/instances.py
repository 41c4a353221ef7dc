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
GEMM_W4A16 = "gemm_w4a16.cu"
SOURCES: tuple[str, ...] = (CACHE_OPS, DECODE, DECODE_GQA, PREFILL, PREFILL_TC, FUSED, GEMM_W4A16)
# Dtypes whose decode runs on tensor cores (decode_attention_gqa.cu); float32 keeps the
# CUDA-core kernel (decode_attention.cu).
TENSOR_CORE_DTYPES: tuple[str, ...] = ("float16", "bfloat16")
# The fp8 (e4m3) KV cache's element type in the kernels (csrc/fp8.cuh: noria::fp8_e4m3).
FP8_CTYPE = "unsigned char"
# Attention over an fp8 cache is built for the tensor-core kernels (16-bit queries) only, for
# the common head sizes and block sizes (few instances: each adds to every compile check); a
# layer outside them keeps its fp8 cache on the torch backend.
FP8_HEAD_SIZES: tuple[int, ...] = (64, 128)
FP8_BLOCK_SIZES: tuple[int, ...] = (16, 32)


def fp8_unsupported(dtype: str, head_dim: int, block_size: int) -> str | None:
    """Why attention over an fp8 cache has no instance for these, or None."""
    if dtype not in TENSOR_CORE_DTYPES:
        return f"{dtype} queries over an fp8 KV cache (kernels: {', '.join(TENSOR_CORE_DTYPES)})"
    if head_dim not in FP8_HEAD_SIZES:
        return f"head size {head_dim} with an fp8 KV cache (kernels: {', '.join(map(str, FP8_HEAD_SIZES))})"
    if block_size not in FP8_BLOCK_SIZES:
        return f"block size {block_size} with an fp8 KV cache (kernels: {', '.join(map(str, FP8_BLOCK_SIZES))})"
    return None


@dataclass(frozen=True)
class AttentionConfig:
    dtype: str  # a key of DTYPES: the queries' and outputs' (and a 16-bit cache's) type
    head_dim: int
    block_size: int
    kv_fp8: bool = False  # the KV cache holds e4m3 bytes with per-layer K / V scales

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; one of {sorted(DTYPES)}")
        if self.head_dim not in HEAD_SIZES:
            raise ValueError(f"unsupported head size {self.head_dim}; one of {HEAD_SIZES}")
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"unsupported block size {self.block_size}; one of {BLOCK_SIZES}")
        if self.kv_fp8 and fp8_unsupported(self.dtype, self.head_dim, self.block_size):
            raise ValueError(f"no fp8 KV cache instance: {fp8_unsupported(self.dtype, self.head_dim, self.block_size)}")

    @property
    def ctype(self) -> str:
        return DTYPES[self.dtype]

    @property
    def cache_arg(self) -> str:
        """The cache type's template argument where it is not the query type's default."""
        return f", {FP8_CTYPE}" if self.kv_fp8 else ""


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
    return f"paged_attention_decode_gqa<{cfg.ctype}, {cfg.head_dim}, {cfg.block_size}{cfg.cache_arg}>"


def decode_gqa_merge_name(cfg: AttentionConfig) -> str:
    return f"paged_attention_decode_gqa_merge<{cfg.ctype}, {cfg.head_dim}>"


def uses_gqa_decode(cfg: AttentionConfig) -> bool:
    return cfg.dtype in TENSOR_CORE_DTYPES


def prefill_name(cfg: AttentionConfig) -> str:
    return f"paged_attention_prefill<{cfg.ctype}, {cfg.head_dim}, {cfg.block_size}>"


def prefill_tc_name(cfg: AttentionConfig) -> str:
    return f"paged_attention_prefill_tc<{cfg.ctype}, {cfg.head_dim}, {cfg.block_size}{cfg.cache_arg}>"


def uses_tc_prefill(cfg: AttentionConfig) -> bool:
    """16-bit prefill runs on tensor cores (prefill_attention_tc.cu, every head size and block
    size); float32 keeps the CUDA-core kernel (prefill_attention.cu)."""
    return cfg.dtype in TENSOR_CORE_DTYPES


def reshape_name(dtype: str, slot_type: str, kv_fp8: bool = False) -> str:
    cache = f", {FP8_CTYPE}" if kv_fp8 else ""
    return f"reshape_and_cache<{DTYPES[dtype]}, {SLOT_TYPES[slot_type]}{cache}>"


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


def reshape_module(dtype: str, kv_fp8: bool = False) -> ModuleSpec:
    return ModuleSpec(CACHE_OPS, tuple(reshape_name(dtype, s, kv_fp8) for s in SLOT_TYPES))


def copy_module() -> ModuleSpec:
    return ModuleSpec(CACHE_OPS, tuple(copy_name(u) for u in COPY_UNITS))


def fused_vec(dtype: str) -> int:
    """Elements per 16-byte access of the fused elementwise kernels (their aligned instance)."""
    return 16 // {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]


def add_rms_norm_name(dtype: str, vec: int) -> str:
    return f"fused_add_rms_norm<{DTYPES[dtype]}, {vec}>"


def silu_and_mul_name(dtype: str, vec: int) -> str:
    return f"silu_and_mul<{DTYPES[dtype]}, {vec}>"


def rotary_name(dtype: str, slot_type: str, kv_fp8: bool = False) -> str:
    cache = f", {FP8_CTYPE}" if kv_fp8 else ""
    return f"rotary_qkv_cache<{DTYPES[dtype]}, {SLOT_TYPES[slot_type]}{cache}>"


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


def rotary_fp8_module(dtype: str) -> ModuleSpec:
    """Rotary + the write into an fp8 KV cache, per slot type: a module of its own, so that a
    model with a 16-bit cache compiles none of it."""
    return ModuleSpec(FUSED, tuple(rotary_name(dtype, s, True) for s in SLOT_TYPES))


# Row tiles (16 rows each) of the tensor-core W4A16 GEMM: one for decode (M <= 16), four for
# prefill, where each weight word loaded feeds four times the mma's.
W4A16_M_TILES: tuple[int, ...] = (1, 4)


def gemm_w4a16_tc_name(dtype: str, m_tiles: int) -> str:
    return f"gemm_w4a16_tc<{DTYPES[dtype]}, {m_tiles}>"


def gemm_w4a16_simt_name(dtype: str) -> str:
    return f"gemm_w4a16_simt<{DTYPES[dtype]}>"


def gemm_w4a16_reduce_name(dtype: str) -> str:
    return f"gemm_w4a16_reduce<{DTYPES[dtype]}>"


def gemm_w4a16_module(dtype: str) -> ModuleSpec:
    """A dtype's W4A16 GEMMs: tensor cores for 16-bit activations, CUDA cores for float32; the
    split-K reduce."""
    if dtype in TENSOR_CORE_DTYPES:
        main = tuple(gemm_w4a16_tc_name(dtype, t) for t in W4A16_M_TILES)
    else:
        main = (gemm_w4a16_simt_name(dtype),)
    return ModuleSpec(GEMM_W4A16, (*main, gemm_w4a16_reduce_name(dtype)))


def all_configs() -> list[AttentionConfig]:
    return [AttentionConfig(d, h, b) for d in DTYPES for h in HEAD_SIZES for b in BLOCK_SIZES]


def fp8_configs() -> list[AttentionConfig]:
    """The attention configurations with an fp8 KV cache."""
    return [AttentionConfig(d, h, b, kv_fp8=True) for d in TENSOR_CORE_DTYPES for h in FP8_HEAD_SIZES
            for b in FP8_BLOCK_SIZES]


def all_instances() -> dict[str, tuple[str, ...]]:
    """Every name expression of every source, for the compile check."""
    out: dict[str, list[str]] = {s: [] for s in SOURCES}
    for cfg in (*all_configs(), *fp8_configs()):
        for spec in (decode_module(cfg), prefill_module(cfg)):
            out[spec.source].extend(n for n in spec.names if n not in out[spec.source])
    for spec in (*(reshape_module(d) for d in DTYPES), copy_module(), *(fused_module(d) for d in DTYPES),
                 *(reshape_module(d, True) for d in TENSOR_CORE_DTYPES),
                 *(rotary_fp8_module(d) for d in TENSOR_CORE_DTYPES),
                 *(gemm_w4a16_module(d) for d in DTYPES)):
        out[spec.source].extend(n for n in spec.names if n not in out[spec.source])
    return {s: tuple(v) for s, v in out.items()}

"""compressed-tensors' `kv_cache_scheme`: the KV cache quantization a checkpoint was calibrated for.

It says how the checkpoint's k/v scales were made (llm-compressor stores them as
`self_attn.k_scale` / `v_scale` or `k_proj.output_scale` / `v_proj.output_scale`, which the worker
reads: worker/kv_fp8.py). noria accepts the form vLLM's CompressedTensorsKVCacheMethod accepts:
float values of 8 bits with one scale per tensor, symmetric; the cache itself is fp8 only with
--kv-cache-dtype fp8, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_kv_cache_scheme(scheme: Any) -> None:
    """ValueError (one sentence naming the field) for a scheme noria does not read."""
    if not isinstance(scheme, Mapping):
        raise ValueError("compressed-tensors kv_cache_scheme is not a JSON object")
    kind, bits, strategy = scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy")
    # compressed-tensors' QuantizationArgs default: symmetric unless it says otherwise.
    symmetric = scheme.get("symmetric", True)
    if kind != "float" or bits != 8 or strategy != "tensor" or not symmetric:
        raise ValueError(
            f"compressed-tensors kv_cache_scheme (type {kind!r}, num_bits {bits!r}, strategy {strategy!r}, "
            f"symmetric {symmetric!r}) is not supported: noria reads the fp8 KV cache scales vLLM reads, "
            "float 8-bit, strategy 'tensor', symmetric")

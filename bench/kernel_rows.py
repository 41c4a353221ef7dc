"""The rows `noria bench kernels` adds beside its own on request: a mixed step (one prompt chunk
beside many decodes) against its two parts run apart, and the same decode and prefill shapes on
torch's attention (SDPA's flash and cuDNN backends, torch's varlen FlashAttention, and the
`flash_attn` package's paged / varlen API where it is importable).

The others read dense K/V ([seqs, kv_heads, context, head] for SDPA, packed tokens for varlen)
where noria's kernels read a paged cache with shuffled blocks; each row counts the same bytes
and FLOPs as noria's row of that shape, so GB/s and TFLOP/s compare directly. A backend that
cannot take a shape (no GQA, no such dtype, not on this device) gives a row with its reason
instead of a figure. Only the arguments torch 2.11 has are passed (the GPU machine's torch).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from noria.kernels import ops
from noria.kernels.device_info import prefill_flops, time_on
from noria.kernels.instances import AttentionConfig
from noria.kernels.scenes import TORCH_DTYPES


def parse_mixed(text: str) -> tuple[int, int, int]:
    """'P+NxC' -> (prompt chunk P, N decodes, their context C)."""
    chunk, _, rest = text.partition("+")
    decodes, _, context = rest.partition("x")
    try:
        return int(chunk), int(decodes), int(context)
    except ValueError:
        raise ValueError(f"--mixed takes P+NxC (a P-token chunk beside N decodes of context C), not {text!r}") from None


def _paged(lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
           dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables, seq_lens) for sequences of `lens` tokens, blocks shuffled."""
    per = [-(-n // block_size) for n in lens]
    shape = (sum(per), block_size, kv_heads, head_dim)
    k = torch.randn(shape, dtype=dtype, device=dev)
    v = torch.randn(shape, dtype=dtype, device=dev)
    perm = torch.randperm(shape[0], device=dev).to(torch.int32)
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32, device=dev)
    first = 0
    for s, n in enumerate(per):
        tables[s, :n] = perm[first:first + n]
        first += n
    return k, v, tables, torch.tensor(lens, dtype=torch.int32, device=dev)


def mixed_row(cfg: AttentionConfig, chunk: int, decodes: int, context: int, heads: int, kv_heads: int,
              dev: torch.device, iters: int) -> dict[str, Any]:
    """One step of `decodes` one-token sequences (first, as the scheduler orders running requests)
    and a new prompt's `chunk` tokens, through ops.paged_attention with the step's plan (the
    decode kernel over the decode rows, the tensor-core prefill kernel over the chunk), and the
    same rows through each kernel alone."""
    dtype = TORCH_DTYPES[cfg.dtype]
    lens, qlens = [context] * decodes + [chunk], [1] * decodes + [chunk]
    k, v, tables, seq_lens = _paged(lens, cfg.block_size, kv_heads, cfg.head_dim, dtype, dev)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(sum(qlens), heads, cfg.head_dim, dtype=dtype, device=dev)
    out = torch.empty_like(q)
    plan = ops.plan_step(qlens, lens, dev)
    mixed = time_on(dev, lambda: ops.paged_attention(
        out, q, k, v, tables, seq_lens, qsl, 0.1, max_query_len=chunk, max_seq_len=max(lens), plan=plan),
        iters=iters, warmup=1)
    decode = time_on(dev, lambda: ops.paged_attention_decode(
        out[:decodes], q[:decodes], k, v, tables[:decodes], seq_lens[:decodes], 0.1, max_seq_len=context,
        seq_lens_host=lens[:decodes]), iters=iters, warmup=1)
    alone = ops.plan_step([chunk], [chunk], dev)
    chunk_qsl = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
    prefill = time_on(dev, lambda: ops.paged_attention_prefill(
        out[decodes:], q[decodes:], k, v, tables[decodes:], seq_lens[decodes:], chunk_qsl, 0.1,
        max_query_len=chunk, plan=alone), iters=iters, warmup=1)
    return {"kind": "mixed", "backend": "noria", "chunk": chunk, "decodes": decodes, "context": context,
            "us": mixed * 1e6, "decode_us": decode * 1e6, "prefill_us": prefill * 1e6,
            "mixed_over_parts": mixed / (decode + prefill)}


def _attempt(fn: Callable[[], Any]) -> tuple[Exception | None, str]:
    """Call fn once with torch's warnings caught: (the exception it raised or None, the first
    warning, which says why a backend refused)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
            error = None
        except Exception as e:  # noqa: BLE001 - a refused shape is a row, not a failed benchmark
            error = e
    return error, (str(caught[0].message).strip().splitlines() or [""])[0] if caught else ""


def _failed(row: dict[str, Any], e: BaseException, why: str) -> dict[str, Any]:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return row | {"us": None, "note": f"{type(e).__name__}: {first}"[:200] + (f" ({why[:200]})" if why else "")}


def _expand(t: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=dim) if group > 1 else t


def sdpa_rows(kind: str, seqs: int, length: int, heads: int, kv_heads: int, cfg: AttentionConfig,
              dev: torch.device, iters: int) -> list[dict[str, Any]]:
    """SDPA's flash and cuDNN backends on one decode row (one query over `length` keys per
    sequence) or prefill row (causal, `length` tokens): with enable_gqa where the backend takes
    it, else with K/V expanded to every query head (noted)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    dtype, d = TORCH_DTYPES[cfg.dtype], cfg.head_dim
    q = torch.randn(seqs, heads, 1 if kind == "decode" else length, d, dtype=dtype, device=dev)
    k = torch.randn(seqs, kv_heads, length, d, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    causal = kind == "prefill"
    rows = []
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        row: dict[str, Any] = {"kind": kind, "backend": name, "seqs": seqs, "length": length, "note": ""}
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (_expand(k, heads // kv_heads, 1), _expand(v, heads // kv_heads, 1))

            def call(kk: torch.Tensor = kk, vv: torch.Tensor = vv, gqa: bool = gqa) -> None:
                sdpa(q, kk, vv, is_causal=causal, enable_gqa=gqa)

            with sdpa_kernel(backend):
                error, why = _attempt(call)
                if error is None:
                    try:
                        seconds = time_on(dev, call, iters=iters, warmup=1)
                    except Exception as e:  # noqa: BLE001
                        error = e
            if error is not None and gqa and heads != kv_heads:
                continue  # try again without GQA
            if error is not None:
                rows.append(_failed(row, error, why))
            else:
                rows.append(row | {"us": seconds * 1e6, "note": "" if gqa else "K/V expanded to every query head (no GQA)"})
            break
    return rows


def varlen_rows(seqs: int, prompt: int, heads: int, kv_heads: int, cfg: AttentionConfig, dev: torch.device,
                iters: int) -> list[dict[str, Any]]:
    """Causal prefill through torch.nn.attention.varlen (FlashAttention-2 inside torch; 2.11 takes
    no GQA there, so K/V are expanded) and through `flash_attn`'s varlen function where that
    package is importable."""
    dtype, d = TORCH_DTYPES[cfg.dtype], cfg.head_dim
    q = torch.randn(seqs * prompt, heads, d, dtype=dtype, device=dev)
    k = torch.randn(seqs * prompt, kv_heads, d, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    cu = torch.arange(0, (seqs + 1) * prompt, prompt, dtype=torch.int32, device=dev)
    rows = []
    base: dict[str, Any] = {"kind": "prefill", "seqs": seqs, "length": prompt, "note": ""}
    row = base | {"backend": "torch-varlen"}
    try:
        from torch.nn.attention.varlen import varlen_attn

        group = heads // kv_heads
        ke, ve = _expand(k, group, 1), _expand(v, group, 1)
        error, why = _attempt(lambda: varlen_attn(q, ke, ve, cu, cu, prompt, prompt, window_size=(-1, 0)))
        if error is not None:
            raise RuntimeError(f"{error} ({why})" if why else str(error)) from error
        seconds = time_on(dev, lambda: varlen_attn(q, ke, ve, cu, cu, prompt, prompt, window_size=(-1, 0)),
                          iters=iters, warmup=1)
        rows.append(row | {"us": seconds * 1e6, "note": "K/V expanded to every query head"})
    except Exception as e:  # noqa: BLE001
        rows.append(_failed(row, e, ""))
    row = base | {"backend": "flash-attn"}
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        rows.append(row | {"us": None, "note": f"flash_attn is not importable ({e})"[:200]})
        return rows
    try:
        seconds = time_on(dev, lambda: flash_attn_varlen_func(q, k, v, cu, cu, prompt, prompt, causal=True),
                          iters=iters, warmup=1)
        rows.append(row | {"us": seconds * 1e6})
    except Exception as e:  # noqa: BLE001
        rows.append(_failed(row, e, ""))
    return rows


def flash_attn_decode_row(seqs: int, context: int, heads: int, kv_heads: int, cfg: AttentionConfig,
                          dev: torch.device, iters: int) -> dict[str, Any]:
    """`flash_attn_with_kvcache` over a paged cache (its pages hold 256 tokens), where importable."""
    row: dict[str, Any] = {"kind": "decode", "backend": "flash-attn", "seqs": seqs, "length": context, "note": ""}
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError as e:
        return row | {"us": None, "note": f"flash_attn is not importable ({e})"[:200]}
    try:
        k, v, tables, lens = _paged([context] * seqs, 256, kv_heads, cfg.head_dim, TORCH_DTYPES[cfg.dtype], dev)
        q = torch.randn(seqs, 1, heads, cfg.head_dim, dtype=k.dtype, device=dev)
        seconds = time_on(dev, lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=tables),
                          iters=iters, warmup=1)
        return row | {"us": seconds * 1e6}
    except Exception as e:  # noqa: BLE001
        return _failed(row, e, "")


def rate(row: dict[str, Any], heads: int, kv_heads: int, head_dim: int, elem: int) -> dict[str, Any]:
    """The row with the rate noria's row of its shape would have at its time: GB/s of K/V read
    (each byte once) for decode, causal TFLOP/s for prefill."""
    if row.get("us") is None or row["kind"] not in ("decode", "prefill"):
        return row
    seconds = row["us"] / 1e6
    if row["kind"] == "decode":
        return row | {"gbps": 2 * row["seqs"] * row["length"] * kv_heads * head_dim * elem / seconds / 1e9}
    return row | {"tflops": prefill_flops(row["seqs"], row["length"], heads, head_dim) / seconds / 1e12}

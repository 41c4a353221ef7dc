"""Mutants of the sliding window and the logit soft-cap in all four attention kernels: where a
key loop starts and ends, and whether the cap comes after the scale."""

from __future__ import annotations

from noria.kernels.mutants.mutant import TESTS, Mutant

_WINDOW = str(TESTS / "test_attention_window.py")
# Sliding windows and soft-capping: every window case, and the scene poisoned outside them.
_WINDOW_PREFILL_TESTS = (_WINDOW + "::test_window_prefill", _WINDOW + "::test_nothing_outside_the_window_is_read")
_WINDOW_DECODE_TESTS = (_WINDOW + "::test_window_decode", _WINDOW + "::test_nothing_outside_the_window_is_read")
_WINDOW_F32 = "float32-d64-b16"  # CUDA-core decode and prefill
_WINDOW_TC = "bfloat16-d64-b16"  # tensor-core prefill
_WINDOW_GQA = "float16-d64-b16"  # tensor-core decode

WINDOW: tuple[Mutant, ...] = (
    Mutant(
        "decode-window-off-by-one",
        "off-by-one in the sliding window (a decode query sees window + 1 keys)",
        "decode_attention.cu",
        "const int lo = window > 0 ? max(0, ctx - window) : 0;  // the first key the query sees",
        "const int lo = window > 0 ? max(0, ctx - window - 1) : 0;  // the first key the query sees",
        _WINDOW_DECODE_TESTS,
        keyword=_WINDOW_F32,
    ),
    Mutant(
        "decode-window-skip-too-far",
        "window tile skip too far (partitions start a block after the window's first key's)",
        "decode_attention.cu",
        "const int start = lo / BLOCK_SIZE * BLOCK_SIZE + part * partition_size;",
        "const int start = (lo / BLOCK_SIZE + 1) * BLOCK_SIZE + part * partition_size;",
        _WINDOW_DECODE_TESTS,
        keyword=_WINDOW_F32,
    ),
    Mutant(
        "decode-soft-cap-before-scale",
        "soft-cap applied before the scale (cap * tanh(q.k / cap) * scale)",
        "decode_attention.cu",
        "if (soft_cap > 0.0f) dot = soft_cap * tanhf(dot * inv_cap);",
        "if (soft_cap > 0.0f) dot = soft_cap * tanhf(dot / scale * inv_cap) * scale;",
        _WINDOW_DECODE_TESTS,
        keyword=_WINDOW_F32,
    ),
    Mutant(
        "splitk-window-parts",
        "split-K merge counts partitions from position 0, not from the window's first block",
        "decode_attention.cu",
        "const int span = ctx - lo / block_size * block_size;",
        "const int span = ctx;",
        _WINDOW_DECODE_TESTS,
        keyword=_WINDOW_F32 + " and split",
    ),
    Mutant(
        "prefill-window-off-by-one",
        "off-by-one in the sliding window (a query sees window + 1 keys)",
        "prefill_attention.cu",
        "if (window > 0 && kpos <= qpos - window) s[t] = neg_inf();",
        "if (window > 0 && kpos < qpos - window) s[t] = neg_inf();",
        _WINDOW_PREFILL_TESTS,
        keyword=_WINDOW_F32,
    ),
    Mutant(
        "prefill-window-skip-too-far",
        "window tile skip too far (the key tile holding the window's first key, rounded up)",
        "prefill_attention.cu",
        "const int first_tile = lo / kKeyTile;",
        "const int first_tile = (lo + kKeyTile - 1) / kKeyTile;",
        _WINDOW_PREFILL_TESTS,
        keyword=_WINDOW_F32,
    ),
    Mutant(
        "prefill-soft-cap-before-scale",
        "soft-cap applied before the scale (cap * tanh(q.k / cap) * scale)",
        "prefill_attention.cu",
        "if (soft_cap > 0.0f) s[t] = soft_cap * tanhf(s[t] * inv_cap);",
        "if (soft_cap > 0.0f) s[t] = soft_cap * tanhf(s[t] / scale * inv_cap) * scale;",
        _WINDOW_PREFILL_TESTS,
        keyword=_WINDOW_F32,
    ),
    Mutant(
        "gqa-window-off-by-one",
        "off-by-one in the sliding window (a decode query sees window - 1 keys)",
        "decode_attention_gqa.cu",
        "const int lo = window > 0 ? max(0, ctx - window) : 0;  // the first key the query sees",
        "const int lo = window > 0 ? max(0, ctx - window + 1) : 0;  // the first key the query sees",
        _WINDOW_DECODE_TESTS,
        keyword=_WINDOW_GQA,
    ),
    Mutant(
        "gqa-window-partitions-from-zero",
        "partitions counted from position 0, not from the window's first key",
        "decode_attention_gqa.cu",
        "const int start = min(ctx, lo + part * chunk);",
        "const int start = min(ctx, part * chunk);",
        _WINDOW_DECODE_TESTS,
        keyword=_WINDOW_GQA,
    ),
    Mutant(
        "gqa-soft-cap-before-scale",
        "soft-cap applied before the scale (cap * tanh(q.k / cap) * scale)",
        "decode_attention_gqa.cu",
        "        x *= scale;\n        if (soft_cap > 0.0f) x = soft_cap * tanhf(x * inv_cap);",
        "        if (soft_cap > 0.0f) x = soft_cap * tanhf(x * inv_cap);\n        x *= scale;",
        _WINDOW_DECODE_TESTS,
        keyword=_WINDOW_GQA,
    ),
    Mutant(
        "tc-prefill-window-off-by-one",
        "off-by-one in the sliding window (a query sees window + 1 keys)",
        "prefill_attention_tc.cu",
        "if (window > 0 && kpos <= qpos[i >> 1] - window) v = neg_inf();",
        "if (window > 0 && kpos < qpos[i >> 1] - window) v = neg_inf();",
        _WINDOW_PREFILL_TESTS,
        keyword=_WINDOW_TC,
    ),
    Mutant(
        "tc-prefill-window-skip-too-far",
        "window tile skip too far (the key tile holding the window's first key, rounded up)",
        "prefill_attention_tc.cu",
        "const int first_tile = first_pos / kKeys;",
        "const int first_tile = (first_pos + kKeys - 1) / kKeys;",
        _WINDOW_PREFILL_TESTS,
        keyword=_WINDOW_TC,
    ),
    Mutant(
        "tc-prefill-warp-window-skip",
        "window tile skip too far (a warp skips the tile its window starts in)",
        "prefill_attention_tc.cu",
        "kv0 + kKeys > warp_first_pos",
        "kv0 >= warp_first_pos",
        _WINDOW_PREFILL_TESTS,
        keyword=_WINDOW_TC,
    ),
    Mutant(
        "tc-prefill-window-first-key-unloaded",
        "off-by-one in the window's loads (its first key zero-filled instead of copied)",
        "prefill_attention_tc.cu",
        "const bool ok = pos >= first_pos && pos <= last_pos;",
        "const bool ok = pos > first_pos && pos <= last_pos;",
        _WINDOW_PREFILL_TESTS,
        keyword=_WINDOW_TC,
    ),
    Mutant(
        "tc-prefill-soft-cap-before-scale",
        "soft-cap applied before the scale (cap * tanh(q.k / cap) * scale)",
        "prefill_attention_tc.cu",
        "          float v = s[nt][i] * scale;\n          if (soft_cap > 0.0f) v = soft_cap * tanhf(v * inv_cap);",
        "          float v = s[nt][i];\n          if (soft_cap > 0.0f) v = soft_cap * tanhf(v * inv_cap);\n          v *= scale;",
        _WINDOW_PREFILL_TESTS,
        keyword=_WINDOW_TC,
    ),
)

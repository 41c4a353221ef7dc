"""The mutation catalogue of `python -m noria.kernels.mutate`: one-line edits of the kernel
sources, each a known bug class, with the oracle tests that must catch it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "kernels"
_DECODE_TESTS = (str(TESTS / "test_decode_attention.py") + "::test_decode_matches_reference",)
_PREFILL_TESTS = (str(TESTS / "test_prefill_attention.py") + "::test_prefill_matches_reference",)
_TC_PREFILL_TESTS = (
    str(TESTS / "test_prefill_attention_tc.py") + "::test_tc_prefill_matches_reference",
    str(TESTS / "test_prefill_attention_tc.py") + "::test_tc_prefill_gqa_groups",
)
# bfloat16 head size 64 over the ragged batch, and the 3- and 8-head GQA packings.
_TC_PREFILL_KEYWORD = "bfloat16-d64-b16 or g3 or g8"
_GQA_TESTS = (str(TESTS / "test_decode_attention_gqa.py") + "::test_gqa_decode_matches_reference",)
# float16 (the tighter 16-bit tolerance), 3 pipeline stages, 10 key tiles per long context,
# partitions of 48 tokens that end inside a key tile.
_GQA_KEYWORD = "float16-d96-b16"
_FUSED = str(TESTS / "test_fused_ops.py")
_NORM_TESTS = (_FUSED + "::test_add_rms_norm",)
_ROTARY_TESTS = (_FUSED + "::test_rotary_qkv_cache",)
_SILU_TESTS = (_FUSED + "::test_silu_and_mul",)
# float32 (the tightest tolerance); for the norm, rows over 8 warps of 16-byte accesses.
_NORM_KEYWORD = "3x1024s1024 and float32"
_WINDOW = str(TESTS / "test_attention_window.py")
# Sliding windows and soft-capping: every window case, and the scene poisoned outside them.
_WINDOW_PREFILL_TESTS = (_WINDOW + "::test_window_prefill", _WINDOW + "::test_nothing_outside_the_window_is_read")
_WINDOW_DECODE_TESTS = (_WINDOW + "::test_window_decode", _WINDOW + "::test_nothing_outside_the_window_is_read")
_WINDOW_F32 = "float32-d64-b16"  # CUDA-core decode and prefill
_WINDOW_TC = "bfloat16-d64-b16"  # tensor-core prefill
_WINDOW_GQA = "float16-d64-b16"  # tensor-core decode


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str
    source: str
    old: str
    new: str
    tests: tuple[str, ...]
    # One float32 configuration: the tightest tolerance, and one module to compile per mutant.
    keyword: str = "float32-d128-b16"


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "decode-no-q-barrier",
        "removed `__syncthreads` (after staging q in shared memory)",
        "decode_attention.cu",
        "q_s[d] = to_float(q[d]) * scale;\n  __syncthreads();",
        "q_s[d] = to_float(q[d]) * scale;",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-no-merge-barrier",
        "removed `__syncthreads` (before the cross-group merge)",
        "decode_attention.cu",
        "    grp_l[gid] = l;\n  }\n  __syncthreads();",
        "    grp_l[gid] = l;\n  }",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-gqa-mapping",
        "wrong GQA head mapping (`head % num_kv_heads`)",
        "decode_attention.cu",
        "const int kv_head = head / (num_heads / num_kv_heads);",
        "const int kv_head = head % num_kv_heads;",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-block-off-by-one",
        "off-by-one in the block index (next table entry)",
        "decode_attention.cu",
        "const long long phys = table[logical_block];",
        "const long long phys = table[logical_block + 1];",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-block-count-short",
        "off-by-one in the block count (partial last block dropped)",
        "decode_attention.cu",
        "const int num_blocks = (end - start + BLOCK_SIZE - 1) / BLOCK_SIZE;",
        "const int num_blocks = (end - start) / BLOCK_SIZE;",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-reduction-short",
        "reduction one level short (Q.K over a lane group)",
        "decode_attention.cu",
        "for (int offset = kGroup / 2; offset > 0; offset >>= 1)",
        "for (int offset = kGroup / 2; offset > 1; offset >>= 1)",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-no-block-table",
        "skipped block table lookup (logical block used as physical)",
        "decode_attention.cu",
        "const long long phys = table[logical_block];",
        "const long long phys = logical_block;",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-softmax-scale",
        "wrong softmax scale (scale not applied)",
        "decode_attention.cu",
        "q_s[d] = to_float(q[d]) * scale;",
        "q_s[d] = to_float(q[d]);",
        _DECODE_TESTS,
    ),
    Mutant(
        "splitk-sum-short",
        "reduction one level short (split-K merge, block sum)",
        "common.cuh",
        "for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)\n    v += __shfl_xor_sync",
        "for (int offset = kWarpSize / 2; offset > 1; offset >>= 1)\n    v += __shfl_xor_sync",
        _DECODE_TESTS,
        keyword="float32-d128-b16 and split",
    ),
    Mutant(
        "splitk-reused-scratch",
        "removed `__syncthreads` (block_max's trailing barrier)",
        "common.cuh",
        "for (int w = 1; w < kNumWarps; ++w) r = fmaxf(r, scratch[w]);\n  __syncthreads();",
        "for (int w = 1; w < kNumWarps; ++w) r = fmaxf(r, scratch[w]);",
        _DECODE_TESTS,
        keyword="float32-d128-b16 and split",
    ),
    Mutant(
        "prefill-no-tile-barrier",
        "removed `__syncthreads` (after staging a K/V block)",
        "prefill_attention.cu",
        "        v_s[j][c * kVec + i] = v[i];\n      }\n    }\n    __syncthreads();",
        "        v_s[j][c * kVec + i] = v[i];\n      }\n    }",
        _PREFILL_TESTS,
    ),
    Mutant(
        "prefill-causal-off-by-one",
        "off-by-one in the causal mask (a query misses itself)",
        "prefill_attention.cu",
        "if (kpos > qpos) s[t] = neg_inf();",
        "if (kpos >= qpos) s[t] = neg_inf();",
        _PREFILL_TESTS,
    ),
    Mutant(
        "prefill-gqa-mapping",
        "wrong GQA head mapping (`head % num_kv_heads`)",
        "prefill_attention.cu",
        "const int kv_head = head / (num_heads / num_kv_heads);",
        "const int kv_head = head % num_kv_heads;",
        _PREFILL_TESTS,
    ),
    Mutant(
        "prefill-row-max-short",
        "reduction one level short (row max over 8 threads)",
        "prefill_attention.cu",
        "for (int offset = kRowThreads / 2; offset > 0; offset >>= 1)\n      bmax",
        "for (int offset = kRowThreads / 2; offset > 1; offset >>= 1)\n      bmax",
        _PREFILL_TESTS,
    ),
    # Off by one past the end: the values stay right (the stray bytes land in padding or in
    # memory that is overwritten or ignored), so only the emulator's memory check sees them.
    Mutant(
        "decode-q-staging-past-end",
        "off-by-one past the end (query staging writes `q_s[HEAD_DIM]`)",
        "decode_attention.cu",
        "for (int d = threadIdx.x; d < HEAD_DIM; d += kNumThreads) q_s[d]",
        "for (int d = threadIdx.x; d <= HEAD_DIM; d += kNumThreads) q_s[d]",
        _DECODE_TESTS,
    ),
    Mutant(
        "splitk-max-past-end",
        "off-by-one past the end (split-K merge reads `part_max[parts]`)",
        "decode_attention.cu",
        "for (int p = threadIdx.x; p < parts; p += kNumThreads) mx = fmaxf(mx, pm[p]);",
        "for (int p = threadIdx.x; p <= parts; p += kNumThreads) mx = fmaxf(mx, pm[p]);",
        _DECODE_TESTS,
        keyword="float32-d128-b16 and split",
    ),
    Mutant(
        "prefill-tile-staging-past-end",
        "off-by-one past the end (K/V staging writes row `kKeyTile` of `k_s`, `v_s`)",
        "prefill_attention.cu",
        "for (int idx = threadIdx.x; idx < kKeyTile * kChunks; idx += kNumThreads)",
        "for (int idx = threadIdx.x; idx <= kKeyTile * kChunks; idx += kNumThreads)",
        _PREFILL_TESTS,
    ),
    Mutant(
        "gqa-no-stage-barrier",
        "removed `__syncthreads` (after waiting for a K/V stage: other threads' copies unseen)",
        "decode_attention_gqa.cu",
        "    cp_async_wait<kStages - 2>();  // this thread's copies of `tile` (and Q) have landed\n    __syncthreads();",
        "    cp_async_wait<kStages - 2>();  // this thread's copies of `tile` (and Q) have landed",
        _GQA_TESTS,
        keyword=_GQA_KEYWORD,
    ),
    Mutant(
        "gqa-wait-one-group-short",
        "`cp_async_wait` one group short (a K/V stage read while its copies are in flight)",
        "decode_attention_gqa.cu",
        "cp_async_wait<kStages - 2>();",
        "cp_async_wait<kStages - 1>();",
        _GQA_TESTS,
        keyword=_GQA_KEYWORD,
    ),
    Mutant(
        "gqa-no-softmax-barrier",
        "removed `__syncthreads` (between P in shared memory and P V)",
        "decode_attention_gqa.cu",
        "      if (pl == 0) corr_s[prow] = corr;\n    }\n    __syncthreads();",
        "      if (pl == 0) corr_s[prow] = corr;\n    }",
        _GQA_TESTS,
        keyword=_GQA_KEYWORD,
    ),
    Mutant(
        "gqa-head-mapping",
        "wrong GQA head mapping (a CTA's first query head is its KV head's index)",
        "decode_attention_gqa.cu",
        "const int head0 = kv_head * group + (blockIdx.y % head_groups) * kRows;",
        "const int head0 = kv_head + (blockIdx.y % head_groups) * kRows;",
        _GQA_TESTS,
        keyword=_GQA_KEYWORD,
    ),
    Mutant(
        "gqa-table-prefetch-stale",
        "off-by-one in the block index (prefetched table entries of the tile just issued)",
        "decode_attention_gqa.cu",
        "      issue(next % kStages);  // into the stage tile - 1 used\n      plan(next + 1);",
        "      issue(next % kStages);  // into the stage tile - 1 used\n      plan(next);",
        _GQA_TESTS,
        keyword=_GQA_KEYWORD,
    ),
    Mutant(
        "gqa-softmax-scale",
        "wrong softmax scale (scale not applied)",
        "decode_attention_gqa.cu",
        "        x *= scale;",
        "        x *= 1.0f;",
        _GQA_TESTS,
        keyword=_GQA_KEYWORD,
    ),
    Mutant(
        "gqa-row-max-short",
        "reduction one level short (a row's max over its 8 threads)",
        "decode_attention_gqa.cu",
        "for (int offset = 4; offset > 0; offset >>= 1)\n        tmax",
        "for (int offset = 4; offset > 1; offset >>= 1)\n        tmax",
        _GQA_TESTS,
        keyword=_GQA_KEYWORD,
    ),
    Mutant(
        "gqa-no-rescale",
        "online softmax without rescaling (O and l keep stale maxima)",
        "decode_attention_gqa.cu",
        "const float corr = __expf(m_run - base);",
        "const float corr = m_run == neg_inf() ? 0.0f : 1.0f;",
        _GQA_TESTS,
        keyword=_GQA_KEYWORD,
    ),
    Mutant(
        "gqa-partition-overlap",
        "off-by-one in the partition bounds (every partition runs to the context's end)",
        "decode_attention_gqa.cu",
        "const int end = part == num_parts - 1 ? ctx : min(ctx, start + chunk);",
        "const int end = ctx;",
        _GQA_TESTS,
        keyword=_GQA_KEYWORD,
    ),
    Mutant(
        "gqa-copy-past-end",
        "off-by-one past the end (the slot after a partition is copied: a stale cache row)",
        "decode_attention_gqa.cu",
        "if (idx < kKeys * kChunks && tile < num_tiles && pos < end) {",
        "if (idx < kKeys * kChunks && tile < num_tiles && pos <= end) {",
        _GQA_TESTS,
        keyword=_GQA_KEYWORD,
    ),
    Mutant(
        "gqa-merge-weight",
        "wrong split-K merge weight (partition maxima ignored)",
        "decode_attention_gqa.cu",
        "const float w = part_sum[ih] * __expf(part_max[ih] - mx);",
        "const float w = part_sum[ih];",
        _GQA_TESTS,
        keyword=_GQA_KEYWORD + " and split",
    ),
    Mutant(
        "tc-prefill-wait-one-group-short",
        "waits for all but two cp.async groups (the K/V tile about to be computed still in flight)",
        "prefill_attention_tc.cu",
        "cp_async_wait<1>();  // this thread's copies of tile j have landed",
        "cp_async_wait<2>();  // this thread's copies of tile j have landed",
        _TC_PREFILL_TESTS,
        keyword=_TC_PREFILL_KEYWORD,
    ),
    Mutant(
        "tc-prefill-prefetch-wrong-stage",
        "prefetches the next K/V tile into the stage being computed",
        "prefill_attention_tc.cu",
        "T* next = smem + ((j + 1) % kStages) * 2 * kKeys * kStride;",
        "T* next = smem + (j % kStages) * 2 * kKeys * kStride;",
        _TC_PREFILL_TESTS,
        keyword=_TC_PREFILL_KEYWORD,
    ),
    Mutant(
        "tc-prefill-no-stage-release",
        "removed `__syncthreads` (a stage is refilled while a slower warp still reads it)",
        "prefill_attention_tc.cu",
        "    __syncthreads();  // every warp is done with this stage before tile j + 2 is copied into it\n",
        "",
        _TC_PREFILL_TESTS,
        keyword=_TC_PREFILL_KEYWORD,
    ),
    Mutant(
        "tc-prefill-no-q-barrier",
        "removed `__syncthreads` (after the Q fragments are read, before K/V overwrite them)",
        "prefill_attention_tc.cu",
        "  }\n  __syncthreads();  // every warp holds its Q before K/V copies overwrite those rows",
        "  }",
        _TC_PREFILL_TESTS,
        keyword=_TC_PREFILL_KEYWORD,
    ),
    Mutant(
        "tc-prefill-causal-off-by-one",
        "off-by-one in the causal mask (a query misses itself)",
        "prefill_attention_tc.cu",
        "if (kpos > qpos[i >> 1]) v = neg_inf();",
        "if (kpos >= qpos[i >> 1]) v = neg_inf();",
        _TC_PREFILL_TESTS,
        keyword=_TC_PREFILL_KEYWORD,
    ),
    Mutant(
        "tc-prefill-gqa-packing",
        "wrong GQA packing (a packed row's position taken as its token index times the group)",
        "prefill_attention_tc.cu",
        "qpos[r] = p < packed ? prefix + p / group : -1;",
        "qpos[r] = p < packed ? prefix + p : -1;",
        _TC_PREFILL_TESTS,
        keyword=_TC_PREFILL_KEYWORD,
    ),
    Mutant(
        "tc-prefill-last-key-tile-dropped",
        "off-by-one in the key tile count (the diagonal's last tile skipped)",
        "prefill_attention_tc.cu",
        "const int num_tiles = last_pos / kKeys + 1 - first_tile;",
        "const int num_tiles = last_pos / kKeys - first_tile;",
        _TC_PREFILL_TESTS,
        keyword=_TC_PREFILL_KEYWORD,
    ),
    Mutant(
        "tc-prefill-row-sum-short",
        "reduction one level short (a row's exp-sum over its 4 lanes)",
        "prefill_attention_tc.cu",
        "    l[r] += __shfl_xor_sync(kFullMask, l[r], 2);\n",
        "",
        _TC_PREFILL_TESTS,
        keyword=_TC_PREFILL_KEYWORD,
    ),
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
    Mutant(
        "norm-no-reduce-barrier",
        "removed `__syncthreads` (RMSNorm: warp sums read before every warp wrote its own)",
        "fused_ops.cu",
        "  if (lane == 0) scratch[warp] = v;\n  __syncthreads();\n  float r = 0.f;",
        "  if (lane == 0) scratch[warp] = v;\n  float r = 0.f;",
        _NORM_TESTS,
        keyword=_NORM_KEYWORD,
    ),
    Mutant(
        "norm-sum-first-warp",
        "reduction one level short (RMSNorm: the first warp's sum of squares only)",
        "fused_ops.cu",
        "for (int w = 0; w < num_warps; ++w) r += scratch[w];",
        "for (int w = 0; w < 1; ++w) r += scratch[w];",
        _NORM_TESTS,
        keyword=_NORM_KEYWORD,
    ),
    Mutant(
        "norm-residual-not-stored",
        "dropped store (the residual stream keeps its old value)",
        "fused_ops.cu",
        "      store_pack<T, kVec>(rr + i * kVec, a);\n",
        "",
        _NORM_TESTS,
        keyword="residual and float32",
    ),
    Mutant(
        "norm-mean-over-vectors",
        "wrong RMSNorm mean (divided by the 16-byte vector count, not the hidden size)",
        "fused_ops.cu",
        "rsqrtf(block_sum_any(sum_sq, scratch) / hidden + eps)",
        "rsqrtf(block_sum_any(sum_sq, scratch) / num_vecs + eps)",
        _NORM_TESTS,
        keyword=_NORM_KEYWORD,
    ),
    Mutant(
        "rotary-sign",
        "wrong rotary sign (second half rotated the wrong way)",
        "fused_ops.cu",
        "rounded<T>(__fmul_rn(x2, cf)) + rounded<T>(__fmul_rn(x1, sf))",
        "rounded<T>(__fmul_rn(x2, cf)) - rounded<T>(__fmul_rn(x1, sf))",
        _ROTARY_TESTS,
        keyword="float32 and i64",
    ),
    Mutant(
        "rotary-first-k-head-uncached",
        "off-by-one in the head index (the first k head is not written to the cache)",
        "fused_ops.cu",
        "if (head >= num_heads && slot >= 0) {",
        "if (head > num_heads && slot >= 0) {",
        _ROTARY_TESTS,
        keyword="float32 and i64",
    ),
    Mutant(
        "rotary-partial-k-pass-uncached",
        "dropped store (partial rotary: k's dims past the rotary ones never reach the cache)",
        "fused_ops.cu",
        "    k_cache[slot * kv_elems + off] = k[off];\n",
        "",
        (_FUSED + "::test_rotary_partial_with_scaled_table",),
        keyword="float32",
    ),
    Mutant(
        "silu-past-the-end",
        "off-by-one past the end (SiLU-and-mul: one access past each row)",
        "fused_ops.cu",
        "if (i >= inter / kVec) return;",
        "if (i > inter / kVec) return;",
        _SILU_TESTS,
        keyword="float32",
    ),
    Mutant(
        "silu-sign",
        "wrong activation (x * sigmoid(-x))",
        "fused_ops.cu",
        "x / (1.f + expf(-x))",
        "x / (1.f + expf(x))",
        _SILU_TESTS,
        keyword="float32",
    ),
)


# Not a bug: the unmodified sources through the same machinery must pass, which shows the
# oracle tests are green on correct code and the forked runs themselves work.
CONTROL = Mutant(
    "control", "none (unmodified sources)", "common.cuh", "", "", _DECODE_TESTS + _PREFILL_TESTS
)

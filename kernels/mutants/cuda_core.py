"""Mutants of the CUDA-core (float32) attention kernels: decode_attention.cu with its split-K
merge, prefill_attention.cu, and the block reductions of common.cuh they share."""

from __future__ import annotations

from noria.kernels.mutants.mutant import TESTS, Mutant

DECODE_TESTS = (str(TESTS / "test_decode_attention.py") + "::test_decode_matches_reference",)
PREFILL_TESTS = (str(TESTS / "test_prefill_attention.py") + "::test_prefill_matches_reference",)

CUDA_CORE: tuple[Mutant, ...] = (
    Mutant(
        "decode-no-q-barrier",
        "removed `__syncthreads` (after staging q in shared memory)",
        "decode_attention.cu",
        "q_s[d] = to_float(q[d]) * scale;\n  __syncthreads();",
        "q_s[d] = to_float(q[d]) * scale;",
        DECODE_TESTS,
    ),
    Mutant(
        "decode-no-merge-barrier",
        "removed `__syncthreads` (before the cross-group merge)",
        "decode_attention.cu",
        "    grp_l[gid] = l;\n  }\n  __syncthreads();",
        "    grp_l[gid] = l;\n  }",
        DECODE_TESTS,
    ),
    Mutant(
        "decode-gqa-mapping",
        "wrong GQA head mapping (`head % num_kv_heads`)",
        "decode_attention.cu",
        "const int kv_head = head / (num_heads / num_kv_heads);",
        "const int kv_head = head % num_kv_heads;",
        DECODE_TESTS,
    ),
    Mutant(
        "decode-block-off-by-one",
        "off-by-one in the block index (next table entry)",
        "decode_attention.cu",
        "const long long phys = table[logical_block];",
        "const long long phys = table[logical_block + 1];",
        DECODE_TESTS,
    ),
    Mutant(
        "decode-block-count-short",
        "off-by-one in the block count (partial last block dropped)",
        "decode_attention.cu",
        "const int num_blocks = (end - start + BLOCK_SIZE - 1) / BLOCK_SIZE;",
        "const int num_blocks = (end - start) / BLOCK_SIZE;",
        DECODE_TESTS,
    ),
    Mutant(
        "decode-reduction-short",
        "reduction one level short (Q.K over a lane group)",
        "decode_attention.cu",
        "for (int offset = kGroup / 2; offset > 0; offset >>= 1)",
        "for (int offset = kGroup / 2; offset > 1; offset >>= 1)",
        DECODE_TESTS,
    ),
    Mutant(
        "decode-no-block-table",
        "skipped block table lookup (logical block used as physical)",
        "decode_attention.cu",
        "const long long phys = table[logical_block];",
        "const long long phys = logical_block;",
        DECODE_TESTS,
    ),
    Mutant(
        "decode-softmax-scale",
        "wrong softmax scale (scale not applied)",
        "decode_attention.cu",
        "q_s[d] = to_float(q[d]) * scale;",
        "q_s[d] = to_float(q[d]);",
        DECODE_TESTS,
    ),
    Mutant(
        "splitk-sum-short",
        "reduction one level short (split-K merge, block sum)",
        "common.cuh",
        "for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)\n    v += __shfl_xor_sync",
        "for (int offset = kWarpSize / 2; offset > 1; offset >>= 1)\n    v += __shfl_xor_sync",
        DECODE_TESTS,
        keyword="float32-d128-b16 and split",
    ),
    Mutant(
        "splitk-reused-scratch",
        "removed `__syncthreads` (block_max's trailing barrier)",
        "common.cuh",
        "for (int w = 1; w < kNumWarps; ++w) r = fmaxf(r, scratch[w]);\n  __syncthreads();",
        "for (int w = 1; w < kNumWarps; ++w) r = fmaxf(r, scratch[w]);",
        DECODE_TESTS,
        keyword="float32-d128-b16 and split",
    ),
    Mutant(
        "prefill-no-tile-barrier",
        "removed `__syncthreads` (after staging a K/V block)",
        "prefill_attention.cu",
        "        v_s[j][c * kVec + i] = v[i];\n      }\n    }\n    __syncthreads();",
        "        v_s[j][c * kVec + i] = v[i];\n      }\n    }",
        PREFILL_TESTS,
    ),
    Mutant(
        "prefill-causal-off-by-one",
        "off-by-one in the causal mask (a query misses itself)",
        "prefill_attention.cu",
        "if (kpos > qpos) s[t] = neg_inf();",
        "if (kpos >= qpos) s[t] = neg_inf();",
        PREFILL_TESTS,
    ),
    Mutant(
        "prefill-gqa-mapping",
        "wrong GQA head mapping (`head % num_kv_heads`)",
        "prefill_attention.cu",
        "const int kv_head = head / (num_heads / num_kv_heads);",
        "const int kv_head = head % num_kv_heads;",
        PREFILL_TESTS,
    ),
    Mutant(
        "prefill-row-max-short",
        "reduction one level short (row max over 8 threads)",
        "prefill_attention.cu",
        "for (int offset = kRowThreads / 2; offset > 0; offset >>= 1)\n      bmax",
        "for (int offset = kRowThreads / 2; offset > 1; offset >>= 1)\n      bmax",
        PREFILL_TESTS,
    ),
    # Off by one past the end: the values stay right (the stray bytes land in padding or in
    # memory that is overwritten or ignored), so only the emulator's memory check sees them.
    Mutant(
        "decode-q-staging-past-end",
        "off-by-one past the end (query staging writes `q_s[HEAD_DIM]`)",
        "decode_attention.cu",
        "for (int d = threadIdx.x; d < HEAD_DIM; d += kNumThreads) q_s[d]",
        "for (int d = threadIdx.x; d <= HEAD_DIM; d += kNumThreads) q_s[d]",
        DECODE_TESTS,
    ),
    Mutant(
        "splitk-max-past-end",
        "off-by-one past the end (split-K merge reads `part_max[parts]`)",
        "decode_attention.cu",
        "for (int p = threadIdx.x; p < parts; p += kNumThreads) mx = fmaxf(mx, pm[p]);",
        "for (int p = threadIdx.x; p <= parts; p += kNumThreads) mx = fmaxf(mx, pm[p]);",
        DECODE_TESTS,
        keyword="float32-d128-b16 and split",
    ),
    Mutant(
        "prefill-tile-staging-past-end",
        "off-by-one past the end (K/V staging writes row `kKeyTile` of `k_s`, `v_s`)",
        "prefill_attention.cu",
        "for (int idx = threadIdx.x; idx < kKeyTile * kChunks; idx += kNumThreads)",
        "for (int idx = threadIdx.x; idx <= kKeyTile * kChunks; idx += kNumThreads)",
        PREFILL_TESTS,
    ),
)

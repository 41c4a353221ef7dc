// sm_80 tensor-core and asynchronous-copy instructions, run on the CPU. Kernels reach them
// through kernels/csrc/tensor_core.cuh, which issues the PTX on a GPU and calls these here.
//
// * mma.sync.aligned.m16n8k{16,8}.row.col.f32.{bf16,f16}.{bf16,f16}.f32 and
//   ldmatrix.sync.aligned.m8n8.{x1,x2,x4}[.trans].shared.b16 are warp collectives: the 32
//   lanes meet (collectives.h), each with its own registers laid out as the PTX ISA's
//   "Matrix Fragments for mma.m16n8k16 / m16n8k8" and "ldmatrix" sections say; the last lane
//   to arrive assembles the matrices from every lane's fragments, computes, and hands each lane
//   its own result fragment. The whole warp must be at the same instruction (same op, same
//   call site); a lane that is elsewhere, exited or missing is an error.
// * mma: products of 16-bit inputs are exact in double, the sum (with C) is taken in double
//   and rounded once to float; a GPU's tensor core may round differently in the last bits.
// * cp.async.{ca,cg}.shared.global: the copy is recorded, not performed; it lands at the
//   issuing thread's cp.async.wait_group / wait_all that covers its commit group (the latest
//   moment PTX allows), so a read before that wait sees the old bytes. With the memory check
//   on, any access to bytes in flight is reported (memcheck.h), naming the issuing thread and
//   its group.
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "collectives.h"
#include "half.h"
#include "memcheck.h"

namespace cudaemu {

struct MmaLane {  // one lane's operands, on its own fiber stack while the warp meets
  uint32_t a[4];
  uint32_t b[2];
  float c[4];
  float d[4];
};

struct LdmLane {
  const char* addr;  // the row this lane supplies (lanes 0..8*num-1 are read)
  uint32_t r[4];
};

CUDAEMU_RUNTIME inline double mma_elem(uint32_t reg, unsigned half, bool bf16) {
  const uint16_t bits = static_cast<uint16_t>(half ? reg >> 16 : reg & 0xffffu);
  return bf16 ? bf16_to_f32(bits) : f16_to_f32(bits);
}

// D = A B + C for one warp. A is 16 x k (row-major), B is k x 8 ("col": each lane's pair of
// elements runs down a column), C and D are 16 x 8 float. groupID = lane / 4 and
// threadID_in_group = lane % 4 as in the PTX ISA; lower 16 bits hold the lower column / row.
CUDAEMU_RUNTIME inline void complete_mma(Thread* lanes, unsigned k, bool bf16) {
  double A[16][16], B[16][8], C[16][8];
  for (unsigned lane = 0; lane < 32; ++lane) {
    const MmaLane& in = *reinterpret_cast<const MmaLane*>(lanes[lane].value);
    const unsigned g = lane >> 2, t = lane & 3;
    // A: register i holds row g (+8 for odd i), columns 2t, 2t+1 (+8 for i >= 2).
    for (unsigned i = 0; i < k / 4; ++i) {
      const unsigned row = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1);
      A[row][col] = mma_elem(in.a[i], 0, bf16);
      A[row][col + 1] = mma_elem(in.a[i], 1, bf16);
    }
    // B: register i holds rows 2t, 2t+1 (+8 for i = 1), column g.
    for (unsigned i = 0; i < k / 8; ++i) {
      const unsigned row = 2 * t + 8 * i;
      B[row][g] = mma_elem(in.b[i], 0, bf16);
      B[row + 1][g] = mma_elem(in.b[i], 1, bf16);
    }
    // C: c[i] is row g (+8 for i >= 2), column 2t + (i & 1).
    for (unsigned i = 0; i < 4; ++i) C[g + 8 * (i >> 1)][2 * t + (i & 1)] = in.c[i];
  }
  for (unsigned lane = 0; lane < 32; ++lane) {
    MmaLane& out = *reinterpret_cast<MmaLane*>(lanes[lane].value);
    const unsigned g = lane >> 2, t = lane & 3;
    for (unsigned i = 0; i < 4; ++i) {
      const unsigned row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
      double acc = C[row][col];
      for (unsigned kk = 0; kk < k; ++kk) acc += A[row][kk] * B[kk][col];
      out.d[i] = static_cast<float>(acc);
    }
  }
}

// ldmatrix: lane 8j + r supplies the address of row r of matrix j (16 bytes, 8 b16 elements).
// Register j of a lane holds matrix j's elements (row lane/4, columns 2(lane%4), +1), or with
// .trans those of the transposed matrix (rows 2(lane%4), +1 of column lane/4).
CUDAEMU_RUNTIME inline void complete_ldmatrix(Thread* lanes, unsigned num, bool trans) {
  uint16_t M[4][8][8];
  for (unsigned j = 0; j < num; ++j)
    for (unsigned r = 0; r < 8; ++r)
      memcpy(M[j][r], reinterpret_cast<const LdmLane*>(lanes[8 * j + r].value)->addr, 16);
  for (unsigned lane = 0; lane < 32; ++lane) {
    LdmLane& out = *reinterpret_cast<LdmLane*>(lanes[lane].value);
    const unsigned g = lane >> 2, t = lane & 3;
    for (unsigned j = 0; j < num; ++j) {
      const uint16_t lo = trans ? M[j][2 * t][g] : M[j][g][2 * t];
      const uint16_t hi = trans ? M[j][2 * t + 1][g] : M[j][g][2 * t + 1];
      out.r[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  }
}

CUDAEMU_RUNTIME inline void complete_tensor_collective(Worker* w, const Pending& p, unsigned warp) {
  Thread* lanes = w->threads + warp * 32;
  switch (p.op) {
    case Op::MmaK16Bf16: complete_mma(lanes, 16, true); break;
    case Op::MmaK16F16: complete_mma(lanes, 16, false); break;
    case Op::MmaK8Bf16: complete_mma(lanes, 8, true); break;
    case Op::MmaK8F16: complete_mma(lanes, 8, false); break;
    case Op::LdmX1: complete_ldmatrix(lanes, 1, false); break;
    case Op::LdmX2: complete_ldmatrix(lanes, 2, false); break;
    case Op::LdmX4: complete_ldmatrix(lanes, 4, false); break;
    case Op::LdmX1T: complete_ldmatrix(lanes, 1, true); break;
    case Op::LdmX2T: complete_ldmatrix(lanes, 2, true); break;
    case Op::LdmX4T: complete_ldmatrix(lanes, 4, true); break;
    default: break;
  }
  for (unsigned l = 0; l < 32; ++l) {
    lanes[l].wait = Wait::None;
    mark_runnable(w, lanes[l].index);
  }
}

CUDAEMU_RUNTIME inline bool in_shared(const Worker* w, uintptr_t a, size_t n) {
  return a >= w->tls_lo && a + n <= w->tls_hi;
}

// k = 16: a[4], b[2]; k = 8: a[2], b[1]. d may alias c.
CUDAEMU_RUNTIME inline void mma(Op op, float* d, const uint32_t* a, const uint32_t* b,
                                const float* c, const char* file, unsigned line) {
  const unsigned k = (op == Op::MmaK16Bf16 || op == Op::MmaK16F16) ? 16 : 8;
  MmaLane lane;
  memcpy(lane.a, a, k / 4 * sizeof(uint32_t));
  memcpy(lane.b, b, k / 8 * sizeof(uint32_t));
  memcpy(lane.c, c, sizeof(lane.c));
  collective(op, 0xffffffffu, reinterpret_cast<uint64_t>(&lane), 0, 0, 32, file, line);
  memcpy(d, lane.d, sizeof(lane.d));
}

CUDAEMU_RUNTIME inline void ldmatrix(Op op, uint32_t* r, const void* smem, const char* file,
                                     unsigned line) {
  const unsigned num = (op == Op::LdmX1 || op == Op::LdmX1T) ? 1 : (op == Op::LdmX2 || op == Op::LdmX2T) ? 2 : 4;
  Worker* w = cur_worker();
  Thread* t = w->cur;
  const uintptr_t a = reinterpret_cast<uintptr_t>(smem);
  if (t->lane < 8 * num) {  // only these lanes' addresses are read
    if (a % 16 != 0)
      fail("%s: lane %u's row address %p is not 16-byte aligned", op_name(op), t->lane, smem);
    if (!in_shared(w, a, 16))
      fail("%s: lane %u's row address %p is not shared memory", op_name(op), t->lane, smem);
    if (tl_memcheck != nullptr) memcheck(a, 16, false);  // bounds, and bytes in flight
  }
  LdmLane lane;
  lane.addr = static_cast<const char*>(smem);
  collective(op, 0xffffffffu, reinterpret_cast<uint64_t>(&lane), 0, 0, 32, file, line);
  memcpy(r, lane.r, num * sizeof(uint32_t));
}

CUDAEMU_RUNTIME inline void async_land(Worker* w, const AsyncCopy& c) {
  if (c.src_bytes) memcpy(c.dst, c.src, c.src_bytes);
  if (c.bytes > c.src_bytes) memset(c.dst + c.src_bytes, 0, c.bytes - c.src_bytes);
  AsyncState& as = w->async;
  if (as.shadow != nullptr) {
    const size_t first = (reinterpret_cast<uintptr_t>(c.dst) - w->tls_lo) / 4;
    for (size_t k = 0; k < c.bytes / 4; ++k) as.shadow[first + k] = 0;
  }
  --w->threads[c.thread].async_pending;
}

// cp.async.{ca,cg}.shared.global [dst], [src], bytes, src_bytes: src_bytes < bytes zero-fills
// the rest (0: nothing is read).
CUDAEMU_RUNTIME inline void cp_async(void* dst, const void* src, unsigned bytes, unsigned src_bytes,
                                     bool cg) {
  Worker* w = cur_worker();
  Thread* t = w->cur;
  const char* name = cg ? "cp.async.cg.shared.global" : "cp.async.ca.shared.global";
  if (cg ? bytes != 16 : (bytes != 4 && bytes != 8 && bytes != 16))
    fail("%s: cp-size %u (.cg copies 16 bytes; .ca 4, 8 or 16)", name, bytes);
  if (src_bytes > bytes) fail("%s: src-size %u exceeds cp-size %u", name, src_bytes, bytes);
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (d % bytes != 0 || s % bytes != 0)
    fail("%s: addresses must be %u-byte aligned (shared %p, global %p)", name, bytes, dst, src);
  if (!in_shared(w, d, bytes)) fail("%s: destination %p is not shared memory", name, dst);
  if (in_shared(w, s, 1)) fail("%s: source %p is shared memory, not global", name, src);
  if (tl_memcheck != nullptr) {
    memcheck(d, bytes, true);  // bounds, and a second copy onto bytes still in flight
    if (src_bytes) memcheck(s, src_bytes, false);
  }
  AsyncState& as = w->async;
  if (as.n == as.cap) {
    as.cap = as.cap ? 2 * as.cap : 1024;
    as.copies = static_cast<AsyncCopy*>(realloc(as.copies, as.cap * sizeof(AsyncCopy)));
    if (as.copies == nullptr) abort();
  }
  as.copies[as.n++] = AsyncCopy{static_cast<char*>(dst), static_cast<const char*>(src), bytes,
                                src_bytes, t->index, t->async_groups};
  ++t->async_pending;
  if (tl_memcheck != nullptr) {
    if (as.shadow == nullptr) {
      as.words = (w->tls_hi - w->tls_lo + 3) / 4;
      as.shadow = static_cast<uint16_t*>(calloc(as.words, sizeof(uint16_t)));
      if (as.shadow == nullptr) abort();
    }
    const size_t first = (d - w->tls_lo) / 4;
    for (size_t k = 0; k < bytes / 4; ++k) as.shadow[first + k] = static_cast<uint16_t>(t->index + 1);
  }
}

CUDAEMU_RUNTIME inline void cp_async_commit() { ++cur_worker()->cur->async_groups; }

// cp.async.wait_group n: every committed group but the newest n lands now.
CUDAEMU_RUNTIME inline void cp_async_wait(unsigned n) {
  Worker* w = cur_worker();
  Thread* t = w->cur;
  if (t->async_pending == 0 || t->async_groups <= n) return;
  const unsigned limit = t->async_groups - n;  // groups below this id are covered
  AsyncState& as = w->async;
  unsigned kept = 0;
  for (unsigned i = 0; i < as.n; ++i) {
    const AsyncCopy c = as.copies[i];
    if (c.thread == t->index && c.group < limit)
      async_land(w, c);
    else
      as.copies[kept++] = c;
  }
  as.n = kept;
}

CUDAEMU_RUNTIME inline void cp_async_wait_all() {
  cp_async_commit();
  cp_async_wait(0);
}

}  // namespace cudaemu

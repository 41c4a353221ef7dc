// Warp collectives (__shfl*_sync, __ballot_sync, __any/__all_sync, __reduce*_sync,
// __syncwarp): the lanes named by a mask meet here; the last to arrive computes every lane's
// result and makes them runnable again. Mismatched masks, lanes outside the mask and lanes that
// exited are errors, as they would be undefined on a GPU.
#pragma once

#include <stdint.h>
#include <string.h>

#include "runtime.h"

namespace cudaemu {

// Source lane of a shuffle, following the PTX shfl.sync definition (segmask/clamp).
CUDAEMU_RUNTIME inline unsigned shfl_source(Op op, unsigned lane, int param, int width, bool* in_range) {
  const unsigned segmask = static_cast<unsigned>(32 - width) & 31u;
  const unsigned clamp = (op == Op::ShflUp) ? 0u : 31u;
  const unsigned max_lane = (lane & segmask) | (clamp & ~segmask);
  const unsigned min_lane = lane & segmask;
  const int b = static_cast<int>(static_cast<unsigned>(param) & 31u);
  const int me = static_cast<int>(lane), hi = static_cast<int>(max_lane);
  int j;
  bool ok;
  switch (op) {
    case Op::ShflUp: j = me - b; ok = j >= hi; break;  // for up, max_lane is the segment start
    case Op::ShflDown: j = me + b; ok = j <= hi; break;
    case Op::ShflXor: j = me ^ b; ok = j <= hi; break;
    default: j = static_cast<int>(min_lane | (static_cast<unsigned>(b) & ~segmask)); ok = j <= hi;
  }
  *in_range = ok;
  return ok ? static_cast<unsigned>(j) : lane;
}

// mma / ldmatrix: defined in tensor_core.h.
CUDAEMU_RUNTIME inline void complete_tensor_collective(Worker* w, const Pending& p, unsigned warp);

CUDAEMU_RUNTIME inline void complete_collective(Worker* w, WarpState& ws, const Pending& p, unsigned warp) {
  Thread* lanes = w->threads + warp * 32;
  uint64_t ballot = 0, acc = 0;
  bool first = true;
  for (unsigned l = 0; l < 32; ++l) {
    if (!(p.mask >> l & 1u)) continue;
    const Thread& t = lanes[l];
    if (t.pred) ballot |= 1ull << l;
    const uint32_t u = static_cast<uint32_t>(t.value);
    const int32_t s = static_cast<int32_t>(u);
    const int32_t sacc = static_cast<int32_t>(acc);
    switch (p.op) {
      case Op::ReduceAddU:
      case Op::ReduceAddI: acc = first ? u : static_cast<uint32_t>(acc + u); break;
      case Op::ReduceMinU: acc = first || u < acc ? u : acc; break;
      case Op::ReduceMaxU: acc = first || u > acc ? u : acc; break;
      case Op::ReduceMinI: acc = first || s < sacc ? u : acc; break;
      case Op::ReduceMaxI: acc = first || s > sacc ? u : acc; break;
      default: break;
    }
    acc &= 0xffffffffull;
    first = false;
  }
  for (unsigned l = 0; l < 32; ++l) {
    if (!(p.mask >> l & 1u)) continue;
    Thread& t = lanes[l];
    switch (p.op) {
      case Op::SyncWarp: t.result = 0; break;
      case Op::ShflIdx: case Op::ShflUp: case Op::ShflDown: case Op::ShflXor: {
        bool in_range;
        const unsigned src = shfl_source(p.op, l, t.param, p.width, &in_range);
        if (!(p.mask >> src & 1u)) {
          fail("%s in warp %u: lane %u reads lane %u, which is not in mask 0x%08x "
               "(the value would be undefined on a GPU)",
               op_name(p.op), warp, l, src, p.mask);
        }
        t.result = lanes[src].value;
        break;
      }
      case Op::Ballot: t.result = ballot; break;
      case Op::Any: t.result = ballot != 0; break;
      case Op::All: t.result = ballot == p.mask; break;
      default: t.result = acc; break;
    }
    t.wait = Wait::None;
    mark_runnable(w, t.index);
  }
  (void)ws;
}

CUDAEMU_RUNTIME inline uint64_t collective(Op op, uint32_t mask, uint64_t value, int param, int pred, int width,
                                           const char* file = nullptr, unsigned line = 0) {
  Worker* w = cur_worker();
  Thread* t = w->cur;
  const uint32_t bit = 1u << t->lane;
  WarpState& ws = w->warps[t->warp];
  if (!(mask & bit))
    fail("%s: mask 0x%08x does not include the calling lane %u", op_name(op), mask, t->lane);
  if (mask & ~ws.exists)
    fail("%s: mask 0x%08x names lanes that do not exist in this block (warp %u has 0x%08x)",
         op_name(op), mask, t->warp, ws.exists);
  if (mask & ws.exited)
    fail("%s: mask 0x%08x includes lanes that already exited (0x%08x)", op_name(op), mask,
         mask & ws.exited);
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
    fail("%s: width %d is not a power of two in [1, 32]", op_name(op), width);
  Pending* p = nullptr;
  for (int i = 0; i < ws.npending; ++i) {
    Pending& q = ws.pending[i];
    if (!(q.mask & mask)) continue;
    if (q.mask != mask || q.op != op || q.width != width)
      fail("lanes of warp %u meet in different collectives: %s(mask 0x%08x) while lanes 0x%08x "
           "wait in %s(mask 0x%08x, width %d)",
           t->warp, op_name(op), mask, q.arrived, op_name(q.op), q.mask, q.width);
    if (q.line != line || (q.file != file && (q.file == nullptr || file == nullptr ||
                                              strcmp(q.file, file) != 0)))
      fail("lanes of warp %u execute %s at different places (divergent; .aligned needs the "
           "whole warp at the same instruction): lane %u at %s:%u while lanes 0x%08x wait at "
           "%s:%u",
           t->warp, op_name(op), t->lane, file ? file : "?", line, q.arrived,
           q.file ? q.file : "?", q.line);
    p = &q;
  }
  if (p == nullptr) {
    p = &ws.pending[ws.npending++];
    *p = Pending{mask, 0u, op, width, file, line};
  }
  t->value = value;
  t->param = param;
  t->pred = pred != 0;
  t->wait = Wait::Collective;
  mark_blocked(w, t->index);
  p->arrived |= bit;
  if (p->arrived == mask) {
    const Pending done = *p;
    *p = ws.pending[--ws.npending];
    if (is_tensor_op(done.op))
      complete_tensor_collective(w, done, t->warp);
    else
      complete_collective(w, ws, done, t->warp);
  }
  yield(w, t);
  return t->result;
}

}  // namespace cudaemu

// Block scheduler: runs the threads of one block as fibers on one OS thread, switching only
// at barriers, warp collectives and thread exit. The order in which runnable threads are
// resumed is a policy, because a missing barrier shows up only under some orders.
#pragma once

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "fiber.h"
#include "types.h"

namespace cudaemu {

enum Policy : int { kForward = 0, kReverse = 1, kGreedy = 2, kGreedyReverse = 3, kRandom = 4 };

enum class Wait : uint8_t { None, Barrier, Collective, Done };

enum class Op : uint8_t {
  SyncWarp, ShflIdx, ShflUp, ShflDown, ShflXor, Ballot, Any, All, ReduceAddU, ReduceAddI,
  ReduceMinU, ReduceMinI, ReduceMaxU, ReduceMaxI
};

CUDAEMU_RUNTIME inline const char* op_name(Op op) {
  static const char* names[] = {"__syncwarp", "__shfl_sync", "__shfl_up_sync",
                                "__shfl_down_sync", "__shfl_xor_sync", "__ballot_sync",
                                "__any_sync", "__all_sync", "__reduce_add_sync",
                                "__reduce_add_sync", "__reduce_min_sync", "__reduce_min_sync",
                                "__reduce_max_sync", "__reduce_max_sync"};
  return names[static_cast<int>(op)];
}

enum class BarrierKind : uint8_t { Plain, Count, And, Or };

struct Thread {
  Context ctx;
  uint3 tid;
  unsigned index, warp, lane;
  Wait wait;
  uint64_t value;   // operand deposited in a warp collective
  int param;        // per-lane operand: source lane, delta or xor mask
  int pred;         // predicate for votes and __syncthreads_count/and/or
  uint64_t result;  // filled in by whoever completes the collective
};

struct Pending {  // one warp collective that some lanes have reached
  uint32_t mask, arrived;
  Op op;
  int width;
};

struct WarpState {
  uint32_t exists, exited;
  int npending;
  Pending pending[32];
};

struct MemArg;

struct Launch {
  const MemArg* margs;  // pointer arguments' views for memory checking (memcheck.h)
  int nmargs;
  bool memcheck;
  void (*kernel_fn)();
  void (*kernel_invoker)(void (*)(), void**);
  void** args;
  dim3 grid, block;
  size_t dynamic_smem;
  int policy;
  uint64_t seed;
  bool strict;
  unsigned long long nblocks;
  unsigned long long next_block;  // atomic counter shared by the worker threads
  int failed;                     // atomic
  pthread_mutex_t err_lock;
  char err[2048];
};

constexpr unsigned kMaxThreads = 1024;
constexpr unsigned kWords = kMaxThreads / 64;

struct Worker {
  Launch* L;
  uint64_t runnable[kWords];  // bit i: thread i can be resumed
  Thread* threads;
  unsigned nthreads;
  WarpState* warps;
  unsigned nwarps;
  Stack* stacks;
  Context sched;
  Thread* cur;
  uint3 block_idx;
  unsigned long long block_linear;
  unsigned live, exited, at_barrier;
  unsigned cursor;
  uint64_t rng;
  bool failed;
};

// Touched by each worker OS thread so that the module's TLS segment (its __shared__ memory)
// exists before the worker looks it up.
static thread_local char tls_anchor;

CUDAEMU_RUNTIME inline Worker* cur_worker() { return static_cast<Worker*>(current_header()->worker); }
CUDAEMU_RUNTIME inline Thread* cur_thread() { return static_cast<Thread*>(current_header()->thread); }

CUDAEMU_RUNTIME inline void mark_runnable(Worker* w, unsigned i) { w->runnable[i >> 6] |= 1ull << (i & 63); }
CUDAEMU_RUNTIME inline void mark_blocked(Worker* w, unsigned i) { w->runnable[i >> 6] &= ~(1ull << (i & 63)); }

CUDAEMU_RUNTIME inline uint64_t splitmix(uint64_t* s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Records the first error of the launch; later ones are usually consequences of it.
CUDAEMU_RUNTIME inline void record_error(Worker* w, const char* fmt, va_list ap) {
  Launch* L = w->L;
  pthread_mutex_lock(&L->err_lock);
  if (!__atomic_load_n(&L->failed, __ATOMIC_ACQUIRE)) {
    int n = snprintf(L->err, sizeof(L->err), "block (%u,%u,%u)", w->block_idx.x, w->block_idx.y,
                     w->block_idx.z);
    if (w->cur != nullptr)
      n += snprintf(L->err + n, sizeof(L->err) - n, " thread (%u,%u,%u)", w->cur->tid.x,
                    w->cur->tid.y, w->cur->tid.z);
    n += snprintf(L->err + n, sizeof(L->err) - n, ": ");
    vsnprintf(L->err + n, sizeof(L->err) - n, fmt, ap);
    __atomic_store_n(&L->failed, 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&L->err_lock);
  w->failed = true;
}

// Called on a fiber: record the error and never come back (the block is abandoned; kernel
// frames hold nothing that needs destroying).
[[noreturn]] CUDAEMU_RUNTIME inline void fail(const char* fmt, ...) {
  Worker* w = cur_worker();
  va_list ap;
  va_start(ap, fmt);
  record_error(w, fmt, ap);
  va_end(ap);
  Thread* t = w->cur;
  context_switch(&t->ctx, &w->sched);
  __builtin_unreachable();
}

CUDAEMU_RUNTIME inline void fail_from_scheduler(Worker* w, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  record_error(w, fmt, ap);
  va_end(ap);
}

CUDAEMU_RUNTIME inline Thread* pick_next(Worker* w);

// The calling fiber has blocked (or exited): switch straight to the next thread the policy
// picks, or keep running if that is the caller itself. The scheduler loop only comes back
// in when nothing is runnable (block done or deadlock) or after an error.
CUDAEMU_RUNTIME inline void yield(Worker* w, Thread* t) {
  Thread* next = w->failed ? nullptr : pick_next(w);
  if (next == t) return;
  if (next == nullptr) {
    context_switch(&t->ctx, &w->sched);
    return;
  }
  w->cur = next;
  context_switch(&t->ctx, &next->ctx);
}

CUDAEMU_RUNTIME inline void release_barrier(Worker* w, BarrierKind kind) {
  int count = 0;
  for (unsigned i = 0; i < w->nthreads; ++i)
    if (w->threads[i].wait == Wait::Barrier && w->threads[i].pred) ++count;
  const int waiting = static_cast<int>(w->at_barrier);
  for (unsigned i = 0; i < w->nthreads; ++i) {
    Thread& t = w->threads[i];
    if (t.wait != Wait::Barrier) continue;
    switch (kind) {
      case BarrierKind::Plain: t.result = 0; break;
      case BarrierKind::Count: t.result = static_cast<uint64_t>(count); break;
      case BarrierKind::And: t.result = count == waiting; break;
      case BarrierKind::Or: t.result = count != 0; break;
    }
    t.wait = Wait::None;
    mark_runnable(w, t.index);
  }
  w->at_barrier = 0;
}

CUDAEMU_RUNTIME inline int block_barrier(BarrierKind kind, int pred) {
  Worker* w = cur_worker();
  Thread* t = w->cur;
  if (w->exited != 0 && w->L->strict)
    fail("__syncthreads reached after %u thread(s) of the block exited; every barrier must be "
         "reached by the whole block",
         w->exited);
  t->wait = Wait::Barrier;
  mark_blocked(w, t->index);
  t->pred = pred != 0;
  if (++w->at_barrier == w->live) release_barrier(w, kind);
  yield(w, t);
  return static_cast<int>(t->result);
}

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

CUDAEMU_RUNTIME inline uint64_t collective(Op op, uint32_t mask, uint64_t value, int param, int pred, int width) {
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
    p = &q;
  }
  if (p == nullptr) {
    p = &ws.pending[ws.npending++];
    *p = Pending{mask, 0u, op, width};
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
    complete_collective(w, ws, done, t->warp);
  }
  yield(w, t);
  return t->result;
}

[[noreturn]] CUDAEMU_RUNTIME inline void thread_exit(Worker* w, Thread* t) {
  const uint32_t bit = 1u << t->lane;
  WarpState& ws = w->warps[t->warp];
  for (int i = 0; i < ws.npending; ++i)
    if (ws.pending[i].mask & bit)
      fail("lane %u returned while lanes 0x%08x of its warp wait for it in %s(mask 0x%08x)",
           t->lane, ws.pending[i].arrived, op_name(ws.pending[i].op), ws.pending[i].mask);
  if (w->at_barrier != 0 && w->L->strict)
    fail("thread returned while %u thread(s) of the block wait at __syncthreads", w->at_barrier);
  t->wait = Wait::Done;
  mark_blocked(w, t->index);
  ws.exited |= bit;
  --w->live;
  ++w->exited;
  if (w->at_barrier != 0 && w->at_barrier == w->live) release_barrier(w, BarrierKind::Plain);
  yield(w, t);
  __builtin_unreachable();
}

CUDAEMU_RUNTIME inline void fiber_main(void* arg) {
  Thread* t = static_cast<Thread*>(arg);
  Worker* w = cur_worker();
  w->L->kernel_invoker(w->L->kernel_fn, w->L->args);
  thread_exit(w, t);
}

// Lowest runnable index >= from (no wrap), or -1.
CUDAEMU_RUNTIME inline int next_runnable(const Worker* w, unsigned from) {
  const unsigned words = (w->nthreads + 63) / 64;
  unsigned wi = from >> 6;
  if (wi >= words) return -1;
  uint64_t bits = w->runnable[wi] & (~0ull << (from & 63));
  for (;;) {
    if (bits) return static_cast<int>(wi * 64 + __builtin_ctzll(bits));
    if (++wi >= words) return -1;
    bits = w->runnable[wi];
  }
}

// Highest runnable index <= from (no wrap), or -1.
CUDAEMU_RUNTIME inline int prev_runnable(const Worker* w, unsigned from) {
  int wi = static_cast<int>(from >> 6);
  const unsigned shift = 63 - (from & 63);
  uint64_t bits = w->runnable[wi] & (~0ull >> shift);
  for (;;) {
    if (bits) return wi * 64 + 63 - __builtin_clzll(bits);
    if (--wi < 0) return -1;
    bits = w->runnable[wi];
  }
}

CUDAEMU_RUNTIME inline Thread* pick_next(Worker* w) {
  const unsigned n = w->nthreads;
  int i = -1;
  switch (w->L->policy) {
    case kGreedy: i = next_runnable(w, 0); break;
    case kGreedyReverse: i = prev_runnable(w, n - 1); break;
    case kReverse:
      i = w->cursor > 0 ? prev_runnable(w, w->cursor - 1) : -1;
      if (i < 0) i = prev_runnable(w, n - 1);
      break;
    case kRandom:
      i = next_runnable(w, static_cast<unsigned>(splitmix(&w->rng) % n));
      if (i < 0) i = next_runnable(w, 0);
      break;
    default:  // forward round-robin
      i = next_runnable(w, w->cursor + 1);
      if (i < 0) i = next_runnable(w, 0);
      break;
  }
  if (i < 0) return nullptr;
  w->cursor = static_cast<unsigned>(i);
  return &w->threads[i];
}

CUDAEMU_RUNTIME inline void report_deadlock(Worker* w) {
  char buf[1024];
  int n = snprintf(buf, sizeof(buf), "deadlock: %u thread(s) wait at __syncthreads", w->at_barrier);
  for (unsigned wi = 0; wi < w->nwarps && n < static_cast<int>(sizeof(buf)) - 96; ++wi) {
    const WarpState& ws = w->warps[wi];
    for (int i = 0; i < ws.npending; ++i)
      n += snprintf(buf + n, sizeof(buf) - n, "; warp %u lanes 0x%08x wait in %s(mask 0x%08x)", wi,
                    ws.pending[i].arrived, op_name(ws.pending[i].op), ws.pending[i].mask);
  }
  w->cur = nullptr;
  fail_from_scheduler(w, "%s", buf);
}

}  // namespace cudaemu

namespace cudaemu {
// By value, from unchecked functions: the kernel's own (memory-checked) code never loads
// the emulator's state, which may sit next to a tensor on the heap.
CUDAEMU_RUNTIME inline uint3 thread_idx() { return cur_thread()->tid; }
CUDAEMU_RUNTIME inline uint3 block_idx() { return cur_worker()->block_idx; }
CUDAEMU_RUNTIME inline dim3 block_dim() { return cur_worker()->L->block; }
CUDAEMU_RUNTIME inline dim3 grid_dim() { return cur_worker()->L->grid; }
}  // namespace cudaemu

// Built-in variables, read through the current fiber.
#define threadIdx (::cudaemu::thread_idx())
#define blockIdx (::cudaemu::block_idx())
#define blockDim (::cudaemu::block_dim())
#define gridDim (::cudaemu::grid_dim())

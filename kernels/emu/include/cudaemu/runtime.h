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
  ReduceMinU, ReduceMinI, ReduceMaxU, ReduceMaxI,
  // Tensor-core instructions (tensor_core.h): warp-wide, each lane's operands behind `value`.
  MmaK16Bf16, MmaK16F16, MmaK8Bf16, MmaK8F16, LdmX1, LdmX2, LdmX4, LdmX1T, LdmX2T, LdmX4T
};

CUDAEMU_RUNTIME inline bool is_tensor_op(Op op) { return op >= Op::MmaK16Bf16; }

CUDAEMU_RUNTIME inline const char* op_name(Op op) {
  static const char* names[] = {"__syncwarp", "__shfl_sync", "__shfl_up_sync",
                                "__shfl_down_sync", "__shfl_xor_sync", "__ballot_sync",
                                "__any_sync", "__all_sync", "__reduce_add_sync",
                                "__reduce_add_sync", "__reduce_min_sync", "__reduce_min_sync",
                                "__reduce_max_sync", "__reduce_max_sync",
                                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                                "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32",
                                "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32",
                                "ldmatrix.sync.aligned.m8n8.x1.shared.b16",
                                "ldmatrix.sync.aligned.m8n8.x2.shared.b16",
                                "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                                "ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16",
                                "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16",
                                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"};
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
  unsigned async_groups;   // cp.async.commit_group count: the id of the group now open
  unsigned async_pending;  // this thread's cp.async copies that have not landed
};

struct Pending {  // one warp collective that some lanes have reached
  uint32_t mask, arrived;
  Op op;
  int width;
  // Call site of a .aligned instruction (tensor_core.h): every lane must execute the same one.
  const char* file;
  unsigned line;
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

// One cp.async in flight: it lands (the bytes are copied) at the issuing thread's
// cp.async.wait_group that covers its group, not before (tensor_core.h).
struct AsyncCopy {
  char* dst;
  const char* src;
  unsigned bytes, src_bytes;  // bytes past src_bytes are zero-filled
  unsigned thread, group;
};

struct AsyncState {
  AsyncCopy* copies;  // every thread's copies in flight, in issue order
  unsigned n, cap;
  // With the memory check on: per 4-byte word of shared memory (the TLS segment), 1 + the
  // index of the thread whose cp.async has it in flight, 0 if none (memcheck.h reads it).
  uint16_t* shadow;
  size_t words;
};

struct Worker {
  Launch* L;
  uintptr_t tls_lo, tls_hi;  // this OS thread's shared memory (the module's TLS segment)
  AsyncState async;
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

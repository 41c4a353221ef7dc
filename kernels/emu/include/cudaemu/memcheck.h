// Memory checking: every load and store of the module goes through the hooks below (g++
// -fsanitize=kernel-address with asan-instrumentation-with-call-threshold=0 turns each access
// into a call of __asan_{load,store}{1,2,4,8,16,N}_noabort). While a checked launch runs on
// this OS thread:
//
// * an address in the module's thread-local segment (all __shared__ memory) must lie inside
//   one variable: each __shared__ variable is aligned to kSharedAlign (keywords.h), so the
//   bytes past its end are padding that belongs to no variable, and an access one past the
//   end of `q_s` hits padding rather than the next array. Dynamic shared arrays end at the
//   launch's dynamic size.
// * an address near a pointer argument (inside the allocation its view lies in, e.g. the
//   fused QKV tensor a query slice comes from, or up to kGlobalGuard bytes beyond it) must be
//   an element of that argument's strided view: a read past a row of a strided slice, or
//   past the end of the tensor, fails.
//
// Addresses elsewhere (fiber stacks, the emulator's own heap) are not checked; kGlobalGuard is
// 8 bytes because glibc keeps at least a chunk's 8-byte size field between the end of one heap
// block and the data of the next, so no other allocation's data lies within it. The emulator's
// own code (CUDAEMU_RUNTIME, and the built-in variables read by value) is not instrumented.
// Failures name the block, thread, variable and index.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "runtime.h"

namespace cudaemu {

constexpr size_t kSharedAlign = CUDAEMU_SHARED_ALIGN;
constexpr uintptr_t kGlobalGuard = 8;
constexpr int kMaxDims = 6;

struct MemArg {  // one pointer argument's view, as numpy describes it
  uint64_t near_lo, near_hi;  // the allocation the view lies in (or the view) +- kGlobalGuard
  uint64_t span_hi;           // one past the view's last byte (the first is `base`)
  int64_t contiguous;         // every byte of [base, span_hi) is an element of the view
  uint64_t base;
  uint64_t itemsize;
  int64_t ndim;
  int64_t shape[kMaxDims];
  int64_t strides[kMaxDims];  // bytes, non-negative
  const char* name;
};

struct MemVar {  // one thread-local symbol of the module (a __shared__ variable or the runtime's)
  uint64_t offset;  // from the start of the module's TLS segment
  uint64_t size;
  const char* name;
  int64_t dynamic;  // 1: extern __shared__; its size is the launch's dynamic shared memory
};

struct MemCheck {
  uintptr_t tls_lo, tls_hi;
  const MemVar* vars;  // sorted by offset
  int nvars;
  const MemArg* args;
  int nargs;
  uint64_t dynamic_bytes;
  const AsyncState* async;  // this worker's cp.async copies in flight
};

static thread_local MemCheck* tl_memcheck;

struct ModuleVars {
  const MemVar* vars = nullptr;
  int nvars = 0;
};

inline ModuleVars& module_vars() {
  static ModuleVars v;
  return v;
}

__attribute__((no_sanitize_address)) inline bool view_has(const MemArg& a, uintptr_t addr) {
  if (addr < a.base) return false;
  uint64_t off = addr - a.base;
  for (int64_t d = 0; d < a.ndim; ++d) {  // numpy order: outermost dimension first
    if (a.strides[d] == 0) continue;
    const uint64_t i = off / static_cast<uint64_t>(a.strides[d]);
    if (i >= static_cast<uint64_t>(a.shape[d])) return false;
    off -= i * static_cast<uint64_t>(a.strides[d]);
  }
  return off < a.itemsize;
}

// An access to shared memory that a cp.async has in flight: the copy may land at any moment
// up to the issuing thread's cp.async.wait_group that covers it, so the read sees old or new
// bytes (and a write may be overwritten) depending on timing.
__attribute__((no_sanitize_address, noinline)) inline void memcheck_async(
    const MemCheck* mc, uintptr_t addr, size_t n, bool store, const MemVar* var) {
  const AsyncState* as = mc->async;
  const uint64_t off = addr - mc->tls_lo;
  for (uint64_t word = off / 4; word <= (off + n - 1) / 4 && word < as->words; ++word) {
    if (as->shadow[word] == 0) continue;
    const unsigned issuer = as->shadow[word] - 1u;
    unsigned group = 0;
    for (unsigned i = 0; i < as->n; ++i) {
      const AsyncCopy& c = as->copies[i];
      const uintptr_t lo = reinterpret_cast<uintptr_t>(c.dst);
      if (c.thread == issuer && mc->tls_lo + word * 4 >= lo && mc->tls_lo + word * 4 < lo + c.bytes)
        group = c.group;
    }
    const Worker* w = cur_worker();
    const uint3 tid = w->threads[issuer].tid;
    const bool self = w->cur != nullptr && w->cur->index == issuer;
    tl_memcheck = nullptr;  // the report itself runs instrumented runtime code
    fail("shared memory %s of %zu bytes (variable %s, byte offset %llu) while %s cp.async to it "
         "is in flight: group %u of thread (%u,%u,%u) is not covered by a cp.async.wait_group of "
         "that thread yet%s",
         store ? "write" : "read", n, var != nullptr ? var->name : "?",
         static_cast<unsigned long long>(var != nullptr ? off - var->offset : off),
         self ? "this thread's" : "another thread's", group, tid.x, tid.y, tid.z,
         self ? "" : " (wait_group, then __syncthreads, before other threads use the data)");
  }
}

__attribute__((no_sanitize_address, noinline)) inline void memcheck_shared(
    const MemCheck* mc, uintptr_t addr, size_t n, bool store) {
  const uint64_t off = addr - mc->tls_lo;
  const MemVar* below = nullptr;  // the variable with the highest offset <= off
  for (int i = 0; i < mc->nvars && mc->vars[i].offset <= off; ++i) below = &mc->vars[i];
  if (below != nullptr) {
    const uint64_t size = below->dynamic ? mc->dynamic_bytes : below->size;
    if (off + n <= below->offset + size) {
      if (mc->async != nullptr && mc->async->n != 0 && mc->async->shadow != nullptr)
        memcheck_async(mc, addr, n, store, below);
      return;
    }
  }
  const char* what = store ? "write" : "read";
  tl_memcheck = nullptr;  // the report itself runs instrumented runtime code
  if (below == nullptr)
    fail("out-of-bounds shared memory %s of %zu bytes before every __shared__ variable", what, n);
  const uint64_t size = below->dynamic ? mc->dynamic_bytes : below->size;
  fail("out-of-bounds shared memory %s of %zu bytes: variable %s (%llu bytes%s), index %llu "
       "(in units of the access; byte offset %llu)",
       what, n, below->name, static_cast<unsigned long long>(size),
       below->dynamic ? " of dynamic shared memory at this launch" : "",
       static_cast<unsigned long long>((off - below->offset) / n),
       static_cast<unsigned long long>(off - below->offset));
}

__attribute__((no_sanitize_address, noinline)) inline void memcheck_global(
    const MemCheck* mc, uintptr_t addr, size_t n, bool store) {
  const MemArg* near = nullptr;
  for (int i = 0; i < mc->nargs; ++i) {
    const MemArg& a = mc->args[i];
    if (addr >= a.base && addr + n <= a.span_hi &&
        (a.contiguous || (view_has(a, addr) && view_has(a, addr + n - 1))))
      return;  // an element of some view
    if (near == nullptr && addr + n > a.near_lo && addr < a.near_hi) near = &a;
  }
  if (near == nullptr) return;  // not near any argument: stack or emulator memory
  tl_memcheck = nullptr;  // the report itself runs instrumented runtime code
  const long long idx = (static_cast<long long>(addr) - static_cast<long long>(near->base)) /
                        static_cast<long long>(near->itemsize);
  fail("out-of-bounds global memory %s of %zu bytes: argument %s (%llu-byte elements), "
       "index %lld (byte offset %lld), outside its view",
       store ? "write" : "read", n, near->name, static_cast<unsigned long long>(near->itemsize),
       idx, static_cast<long long>(addr) - static_cast<long long>(near->base));
}

__attribute__((no_sanitize_address)) inline void memcheck(uintptr_t addr, size_t n, bool store) {
  const MemCheck* mc = tl_memcheck;
  if (mc == nullptr) return;
  char probe;  // the running fiber's stack: locals are never checked
  const uintptr_t stack = reinterpret_cast<uintptr_t>(&probe) & ~(uintptr_t(kStackBytes) - 1);
  if (addr >= stack && addr < stack + kStackBytes) return;
  if (addr >= mc->tls_lo && addr < mc->tls_hi) {
    memcheck_shared(mc, addr, n, store);
    return;
  }
  memcheck_global(mc, addr, n, store);
}

}  // namespace cudaemu

#define CUDAEMU_HOOK(size)                                                                     \
  extern "C" __attribute__((no_sanitize_address)) void __asan_load##size##_noabort(uintptr_t a) { \
    ::cudaemu::memcheck(a, size, false);                                                       \
  }                                                                                            \
  extern "C" __attribute__((no_sanitize_address)) void __asan_store##size##_noabort(uintptr_t a) { \
    ::cudaemu::memcheck(a, size, true);                                                        \
  }
CUDAEMU_HOOK(1)
CUDAEMU_HOOK(2)
CUDAEMU_HOOK(4)
CUDAEMU_HOOK(8)
CUDAEMU_HOOK(16)
#undef CUDAEMU_HOOK
extern "C" __attribute__((no_sanitize_address)) void __asan_loadN_noabort(uintptr_t a, size_t n) {
  if (n) ::cudaemu::memcheck(a, n, false);
}
extern "C" __attribute__((no_sanitize_address)) void __asan_storeN_noabort(uintptr_t a, size_t n) {
  if (n) ::cudaemu::memcheck(a, n, true);
}
extern "C" __attribute__((no_sanitize_address)) void __asan_handle_no_return() {}
// Initialisation-order checking is ASan runtime business; there is none here.
extern "C" __attribute__((no_sanitize_address)) void __asan_before_dynamic_init(const char*) {}
extern "C" __attribute__((no_sanitize_address)) void __asan_after_dynamic_init() {}

// Grid launch: blocks are handed to worker OS threads; each worker poisons its shared memory
// and runs one block at a time on fibers.
#pragma once

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memcheck.h"
#include "runtime.h"

namespace cudaemu {

struct KernelEntry {
  const char* name;
  void (*fn)();
  void (*invoker)(void (*)(), void**);
  int nargs;
  const unsigned short* sizes;
  const char* kinds;
};

struct Span {
  char* ptr;
  size_t size;
};

// Returns the calling OS thread's instances of the module's dynamic shared memory arrays.
typedef int (*DynamicSmemFn)(Span* out, int max);

struct ModuleInfo {
  void* anchor;  // any address inside the module, to find its TLS segment
  DynamicSmemFn dynamic_smem;
  size_t dynamic_smem_capacity;
};

struct PhdrQuery {
  size_t modid;
  size_t memsz;
};

CUDAEMU_RUNTIME inline int find_tls_phdr(struct dl_phdr_info* info, size_t, void* data) {
  PhdrQuery* q = static_cast<PhdrQuery*>(data);
  if (info->dlpi_tls_modid != q->modid) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i)
    if (info->dlpi_phdr[i].p_type == PT_TLS) {
      q->memsz = info->dlpi_phdr[i].p_memsz;
      return 1;
    }
  return 0;
}

// The calling thread's copy of this module's TLS segment, i.e. all of its __shared__ memory.
CUDAEMU_RUNTIME inline Span module_tls(void* anchor) {
  Dl_info di;
  if (dladdr(anchor, &di) == 0) return Span{nullptr, 0};
  void* h = dlopen(di.dli_fname, RTLD_NOLOAD | RTLD_LAZY);
  if (h == nullptr) return Span{nullptr, 0};
  size_t modid = 0;
  void* data = nullptr;
  dlinfo(h, RTLD_DI_TLS_MODID, &modid);
  dlinfo(h, RTLD_DI_TLS_DATA, &data);
  dlclose(h);
  PhdrQuery q{modid, 0};
  dl_iterate_phdr(&find_tls_phdr, &q);
  return Span{static_cast<char*>(data), q.memsz};
}

// Fill all shared memory with 0xFF bytes (NaN as float, -1 as int) so that a read of memory
// this block never wrote is visible in the results. Only the part of each dynamic array the
// launch asked for is filled, to keep block start cheap.
CUDAEMU_RUNTIME inline void poison_shared(Span tls, Span* dyn, int ndyn, size_t dynamic_bytes) {
  const ModuleVars& mv = module_vars();
  if (mv.nvars > 0) {  // the variables only, not the padding between them (memcheck.h)
    for (int i = 0; i < mv.nvars; ++i) {
      const MemVar& v = mv.vars[i];
      if (v.dynamic || strncmp(v.name, "cudaemu::", 9) == 0) continue;  // runtime state
      memset(tls.ptr + v.offset, 0xff, v.size);
    }
    for (int i = 0; i < ndyn; ++i)
      memset(dyn[i].ptr, 0xff, dynamic_bytes < dyn[i].size ? dynamic_bytes : dyn[i].size);
    return;
  }
  MemCheck* const saved = tl_memcheck;  // lives in the segment filled below
  for (int i = 1; i < ndyn; ++i)
    for (int j = i; j > 0 && dyn[j].ptr < dyn[j - 1].ptr; --j) {
      const Span t = dyn[j];
      dyn[j] = dyn[j - 1];
      dyn[j - 1] = t;
    }
  char* p = tls.ptr;
  char* const end = tls.ptr + tls.size;
  for (int i = 0; i < ndyn; ++i) {
    if (dyn[i].ptr > p) memset(p, 0xff, static_cast<size_t>(dyn[i].ptr - p));
    memset(dyn[i].ptr, 0xff, dynamic_bytes < dyn[i].size ? dynamic_bytes : dyn[i].size);
    p = dyn[i].ptr + dyn[i].size;
  }
  if (end > p) memset(p, 0xff, static_cast<size_t>(end - p));
  tl_memcheck = saved;
}

// Copies still in flight when a block ends never landed for anyone: drop them.
CUDAEMU_RUNTIME inline void async_reset(Worker* w) {
  AsyncState& as = w->async;
  if (as.shadow != nullptr)
    for (unsigned i = 0; i < as.n; ++i) {
      const AsyncCopy& c = as.copies[i];
      const size_t first = (reinterpret_cast<uintptr_t>(c.dst) - w->tls_lo) / 4;
      for (size_t k = 0; k < c.bytes / 4 && first + k < as.words; ++k) as.shadow[first + k] = 0;
    }
  as.n = 0;
}

struct StackPool {
  pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
  Stack* items = nullptr;
  size_t count = 0, capacity = 0;
};

CUDAEMU_RUNTIME inline StackPool& stack_pool() {
  static StackPool pool;
  return pool;
}

CUDAEMU_RUNTIME inline Stack stack_take() {
  StackPool& p = stack_pool();
  pthread_mutex_lock(&p.lock);
  if (p.count > 0) {
    const Stack s = p.items[--p.count];
    pthread_mutex_unlock(&p.lock);
    return s;
  }
  pthread_mutex_unlock(&p.lock);
  return stack_alloc();
}

CUDAEMU_RUNTIME inline void stack_give(Stack s) {
  StackPool& p = stack_pool();
  pthread_mutex_lock(&p.lock);
  if (p.count == p.capacity) {
    p.capacity = p.capacity ? 2 * p.capacity : 256;
    p.items = static_cast<Stack*>(realloc(p.items, p.capacity * sizeof(Stack)));
  }
  p.items[p.count++] = s;
  pthread_mutex_unlock(&p.lock);
}

struct WorkerArgs {
  Worker* w;
  const ModuleInfo* module;
};

CUDAEMU_RUNTIME inline void run_block(Worker* w, unsigned long long b, Span tls, Span* dyn, int ndyn) {
  Launch* L = w->L;
  const unsigned long long gx = L->grid.x, gy = L->grid.y;
  w->block_linear = b;
  w->block_idx = uint3{static_cast<unsigned>(b % gx), static_cast<unsigned>((b / gx) % gy),
                       static_cast<unsigned>(b / (gx * gy))};
  poison_shared(tls, dyn, ndyn, L->dynamic_smem);
  const unsigned bx = L->block.x, by = L->block.y;
  for (unsigned i = 0; i < w->nthreads; ++i) {
    Thread& t = w->threads[i];
    t.tid = uint3{i % bx, (i / bx) % by, i / (bx * by)};
    t.index = i;
    t.warp = i / 32;
    t.lane = i % 32;
    t.wait = Wait::None;
    t.async_groups = 0;
    t.async_pending = 0;
    FiberHeader* h = stack_header(w->stacks[i]);
    h->thread = &t;
    h->worker = w;
    context_init(&t.ctx, w->stacks[i], i, &fiber_main, &t);
  }
  for (unsigned wi = 0; wi < w->nwarps; ++wi) {
    const unsigned lanes = w->nthreads - wi * 32 < 32 ? w->nthreads - wi * 32 : 32;
    w->warps[wi].exists = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
    w->warps[wi].exited = 0;
    w->warps[wi].npending = 0;
  }
  async_reset(w);
  for (unsigned i = 0; i < kWords; ++i) w->runnable[i] = 0;
  for (unsigned i = 0; i < w->nthreads; ++i) mark_runnable(w, i);
  w->live = w->nthreads;
  w->exited = 0;
  w->at_barrier = 0;
  w->cursor = L->policy == kReverse ? 0 : w->nthreads - 1;
  w->rng = L->seed ^ (b * 0x2545f4914f6cdd1dull);
  while (w->live > 0 && !w->failed) {
    Thread* t = pick_next(w);
    if (t == nullptr) {
      report_deadlock(w);
      break;
    }
    w->cur = t;
    context_switch(&w->sched, &t->ctx);
  }
  w->cur = nullptr;
}

CUDAEMU_RUNTIME inline void* worker_main(void* arg) {
  WorkerArgs* a = static_cast<WorkerArgs*>(arg);
  Worker* w = a->w;
  Launch* L = w->L;
  *reinterpret_cast<volatile char*>(&tls_anchor) = 0;  // allocates this thread's module TLS
  const Span tls = module_tls(a->module->anchor);
  const char* tl_addr = &tls_anchor;
  if (tls.ptr == nullptr || tl_addr < tls.ptr || tl_addr >= tls.ptr + tls.size) {
    w->block_idx = uint3{0, 0, 0};
    fail_from_scheduler(w, "cannot locate the module's thread-local segment (shared memory)");
    return nullptr;
  }
  Span dyn[16];
  const int ndyn = a->module->dynamic_smem ? a->module->dynamic_smem(dyn, 16) : 0;
  const ModuleVars& mv = module_vars();
  const uintptr_t tls_lo = reinterpret_cast<uintptr_t>(tls.ptr);
  w->tls_lo = tls_lo;
  w->tls_hi = tls_lo + tls.size;
  MemCheck mc{tls_lo, tls_lo + tls.size, mv.vars, mv.nvars, L->margs, L->nmargs, L->dynamic_smem,
              &w->async};
  tl_memcheck = L->memcheck ? &mc : nullptr;
  for (;;) {
    if (__atomic_load_n(&L->failed, __ATOMIC_ACQUIRE)) break;
    const unsigned long long b = __atomic_fetch_add(&L->next_block, 1ull, __ATOMIC_RELAXED);
    if (b >= L->nblocks) break;
    run_block(w, b, tls, dyn, ndyn);
  }
  tl_memcheck = nullptr;
  return nullptr;
}

CUDAEMU_RUNTIME inline int launch(const KernelEntry& k, const ModuleInfo& module, const unsigned* grid,
                  const unsigned* block, unsigned long long dynamic_smem, void** args,
                  int policy, unsigned long long seed, int workers, int strict, char* err,
                  size_t errlen, const MemArg* margs = nullptr, int nmargs = 0,
                  int memcheck = 0) {
  const unsigned long long nthreads =
      static_cast<unsigned long long>(block[0]) * block[1] * block[2];
  const unsigned long long nblocks = static_cast<unsigned long long>(grid[0]) * grid[1] * grid[2];
  if (nblocks == 0 || nthreads == 0 || nthreads > 1024 || block[2] > 64 || grid[1] > 65535 ||
      grid[2] > 65535 || grid[0] > 2147483647u) {
    snprintf(err, errlen, "invalid launch configuration: grid (%u,%u,%u) block (%u,%u,%u)", grid[0],
             grid[1], grid[2], block[0], block[1], block[2]);
    return 2;
  }
  if (dynamic_smem > module.dynamic_smem_capacity) {
    snprintf(err, errlen, "dynamic shared memory %llu exceeds the emulator's %zu bytes",
             dynamic_smem, module.dynamic_smem_capacity);
    return 2;
  }
  Launch L;
  L.margs = margs;
  L.nmargs = nmargs;
  L.memcheck = memcheck != 0;
  L.args = args;
  L.grid = dim3(grid[0], grid[1], grid[2]);
  L.block = dim3(block[0], block[1], block[2]);
  L.dynamic_smem = dynamic_smem;
  L.policy = policy;
  L.seed = seed;
  L.strict = strict != 0;
  L.nblocks = nblocks;
  L.next_block = 0;
  L.failed = 0;
  L.err[0] = '\0';
  pthread_mutex_init(&L.err_lock, nullptr);
  L.kernel_fn = k.fn;
  L.kernel_invoker = k.invoker;

  const unsigned long long nw64 = workers < 1 ? 1ull : static_cast<unsigned long long>(workers);
  const unsigned nw = static_cast<unsigned>(nw64 < nblocks ? nw64 : nblocks);
  const unsigned n = static_cast<unsigned>(nthreads);
  const unsigned nwarps = (n + 31) / 32;
  Worker* ws = static_cast<Worker*>(calloc(nw, sizeof(Worker)));
  WorkerArgs* wa = static_cast<WorkerArgs*>(calloc(nw, sizeof(WorkerArgs)));
  for (unsigned i = 0; i < nw; ++i) {
    Worker& w = ws[i];
    w.L = &L;
    w.nthreads = n;
    w.nwarps = nwarps;
    w.threads = static_cast<Thread*>(calloc(n, sizeof(Thread)));
    w.warps = static_cast<WarpState*>(calloc(nwarps, sizeof(WarpState)));
    w.stacks = static_cast<Stack*>(calloc(n, sizeof(Stack)));
    for (unsigned t = 0; t < n; ++t) w.stacks[t] = stack_take();
    wa[i] = WorkerArgs{&w, &module};
  }
  if (nw == 1) {
    worker_main(&wa[0]);
  } else {
    pthread_t* th = static_cast<pthread_t*>(calloc(nw, sizeof(pthread_t)));
    for (unsigned i = 0; i < nw; ++i) pthread_create(&th[i], nullptr, &worker_main, &wa[i]);
    for (unsigned i = 0; i < nw; ++i) pthread_join(th[i], nullptr);
    free(th);
  }
  for (unsigned i = 0; i < nw; ++i) {
    for (unsigned t = 0; t < n; ++t) stack_give(ws[i].stacks[t]);
    free(ws[i].stacks);
    free(ws[i].async.copies);
    free(ws[i].async.shadow);
    free(ws[i].threads);
    free(ws[i].warps);
  }
  free(ws);
  free(wa);
  pthread_mutex_destroy(&L.err_lock);
  if (L.failed) {
    snprintf(err, errlen, "%s", L.err);
    return 1;
  }
  return 0;
}

}  // namespace cudaemu

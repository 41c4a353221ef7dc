// Fibers: every CUDA thread of a running block is a fiber with its own stack. Switching
// happens only inside the runtime (barriers, warp collectives, thread exit), so a fiber
// switch costs a few dozen instructions instead of an OS context switch.
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__) && !defined(CUDAEMU_USE_UCONTEXT)
#define CUDAEMU_ASM_FIBERS 1
#else
#include <ucontext.h>
#endif

namespace cudaemu {

// Stacks are aligned to their size, so a fiber finds its own header (which thread it is)
// by masking the address of any local variable: no thread-local lookup on the hot path.
constexpr size_t kStackBytes = 256 * 1024;  // virtual; only touched pages get memory
constexpr size_t kHeaderBytes = 64;

struct Stack {
  char* base;  // aligned to kStackBytes; the lowest page is a guard page
};

struct FiberHeader {
  void* thread;
  void* worker;
};

CUDAEMU_RUNTIME inline Stack stack_alloc() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* p = mmap(nullptr, 2 * kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                 -1, 0);
  if (p == MAP_FAILED) abort();
  const uintptr_t raw = reinterpret_cast<uintptr_t>(p);
  const uintptr_t base = (raw + kStackBytes - 1) & ~(uintptr_t(kStackBytes) - 1);
  if (base > raw) munmap(p, base - raw);
  const uintptr_t tail = base + kStackBytes;
  const uintptr_t end = raw + 2 * kStackBytes;
  if (end > tail) munmap(reinterpret_cast<void*>(tail), end - tail);
  // An overflowing fiber faults on the guard page instead of corrupting its neighbour.
  mprotect(reinterpret_cast<void*>(base), page, PROT_NONE);
  return Stack{reinterpret_cast<char*>(base)};
}

CUDAEMU_RUNTIME inline void stack_free(Stack s) { munmap(s.base, kStackBytes); }

CUDAEMU_RUNTIME inline FiberHeader* stack_header(Stack s) {
  return reinterpret_cast<FiberHeader*>(s.base + kStackBytes - kHeaderBytes);
}

// Only valid on a fiber stack.
CUDAEMU_RUNTIME inline FiberHeader* current_header() {
  char probe;
  const uintptr_t base = reinterpret_cast<uintptr_t>(&probe) & ~(uintptr_t(kStackBytes) - 1);
  return reinterpret_cast<FiberHeader*>(base + kStackBytes - kHeaderBytes);
}

#ifdef CUDAEMU_ASM_FIBERS

// cudaemu_switch(save, load): push callee-saved registers, store the stack pointer in *save,
// load the other fiber's stack pointer and pop its registers. cudaemu_fiber_entry is where a
// new fiber "returns" to on its first switch; it calls fn(arg) from r13/r12.
extern "C" void cudaemu_switch(void** save_sp, void* load_sp);
extern "C" void cudaemu_fiber_entry();
asm(R"(
    .text
    .p2align 4
    .type cudaemu_switch,@function
    .hidden cudaemu_switch
cudaemu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cudaemu_switch, .-cudaemu_switch

    .p2align 4
    .type cudaemu_fiber_entry,@function
    .hidden cudaemu_fiber_entry
cudaemu_fiber_entry:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size cudaemu_fiber_entry, .-cudaemu_fiber_entry
)");

struct Context {
  void* sp = nullptr;
};

// Lay out the new stack so that the first switch pops six registers (r12 = arg,
// r13 = fn) and returns into cudaemu_fiber_entry with rsp 16-byte aligned, as the
// ABI wants before the `call`.
// Stacks aligned to 256 KB would put every fiber's hot frames in the same cache sets;
// starting each fiber at a different offset spreads them out.
CUDAEMU_RUNTIME inline size_t stack_color(unsigned index) { return (static_cast<size_t>(index) * 4160u) % 65536u; }

CUDAEMU_RUNTIME inline void context_init(Context* c, Stack s, unsigned index, void (*fn)(void*), void* arg) {
  uintptr_t top = reinterpret_cast<uintptr_t>(s.base + kStackBytes - kHeaderBytes -
                                              stack_color(index)) & ~uintptr_t(15);
  uintptr_t* sp = reinterpret_cast<uintptr_t*>(top);
  *--sp = reinterpret_cast<uintptr_t>(&cudaemu_fiber_entry);
  *--sp = 0;                                   // rbp
  *--sp = 0;                                   // rbx
  *--sp = reinterpret_cast<uintptr_t>(arg);    // r12
  *--sp = reinterpret_cast<uintptr_t>(fn);     // r13
  *--sp = 0;                                   // r14
  *--sp = 0;                                   // r15
  c->sp = sp;
}

CUDAEMU_RUNTIME inline void context_switch(Context* from, Context* to) { cudaemu_switch(&from->sp, to->sp); }

#else  // portable fallback, about ten times slower (swapcontext makes a syscall)

struct Context {
  ucontext_t uc;
};

CUDAEMU_RUNTIME inline void context_trampoline(unsigned hi_fn, unsigned lo_fn, unsigned hi_arg, unsigned lo_arg) {
  auto fn = reinterpret_cast<void (*)(void*)>((uintptr_t(hi_fn) << 32) | lo_fn);
  fn(reinterpret_cast<void*>((uintptr_t(hi_arg) << 32) | lo_arg));
  abort();
}

CUDAEMU_RUNTIME inline void context_init(Context* c, Stack s, unsigned index, void (*fn)(void*), void* arg) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = s.base;
  c->uc.uc_stack.ss_size = kStackBytes - kHeaderBytes - stack_color(index);
  c->uc.uc_link = nullptr;
  const uintptr_t f = reinterpret_cast<uintptr_t>(fn), a = reinterpret_cast<uintptr_t>(arg);
  makecontext(&c->uc, reinterpret_cast<void (*)()>(&context_trampoline), 4, unsigned(f >> 32),
              unsigned(f), unsigned(a >> 32), unsigned(a));
}

CUDAEMU_RUNTIME inline void context_switch(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }

#endif

}  // namespace cudaemu

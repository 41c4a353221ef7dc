// Kernel table and C entry points of an emulated module. The generated wrapper translation
// unit (kernels/emu/wrapper.py) includes the kernel source, then this file, then lists the
// kernels with CUDAEMU_KERNEL and closes with CUDAEMU_MODULE.
#pragma once

#include <stddef.h>

#include <type_traits>
#include <utility>

#include "launch.h"

namespace cudaemu {

// Parameter kinds the Python launcher checks its arguments against.
template <typename A>
constexpr char kind_of() {
  using D = typename std::decay<A>::type;
  if (std::is_pointer<D>::value) return 'p';
  if (std::is_same<D, bool>::value) return 'b';
  if (std::is_floating_point<D>::value) return 'f';
  if (std::is_integral<D>::value) return std::is_signed<D>::value ? 'i' : 'u';
  return 'o';
}

template <typename... A, size_t... I>
CUDAEMU_RUNTIME inline void invoke_impl(void (*f)(A...), void** args, std::index_sequence<I...>) {
  f(*static_cast<typename std::remove_cv<typename std::remove_reference<A>::type>::type*>(
      args[I])...);
}

template <typename... A>
CUDAEMU_RUNTIME inline void invoke(void (*fn)(), void** args) {
  invoke_impl(reinterpret_cast<void (*)(A...)>(fn), args, std::index_sequence_for<A...>{});
}

template <typename... A>
CUDAEMU_RUNTIME inline KernelEntry make_entry(const char* name, void (*f)(A...)) {
  static const unsigned short sizes[] = {static_cast<unsigned short>(sizeof(A))..., 0};
  static const char kinds[] = {kind_of<A>()..., '\0'};
  return KernelEntry{name, reinterpret_cast<void (*)()>(f), &invoke<A...>,
                     static_cast<int>(sizeof...(A)), sizes, kinds};
}

}  // namespace cudaemu

#define CUDAEMU_KERNEL(name_string, ...) ::cudaemu::make_entry(name_string, &__VA_ARGS__)

#define CUDAEMU_EXPORT extern "C" __attribute__((visibility("default")))

#define CUDAEMU_MODULE(table, dynamic_smem_fn, dynamic_smem_capacity)                          \
  CUDAEMU_EXPORT int cudaemu_kernel_count() {                                                 \
    return static_cast<int>(sizeof(table) / sizeof(table[0]));                                \
  }                                                                                           \
  CUDAEMU_EXPORT const char* cudaemu_kernel_name(int i) { return table[i].name; }             \
  CUDAEMU_EXPORT const char* cudaemu_kernel_kinds(int i) { return table[i].kinds; }           \
  CUDAEMU_EXPORT const unsigned short* cudaemu_kernel_sizes(int i) { return table[i].sizes; } \
  CUDAEMU_EXPORT int cudaemu_launch(int i, const unsigned* grid, const unsigned* block,      \
                                    unsigned long long smem, void** args, int policy,         \
                                    unsigned long long seed, int workers, int strict,         \
                                    char* err, size_t errlen, const ::cudaemu::MemArg* margs, \
                                    int nmargs, int memcheck) {                               \
    static const ::cudaemu::ModuleInfo info{reinterpret_cast<void*>(&cudaemu_kernel_count),   \
                                            dynamic_smem_fn, dynamic_smem_capacity};          \
    return ::cudaemu::launch(table[i], info, grid, block, smem, args, policy, seed, workers,  \
                             strict, err, errlen, margs, nmargs, memcheck);                   \
  }                                                                                           \
  /* The module's thread-local symbols (offset, size, name), sorted; the caller keeps them. */ \
  CUDAEMU_EXPORT void cudaemu_set_vars(const ::cudaemu::MemVar* vars, int n) {                \
    ::cudaemu::module_vars().vars = vars;                                                     \
    ::cudaemu::module_vars().nvars = n;                                                       \
  }

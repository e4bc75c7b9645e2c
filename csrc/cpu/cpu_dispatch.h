// What the kernels of this directory share about the CPU they run on: whether the AVX2 + FMA
// build of a kernel may run, and how many OpenMP threads a call's work is worth.
#pragma once

#include <cstdint>

// On x86-64 a kernel may also be compiled for AVX2 with fused multiply-adds
// (__attribute__((target("avx2,fma")))) and picked at run time with has_avx2_fma(); the
// library itself stays runnable on any x86-64 (no -march=native). A machine always picks the
// same build, so its results never change.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VLLM_X86_FMA 1

namespace vllm_cpu {
// Whether this CPU runs AVX2 and FMA instructions (asked once per process).
inline bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
}  // namespace vllm_cpu
#endif

namespace vllm_cpu {
// Threads for a call of `grains` units of work, each worth waking a sleeping OpenMP thread
// for: at most `threads`, at least 1.
inline int threads_for(int64_t grains, int threads) {
  return grains < threads ? (grains > 1 ? static_cast<int>(grains) : 1) : threads;
}
}  // namespace vllm_cpu

// What the kernels of this directory share about the CPU they run on: whether the AVX2 + FMA
// build of a kernel may run, how many OpenMP threads a call's work is worth, and the eight-lane
// float vector the elementwise kernels are written in.
#pragma once

#include <cstdint>
#include <cstring>

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

// Eight float lanes; GCC and Clang lower them to whatever vector width the target has. The
// kernels are compiled plain and for AVX2 with fused multiply-adds; ISO C++ does not contract
// a * b + c into one rounding, so both builds compute the same numbers. The helpers are always
// inlined, so no v8 crosses a call (GCC warns about that ABI otherwise).
#pragma GCC diagnostic ignored "-Wpsabi"
namespace vllm_cpu {
typedef float v8 __attribute__((vector_size(32)));
__attribute__((always_inline)) inline v8 load8(const float* p) {
  v8 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
__attribute__((always_inline)) inline void store8(float* p, v8 x) { std::memcpy(p, &x, sizeof(x)); }
}  // namespace vllm_cpu

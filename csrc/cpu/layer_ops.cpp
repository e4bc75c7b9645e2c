// The small per-layer ops of a decoder layer on the CPU, each one call instead of several torch
// operations: RMSNorm with its residual add, neox-style RoPE from the cos/sin tables, SiLU-and-
// multiply, and the KV-cache write.
//
// At decode batch shapes these ops move a few kilobytes each, and torch spends more on
// dispatching their five to fifteen operations (and allocating their intermediates) than on
// the arithmetic: a layer of SmolLM2 at one token spent about 0.4 ms in them, as much as its
// o/qkv products. Each function computes every row on its own, in an order that depends only
// on the row's length, so a row's result is the same in any batch and for any thread count.
// Float32, rows of contiguous values with a row stride (in floats); callers check dtypes and
// layouts (vllm/model_executor/layers/layer_ops.py); indices are checked here, since a bad one
// would read or write foreign memory. Every function returns a VLLM_* status and writes
// nothing when it is not VLLM_OK.

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_dispatch.h"
#include "export.h"

namespace {
constexpr int32_t VLLM_OK = 0;
constexpr int32_t VLLM_BAD_LAYER_OP = 10;
constexpr int32_t VLLM_BAD_ROPE_POSITION = 11;
constexpr int32_t VLLM_BAD_SLOT = 12;
// Elements worth waking another thread for: a decode batch's rows are done on the calling
// thread (a sleeping OpenMP thread takes tens of microseconds to wake), a prefill's shared out.
constexpr int64_t kGrainElements = 1 << 18;

using vllm_cpu::load8;
using vllm_cpu::store8;
using vllm_cpu::v8;
typedef double v4d __attribute__((vector_size(32)));


int threads_for_rows(int64_t rows, int64_t width, int32_t num_threads) {
#if defined(_OPENMP)
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  return vllm_cpu::threads_for(rows * width / kGrainElements, threads);
#else
  (void)rows;
  (void)width;
  (void)num_threads;
  return 1;
#endif
}

struct Norm {
  const float* x;
  int64_t x_stride;
  const float* residual;  // null: no residual add
  int64_t residual_stride;
  float* sum;  // receives x + residual (unused without a residual)
  int64_t sum_stride;
  const float* weight;
  int64_t hidden;
  float eps;
  float* out;
  int64_t out_stride;
};

// One row: s = x (+ residual), out = weight * (s * (1 / sqrt(mean(s^2) + eps))).
__attribute__((always_inline)) inline void norm_row(const Norm& p, int64_t r) {
  const int64_t d = p.hidden, d8 = d - d % 8;
  const float* x = p.x + r * p.x_stride;
  const float* s = x;
  if (p.residual != nullptr) {
    const float* res = p.residual + r * p.residual_stride;
    float* sum = p.sum + r * p.sum_stride;
    for (int64_t i = 0; i < d8; i += 8) store8(sum + i, load8(x + i) + load8(res + i));
    for (int64_t i = d8; i < d; ++i) sum[i] = x[i] + res[i];
    s = sum;
  }
  // The squares summed in double (exact products, eight lanes, then lane by lane in a fixed
  // order): closer to the true mean than a float sum, so closer to any other float order
  // (torch's own, say) than those are to each other.
  v4d lo = {}, hi = {};
  for (int64_t i = 0; i < d8; i += 8) {
    const v8 v = load8(s + i);
    const v4d a = __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), v4d);
    const v4d b = __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), v4d);
    lo += a * a;
    hi += b * b;
  }
  double total = ((lo[0] + hi[0]) + (lo[1] + hi[1])) + ((lo[2] + hi[2]) + (lo[3] + hi[3]));
  for (int64_t i = d8; i < d; ++i) total += static_cast<double>(s[i]) * s[i];
  const float mean = static_cast<float>(total / static_cast<double>(d));
  const float inv = 1.0f / std::sqrt(mean + p.eps);
  float* out = p.out + r * p.out_stride;
  const v8 invv = {inv, inv, inv, inv, inv, inv, inv, inv};
  for (int64_t i = 0; i < d8; i += 8) store8(out + i, load8(p.weight + i) * (load8(s + i) * invv));
  for (int64_t i = d8; i < d; ++i) out[i] = p.weight[i] * (s[i] * inv);
}

void norm_rows(const Norm& p, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) norm_row(p, r);
}
#if defined(VLLM_X86_FMA)
__attribute__((target("avx2,fma"))) void norm_rows_fma(const Norm& p, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) norm_row(p, r);
}
#endif

void norm_any(const Norm& p, int64_t r0, int64_t r1) {
#if defined(VLLM_X86_FMA)
  if (vllm_cpu::has_avx2_fma()) {
    norm_rows_fma(p, r0, r1);
    return;
  }
#endif
  norm_rows(p, r0, r1);
}

// exp(x) of eight lanes, each alone (as paged_attention.cpp's): x = k ln 2 + r, exp(r) by its
// Taylor series to r^7, times 2^k; below -87.3 gives 0, above 88 infinity (2^k must stay a
// normal number), a NaN stays NaN.
typedef int32_t v8i __attribute__((vector_size(32)));
__attribute__((always_inline)) inline v8 exp8(v8 x) {
  const v8 in = x;
  const v8i nan = x != x;
  const v8i tiny = x < -87.3f;
  const v8i huge = x > 88.0f;
  x = (tiny | nan) ? -87.3f : x;
  x = huge ? 88.0f : x;
  const v8 shift = {12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f,
                    12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f};
  const v8 k = (x * 1.44269504f + shift) - shift;
  const v8 r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  v8 p = r * (1.0f / 5040.0f) + (1.0f / 720.0f);
  p = p * r + (1.0f / 120.0f);
  p = p * r + (1.0f / 24.0f);
  p = p * r + (1.0f / 6.0f);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const v8i bits = (__builtin_convertvector(k, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const v8 inf = {INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY};
  v8 y = tiny ? 0.0f : p * scale;
  y = huge ? inf : y;
  return nan ? in : y;
}

struct Gated {
  const float* x;  // rows of [gate | up], 2 * width values
  int64_t x_stride;
  int64_t width;
  float* out;
  int64_t out_stride;
};

// out = gate / (1 + exp(-gate)) * up, eight at a time; the tail through a padded vector.
__attribute__((always_inline)) inline void silu_row(const Gated& p, int64_t r) {
  const float* gate = p.x + r * p.x_stride;
  const float* up = gate + p.width;
  float* out = p.out + r * p.out_stride;
  const int64_t d8 = p.width - p.width % 8;
  const v8 one = {1, 1, 1, 1, 1, 1, 1, 1};
  for (int64_t i = 0; i < d8; i += 8) {
    const v8 g = load8(gate + i);
    store8(out + i, g / (one + exp8(-g)) * load8(up + i));
  }
  if (d8 < p.width) {
    float gb[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ub[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ob[8];
    const size_t n = static_cast<size_t>(p.width - d8) * sizeof(float);
    std::memcpy(gb, gate + d8, n);
    std::memcpy(ub, up + d8, n);
    const v8 g = load8(gb);
    store8(ob, g / (one + exp8(-g)) * load8(ub));
    std::memcpy(out + d8, ob, n);
  }
}

void silu_rows(const Gated& p, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) silu_row(p, r);
}
#if defined(VLLM_X86_FMA)
__attribute__((target("avx2,fma"))) void silu_rows_fma(const Gated& p, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) silu_row(p, r);
}
#endif

void silu_any(const Gated& p, int64_t r0, int64_t r1) {
#if defined(VLLM_X86_FMA)
  if (vllm_cpu::has_avx2_fma()) {
    silu_rows_fma(p, r0, r1);
    return;
  }
#endif
  silu_rows(p, r0, r1);
}

// Splits rows [0, rows) over `threads` OpenMP threads (contiguous shares) and runs f on each.
template <typename F>
void over_rows(int64_t rows, int threads, F f) {
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    f(rows * t / n, rows * (t + 1) / n);
  }
#else
  (void)threads;
  f(0, rows);
#endif
}
}  // namespace

// out[r] = weight * RMSNorm(s) for r < rows, s = x[r], or x[r] + residual[r] when residual is
// not null (then also written to sum[r]). Returns VLLM_BAD_LAYER_OP for a non-positive size.
VLLM_EXPORT int32_t vllm_rms_norm(const float* x, int64_t x_stride, const float* residual,
                                  int64_t residual_stride, float* sum, int64_t sum_stride,
                                  const float* weight, int64_t rows, int64_t hidden, float eps,
                                  float* out, int64_t out_stride, int32_t num_threads) {
  if (rows <= 0 || hidden <= 0) return VLLM_BAD_LAYER_OP;
  const Norm p{x, x_stride, residual, residual_stride, sum, sum_stride, weight, hidden, eps,
               out, out_stride};
  over_rows(rows, threads_for_rows(rows, hidden, num_threads),
            [&](int64_t r0, int64_t r1) { norm_any(p, r0, r1); });
  return VLLM_OK;
}

// Neox-style RoPE of query rows q [tokens, q_heads * head_size] and key rows k [tokens,
// k_heads * head_size] (row strides q_stride, k_stride), written to q_out and k_out (which
// may be q and k): for each head, with i < head_size / 2, c = cos_table[position][i] and
// s = sin_table[position][i] (tables of max_position rows of head_size / 2 values),
// x1 = head[i], x2 = head[i + head_size / 2]: out[i] = x1 * c - x2 * s and
// out[i + head_size / 2] = x2 * c + x1 * s, each product rounded on its own (torch's
// order). Returns VLLM_BAD_ROPE_POSITION for a position outside [0, max_position) and
// VLLM_BAD_LAYER_OP for a non-positive or odd head size.
VLLM_EXPORT int32_t vllm_rotary_neox(const int64_t* positions, int64_t tokens,
                                     const float* cos_table, const float* sin_table,
                                     int64_t max_position, int64_t head_size, const float* q,
                                     int64_t q_stride, int64_t q_heads, const float* k,
                                     int64_t k_stride, int64_t k_heads, float* q_out,
                                     int64_t q_out_stride, float* k_out, int64_t k_out_stride) {
  if (head_size <= 0 || head_size % 2 != 0 || tokens < 0 || q_heads < 0 || k_heads < 0) {
    return VLLM_BAD_LAYER_OP;
  }
  for (int64_t t = 0; t < tokens; ++t) {
    if (positions[t] < 0 || positions[t] >= max_position) return VLLM_BAD_ROPE_POSITION;
  }
  const int64_t half = head_size / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos_table + positions[t] * half;
    const float* s = sin_table + positions[t] * half;
    for (int which = 0; which < 2; ++which) {
      const float* src = which == 0 ? q + t * q_stride : k + t * k_stride;
      float* dst = which == 0 ? q_out + t * q_out_stride : k_out + t * k_out_stride;
      const int64_t heads = which == 0 ? q_heads : k_heads;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x = src + h * head_size;
        float* y = dst + h * head_size;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
          y[i] = a - b;
          y[i + half] = e + f;
        }
      }
    }
  }
  return VLLM_OK;
}

// out[r, :width] = silu(x[r, :width]) * x[r, width:2 * width] for r < rows. Returns
// VLLM_BAD_LAYER_OP for a non-positive size.
VLLM_EXPORT int32_t vllm_silu_and_mul(const float* x, int64_t x_stride, int64_t rows,
                                      int64_t width, float* out, int64_t out_stride,
                                      int32_t num_threads) {
  if (rows <= 0 || width <= 0) return VLLM_BAD_LAYER_OP;
  const Gated p{x, x_stride, width, out, out_stride};
  over_rows(rows, threads_for_rows(rows, 2 * width, num_threads),
            [&](int64_t r0, int64_t r1) { silu_any(p, r0, r1); });
  return VLLM_OK;
}

// Copies token t's key and value rows (row_size values each, at key + t * key_stride and
// value + t * value_stride) to slot slots[t] of the keys and of the values (each
// num_slots rows of row_size values, contiguous; the values right after the keys), for
// t < tokens; a slot of -1 is skipped. Returns VLLM_BAD_SLOT (nothing written) for another
// slot outside [0, num_slots).
VLLM_EXPORT int32_t vllm_write_kv(const float* key, int64_t key_stride, const float* value,
                                  int64_t value_stride, const int64_t* slots, int64_t tokens,
                                  float* cache, int64_t num_slots, int64_t row_size) {
  if (tokens < 0 || row_size <= 0 || num_slots < 0) return VLLM_BAD_LAYER_OP;
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < -1 || slots[t] >= num_slots) return VLLM_BAD_SLOT;
  }
  const size_t bytes = static_cast<size_t>(row_size) * sizeof(float);
  float* values = cache + num_slots * row_size;
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(cache + slots[t] * row_size, key + t * key_stride, bytes);
    std::memcpy(values + slots[t] * row_size, value + t * value_stride, bytes);
  }
  return VLLM_OK;
}

// A few rows times a wide float32 weight, y = x w, in one fixed order per output element:
// the k axis is cut into chunks of `chunk` terms; each chunk is a fused multiply-add chain
// started from zero, and the chunks' sums are added left to right.
//
// Why: a BLAS rounds a row of a CPU GEMM differently depending on how many rows share the
// call (a few rows take another kernel than many), and async = sync equivalence needs each
// request's logits to be independent of its batch. The LM head is the widest product of a
// model and, at batch one, the most expensive thing it does; padding one row to the BLAS's
// many-row kernel pays several rows of it. With `chunk` set to the BLAS's own k blocking
// (the Python side finds it by comparing with the BLAS once per weight), this kernel gives
// the many-row kernel's numbers, bit for bit, for any number of rows, while reading the
// weight once: the cost of one row is that of streaming the weight from memory.
//
// w is [k, n] row-major (w_stride floats between rows): the transpose of a column-major
// [n, k] layer weight, as layers/column_major.py stores it. Columns are split into tiles
// shared out over OpenMP threads. A weight too large to stay in cache streams through once
// in long runs while a tile's partial sums stay in L1/L2 (`tile`); a small one is read in
// short runs by a register-blocked kernel (`tile_in_registers`). Which one runs, and how many
// threads, changes the time only: every element is summed in the order above.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_dispatch.h"

#if defined(VLLM_X86_FMA)
#include <immintrin.h>
#endif

#include "export.h"

namespace {
constexpr int32_t VLLM_OK = 0;
constexpr int32_t VLLM_BAD_DENSE = 9;
// Floats of partial sums a thread keeps per tile (256 KiB, within any recent core's L2): the
// wider a tile, the longer the runs of a weight row the prefetcher streams, so a tile is as
// wide as this allows for the call's rows.
constexpr int64_t kAccFloats = 64 * 1024;
// A weight up to this size stays in the cores' caches from one call to the next (a layer of a
// small model); its products keep their partial sums in registers. A larger one (the LM head)
// streams from memory, which is then the cost, and is read in long runs instead (`tile`).
constexpr int64_t kCachedWeightBytes = 2 << 20;
// Multiply-adds worth waking another thread for (tens of microseconds of work): a small
// layer's product at a few rows is done before a sleeping team would be up.
constexpr int64_t kGrain = 1 << 18;

struct Dense {
  const float* x;
  int64_t rows, x_stride;
  const float* w;
  int64_t k, n, w_stride, chunk;
  float* y;
  int64_t y_stride;
  int64_t tile;  // columns per tile
};

// acc[j] = fma(a, w[j], acc[j]) for j < len; `first` starts the chain (acc = a * w[j], which
// is what fma(a, w, 0) rounds to).
inline void fma_row_scalar(float a, const float* w, float* acc, int64_t len, bool first) {
  if (first) {
    for (int64_t j = 0; j < len; ++j) acc[j] = a * w[j];
  } else {
    for (int64_t j = 0; j < len; ++j) acc[j] = std::fma(a, w[j], acc[j]);
  }
}

#if defined(VLLM_X86_FMA)
__attribute__((target("avx2,fma"))) void fma_row_avx2(float a, const float* w, float* acc,
                                                      int64_t len, bool first) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t j = 0;
  if (first) {
    for (; j + 8 <= len; j += 8) _mm256_storeu_ps(acc + j, _mm256_mul_ps(av, _mm256_loadu_ps(w + j)));
  } else {
    for (; j + 8 <= len; j += 8) {
      _mm256_storeu_ps(acc + j,
                       _mm256_fmadd_ps(av, _mm256_loadu_ps(w + j), _mm256_loadu_ps(acc + j)));
    }
  }
  fma_row_scalar(a, w + j, acc + j, len - j, first);
}
#endif

inline void fma_row(float a, const float* w, float* acc, int64_t len, bool first) {
#if defined(VLLM_X86_FMA)
  if (vllm_cpu::has_avx2_fma()) {
    fma_row_avx2(a, w, acc, len, first);
    return;
  }
#endif
  fma_row_scalar(a, w, acc, len, first);
}

// Columns [j0, j0 + len) of every row. acc holds rows * p.tile floats of one chunk's sums.
void tile(const Dense& p, int64_t j0, int64_t len, float* acc) {
  for (int64_t c0 = 0; c0 < p.k; c0 += p.chunk) {
    const int64_t c1 = c0 + p.chunk < p.k ? c0 + p.chunk : p.k;
    for (int64_t kk = c0; kk < c1; ++kk) {
      const float* wrow = p.w + kk * p.w_stride + j0;
      for (int64_t r = 0; r < p.rows; ++r) {
        fma_row(p.x[r * p.x_stride + kk], wrow, acc + r * p.tile, len, kk == c0);
      }
    }
    for (int64_t r = 0; r < p.rows; ++r) {
      float* out = p.y + r * p.y_stride + j0;
      const float* part = acc + r * p.tile;
      if (c0 == 0) {
        std::memcpy(out, part, static_cast<size_t>(len) * sizeof(float));
      } else {
        for (int64_t j = 0; j < len; ++j) out[j] = out[j] + part[j];
      }
    }
  }
}

// One output element, in the same order as everything else here.
inline float element(const Dense& p, int64_t r, int64_t j) {
  const float* x = p.x + r * p.x_stride;
  float total = 0.0f;
  for (int64_t c0 = 0; c0 < p.k; c0 += p.chunk) {
    const int64_t c1 = c0 + p.chunk < p.k ? c0 + p.chunk : p.k;
    float part = x[c0] * p.w[c0 * p.w_stride + j];
    for (int64_t kk = c0 + 1; kk < c1; ++kk) part = std::fma(x[kk], p.w[kk * p.w_stride + j], part);
    total = c0 == 0 ? part : total + part;
  }
  return total;
}

#if defined(VLLM_X86_FMA)
// Rows [r0, r0 + R) times columns [j, j + 8 C): the R x C partial sums stay in registers over
// a whole chunk, enough of them (8 or more) to cover the latency of a multiply-add chain.
// For a weight that stays in cache, where `tile`'s partial sums in memory cost more than the
// arithmetic.
template <int R, int C>
__attribute__((target("avx2,fma"))) void block(const Dense& p, int64_t r0, int64_t j) {
  __m256 acc[R][C], total[R][C] = {};
  for (int64_t c0 = 0; c0 < p.k; c0 += p.chunk) {
    const int64_t c1 = c0 + p.chunk < p.k ? c0 + p.chunk : p.k;
    {
      const float* wk = p.w + c0 * p.w_stride + j;
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(p.x + (r0 + r) * p.x_stride + c0);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_mul_ps(a, _mm256_loadu_ps(wk + 8 * c));
      }
    }
    for (int64_t kk = c0 + 1; kk < c1; ++kk) {
      const float* wk = p.w + kk * p.w_stride + j;
      __m256 wv[C];
      for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(wk + 8 * c);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(p.x + (r0 + r) * p.x_stride + kk);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(a, wv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        total[r][c] = c0 == 0 ? acc[r][c] : _mm256_add_ps(total[r][c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(p.y + (r0 + r) * p.y_stride + j + 8 * c, total[r][c]);
  }
}

// Rows [r0, r0 + R) of columns [j0, j1): wide blocks, then 8-column ones, then single columns.
template <int R, int C>
void rows_in_registers(const Dense& p, int64_t r0, int64_t j0, int64_t j1) {
  int64_t j = j0;
  for (; j + 8 * C <= j1; j += 8 * C) block<R, C>(p, r0, j);
  for (; j + 8 <= j1; j += 8) block<R, 1>(p, r0, j);
  for (; j < j1; ++j) {
    for (int r = 0; r < R; ++r) p.y[(r0 + r) * p.y_stride + j] = element(p, r0 + r, j);
  }
}

// Columns [j0, j0 + len) of every row, four rows at a time.
void tile_in_registers(const Dense& p, int64_t j0, int64_t len) {
  int64_t r = 0;
  for (; r + 4 <= p.rows; r += 4) rows_in_registers<4, 2>(p, r, j0, j0 + len);
  switch (p.rows - r) {
    case 3: rows_in_registers<3, 3>(p, r, j0, j0 + len); break;
    case 2: rows_in_registers<2, 4>(p, r, j0, j0 + len); break;
    case 1: rows_in_registers<1, 8>(p, r, j0, j0 + len); break;
    default: break;
  }
}
#endif
}  // namespace

// y[r, j] = sum over i < k of x[r, i] * w[i, j] for r < rows, j < n, in the order described
// at the top of this file. Strides are in floats. num_threads <= 0: OpenMP's default.
// Returns VLLM_BAD_DENSE (nothing written) for a non-positive size or chunk or a stride
// shorter than its row.
VLLM_EXPORT int32_t vllm_dense_rows(const float* x, int64_t rows, int64_t x_stride,
                                    const float* w, int64_t k, int64_t n, int64_t w_stride,
                                    int64_t chunk, float* y, int64_t y_stride,
                                    int32_t num_threads) {
  if (rows <= 0 || k <= 0 || n <= 0 || chunk <= 0 || x_stride < k || w_stride < n ||
      y_stride < n) {
    return VLLM_BAD_DENSE;
  }
#if defined(_OPENMP)
  int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int64_t grains = rows * k * n / kGrain;
  threads = vllm_cpu::threads_for(grains, threads);
#else
  const int threads = 1;
  (void)num_threads;
#endif
  // As few tiles as the accumulator budget allows, a multiple of the threads so that each
  // gets the same share, and 16 columns wide at least.
  int64_t tiles = (n * rows + kAccFloats - 1) / kAccFloats;
  tiles = (tiles + threads - 1) / threads * threads;
  int64_t width = ((n + tiles - 1) / tiles + 15) / 16 * 16;
  tiles = (n + width - 1) / width;
  const Dense p{x, rows, x_stride, w, k, n, w_stride, chunk, y, y_stride, width};
#if defined(VLLM_X86_FMA)
  const bool in_registers =
      vllm_cpu::has_avx2_fma() && k * n * sizeof(float) <= kCachedWeightBytes;
#else
  const bool in_registers = false;
#endif
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) if (tiles > 1)
#endif
  {
    std::vector<float> acc(in_registers ? 0 : static_cast<size_t>(rows * width));
#if defined(_OPENMP)
    // Static: every tile costs the same, and neighbouring tiles stay on one thread.
#pragma omp for schedule(static)
#endif
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t j0 = t * width;
      const int64_t len = n - j0 < width ? n - j0 : width;
#if defined(VLLM_X86_FMA)
      if (in_registers) {
        tile_in_registers(p, j0, len);
        continue;
      }
#endif
      tile(p, j0, len, acc.data());
    }
  }
  return VLLM_OK;
}

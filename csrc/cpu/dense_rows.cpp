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
// shared out over OpenMP threads. A tile is computed in passes: each pass takes kUnroll
// consecutive terms of a chunk and two rows at a time, reading those kUnroll weight rows side by
// side (as many memory streams, which a weight too large for the caches needs to be read at the
// memory's speed) and carrying every element's chain through all of them in a register, so the
// partial sums kept between passes (`acc`, per tile) are read and written once per kUnroll
// terms instead of once per term. The chunk's last pass adds its sums into y. Which pass shapes
// run, and how many threads, changes the time only: every element is summed in the order above.

#include <cmath>
#include <cstdint>
#include <memory>

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
// Floats of partial sums a thread keeps per tile (64 KiB, within any recent core's L2): a
// tile is as wide as this allows for the call's rows, so weight rows are read in long runs.
constexpr int64_t kAccFloats = 16 * 1024;
// Consecutive terms of a chunk per pass (weight rows read side by side).
constexpr int kUnroll = 4;
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
  int64_t tile;  // columns per tile (also the row stride of acc)
};

// Where a pass's sums go: kept for the chunk's next pass, or (its last pass) into y, where
// the first chunk's sums are stored and a later chunk's added.
enum class Sink { kAcc, kFirstChunk, kLaterChunk };

// One sum of a pass, stored where kSink says. a: its slot in acc; out: its element of y.
template <Sink kSink>
inline void sink(float* a, float* out, float s) {
  if constexpr (kSink == Sink::kAcc) {
    *a = s;
  } else if constexpr (kSink == Sink::kFirstChunk) {
    *out = s;
  } else {
    *out = *out + s;
  }
}

// Rows [r0, r0 + R) by columns [j0, j0 + len) of the U terms kk .. kk + U - 1 of a chunk, one
// element at a time. kStart: kk is the chunk's first term, so each chain starts as x * w;
// otherwise it continues from acc (offset to column j0 of the tile; row stride p.tile).
template <int R, int U, bool kStart, Sink kSink>
void pass_scalar(const Dense& p, float* acc, int64_t r0, int64_t j0, int64_t len, int64_t kk) {
  const float* w = p.w + kk * p.w_stride + j0;
  for (int64_t j = 0; j < len; ++j) {
    for (int r = 0; r < R; ++r) {
      const float* x = p.x + (r0 + r) * p.x_stride + kk;
      float* a = acc + (r0 + r) * p.tile + j;
      float s = kStart ? x[0] * w[j] : *a;
      for (int u = kStart ? 1 : 0; u < U; ++u) s = std::fma(x[u], w[u * p.w_stride + j], s);
      sink<kSink>(a, p.y + (r0 + r) * p.y_stride + j0 + j, s);
    }
  }
}

#if defined(VLLM_X86_FMA)
// The same, eight columns at a time (the columns past the last eight as pass_scalar does
// them): the x terms are broadcast once per pass, each weight vector loaded once for the R
// rows.
template <int R, int U, bool kStart, Sink kSink>
__attribute__((target("avx2,fma"))) void pass_avx2(const Dense& p, float* acc, int64_t r0,
                                                   int64_t j0, int64_t len, int64_t kk) {
  __m256 xv[R][U];
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < U; ++u) xv[r][u] = _mm256_set1_ps(p.x[(r0 + r) * p.x_stride + kk + u]);
  }
  // Locals, not reads of p in the loop: the compiler reloads a struct's fields after every
  // store through a float pointer.
  const int64_t w_stride = p.w_stride;
  const float* w = p.w + kk * w_stride + j0;
  float* a_rows[R];
  float* y_rows[R];
  for (int r = 0; r < R; ++r) {
    a_rows[r] = acc + (r0 + r) * p.tile;
    y_rows[r] = p.y + (r0 + r) * p.y_stride + j0;
  }
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    __m256 wv[U];
    for (int u = 0; u < U; ++u) wv[u] = _mm256_loadu_ps(w + u * w_stride + j);
    for (int r = 0; r < R; ++r) {
      float* a = a_rows[r] + j;
      __m256 s = kStart ? _mm256_mul_ps(xv[r][0], wv[0]) : _mm256_loadu_ps(a);
      for (int u = kStart ? 1 : 0; u < U; ++u) s = _mm256_fmadd_ps(xv[r][u], wv[u], s);
      float* out = y_rows[r] + j;
      if constexpr (kSink == Sink::kAcc) {
        _mm256_storeu_ps(a, s);
      } else if constexpr (kSink == Sink::kFirstChunk) {
        _mm256_storeu_ps(out, s);
      } else {
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), s));
      }
    }
  }
  if (j < len) pass_scalar<R, U, kStart, kSink>(p, acc + j, r0, j0 + j, len - j, kk);
}
#endif

template <int R, int U, bool kStart, Sink kSink>
void pass(const Dense& p, float* acc, int64_t r0, int64_t j0, int64_t len, int64_t kk) {
#if defined(VLLM_X86_FMA)
  if (vllm_cpu::has_avx2_fma()) {
    pass_avx2<R, U, kStart, kSink>(p, acc, r0, j0, len, kk);
    return;
  }
#endif
  pass_scalar<R, U, kStart, kSink>(p, acc, r0, j0, len, kk);
}

// A pass over every row, two at a time.
template <int U, bool kStart, Sink kSink>
void pass_rows(const Dense& p, float* acc, int64_t j0, int64_t len, int64_t kk) {
  int64_t r = 0;
  for (; r + 2 <= p.rows; r += 2) pass<2, U, kStart, kSink>(p, acc, r, j0, len, kk);
  if (r < p.rows) pass<1, U, kStart, kSink>(p, acc, r, j0, len, kk);
}

// The same, its instantiation picked by `start` (kk is the chunk's first term) and `where`.
template <int U>
void pass_rows(const Dense& p, float* acc, int64_t j0, int64_t len, int64_t kk, bool start,
               Sink where) {
  switch (where) {
    case Sink::kAcc:
      if (start) {
        pass_rows<U, true, Sink::kAcc>(p, acc, j0, len, kk);
      } else {
        pass_rows<U, false, Sink::kAcc>(p, acc, j0, len, kk);
      }
      break;
    case Sink::kFirstChunk:
      if (start) {
        pass_rows<U, true, Sink::kFirstChunk>(p, acc, j0, len, kk);
      } else {
        pass_rows<U, false, Sink::kFirstChunk>(p, acc, j0, len, kk);
      }
      break;
    case Sink::kLaterChunk:
      if (start) {
        pass_rows<U, true, Sink::kLaterChunk>(p, acc, j0, len, kk);
      } else {
        pass_rows<U, false, Sink::kLaterChunk>(p, acc, j0, len, kk);
      }
      break;
  }
}

// Columns [j0, j0 + len) of every row; acc holds rows * p.tile floats.
void tile(const Dense& p, int64_t j0, int64_t len, float* acc) {
  for (int64_t c0 = 0; c0 < p.k; c0 += p.chunk) {
    const int64_t c1 = c0 + p.chunk < p.k ? c0 + p.chunk : p.k;
    for (int64_t kk = c0; kk < c1;) {
      const int64_t u = c1 - kk >= kUnroll ? kUnroll : 1;
      const Sink where = kk + u < c1 ? Sink::kAcc
                                     : (c0 == 0 ? Sink::kFirstChunk : Sink::kLaterChunk);
      if (u == kUnroll) {
        pass_rows<kUnroll>(p, acc, j0, len, kk, kk == c0, where);
      } else {
        pass_rows<1>(p, acc, j0, len, kk, kk == c0, where);
      }
      kk += u;
    }
  }
}
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
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) if (tiles > 1)
#endif
  {
    // Uninitialised: every slot is written before it is read.
    std::unique_ptr<float[]> acc(new float[static_cast<size_t>(rows * width)]);
#if defined(_OPENMP)
    // Static: every tile costs the same, and neighbouring tiles stay on one thread.
#pragma omp for schedule(static)
#endif
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t j0 = t * width;
      tile(p, j0, n - j0 < width ? n - j0 : width, acc.get());
    }
  }
  return VLLM_OK;
}

// Decode attention on the CPU, reading the paged KV cache in place.
//
// The torch backend's fallback gathers each request's blocks into a contiguous copy before
// multiplying: a memory copy per layer as large as the context. Here every (request, KV head)
// pair walks its own blocks directly: scores of the group's query heads against each cached key,
// one exact softmax over the whole row, then the values weighted in position order. Each pair is
// computed alone, in a fixed order that depends only on its own context length, so a request's
// output is bit-identical in any batch and for any thread count. Pairs are spread over the
// OpenMP team (torch's own libgomp when torch is loaded first, so no second pool of threads).
//
// Layouts (float32): query rows [.., num_heads, head_size] with a row stride; the cache
// [2, num_blocks, block_size, kv_heads, head_size] contiguous (keys, then values); the output
// like the query.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

// On x86-64 the kernel is also built for AVX2 with fused multiply-adds (cpu_dispatch.h).
#include "cpu_dispatch.h"

#include "export.h"

namespace {
constexpr int32_t VLLM_OK = 0;
constexpr int32_t VLLM_BAD_DECODE = 7;
constexpr int32_t VLLM_BAD_SHAPE = 8;
// Blocks sit anywhere in the cache, so the hardware prefetcher cannot guess the next one: the
// kernel asks for the block this many ahead while it works on one.
constexpr int64_t kAhead = 4;
// Bytes of keys and values worth waking another thread for. A sleeping OpenMP thread (the
// engine's PASSIVE wait policy) takes tens of microseconds to wake, about what one thread
// needs to read this much cache, so a short context (a decode at a few hundred positions)
// is faster on the calling thread alone.
constexpr int64_t kGrainBytes = 1 << 20;

using vllm_cpu::load8;
using vllm_cpu::store8;
using vllm_cpu::v8;

// Shapes and pointers shared by every (request, KV head) pair of one call.
struct Problem {
  const float* query;
  int64_t query_stride;
  const float* keys;
  const float* values;
  int64_t block_size, kv_heads, head_size, group;
  const int32_t* block_table;
  int64_t table_stride;
  float scale;
  float* out;
  int64_t out_stride;
};

typedef int32_t v8i __attribute__((vector_size(32)));

// exp(x) of eight lanes, each computed alone (a lane's result does not depend on the others):
// x = k ln 2 + r with |r| <= ln 2 / 2, exp(r) by its Taylor series to r^7 (truncation below
// 1e-8 relative, under float32's rounding), times 2^k set in the exponent bits. Lanes below
// -87.3 (exp under float32's smallest normal) give 0, like a softmax numerator that underflows;
// a NaN stays NaN (a broken score must not turn into a plausible weight).
__attribute__((always_inline)) inline v8 exp8(v8 x) {
  const v8 in = x;
  const v8i nan = x != x;
  const v8i tiny = x < -87.3f;
  x = (tiny | nan) ? -87.3f : x;  // keeps 2^k a normal number; those lanes are set below
  // Round x / ln 2 to the nearest integer: adding 1.5 * 2^23 leaves no fraction bits.
  const v8 shift = {12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f,
                    12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f};
  const v8 k = (x * 1.44269504f + shift) - shift;
  // ln 2 in two parts, so k ln 2 is subtracted without rounding away r's low bits.
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
  const v8 y = tiny ? 0.0f : p * scale;
  return nan ? in : y;
}

// s[i] = exp(s[i] - m) for i < n: eight at a time, the tail through a padded vector.
__attribute__((always_inline)) inline void exp_shifted(float* s, int64_t n, float m) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(s + i, exp8(load8(s + i) - m));
  if (i < n) {
    float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(buf, s + i, static_cast<size_t>(n - i) * sizeof(float));
    store8(buf, exp8(load8(buf) - m));
    std::memcpy(s + i, buf, static_cast<size_t>(n - i) * sizeof(float));
  }
}

// Sum of the eight lanes, in a fixed order.
__attribute__((always_inline)) inline float lane_sum(v8 a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// Score of one query head against one key: eight running lanes, summed in a fixed order.
__attribute__((always_inline)) inline float dot(const float* q, const float* k, int64_t d) {
  const int64_t d8 = d - d % 8;
  v8 a = {};
  for (int64_t i = 0; i < d8; i += 8) a += load8(q + i) * load8(k + i);
  float s = lane_sum(a);
  for (int64_t i = d8; i < d; ++i) s += q[i] * k[i];
  return s;
}

// Asks the cache for `width` floats at x: a row of the next block, which sits anywhere in the
// cache, so the hardware prefetcher cannot guess it. One row per row used, so the requests
// are spread out rather than all issued at once (which stalled on the line fill buffers).
__attribute__((always_inline)) inline void prefetch_row(const float* x, int64_t width) {
  for (int64_t i = 0; i < width; i += 16) __builtin_prefetch(x + i);
}

// scores[g * len + j] = scale * q_g . k_j for the n keys at k (stride apart): four keys at a
// time, so four independent sums are in flight; each score is what dot() gives. `next`: the
// next block's first key (prefetched), or null.
__attribute__((always_inline)) inline void score_keys(const Problem& p, const float* q,
                                                      const float* k, int64_t stride, int64_t n,
                                                      int64_t len, float* scores,
                                                      const float* next) {
  const int64_t d = p.head_size, d8 = d - d % 8;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4, k += 4 * stride) {
    if (next != nullptr) {
      for (int64_t r = j; r < j + 4; ++r) prefetch_row(next + r * stride, d);
    }
    for (int64_t g = 0; g < p.group; ++g) {
      const float* qg = q + g * d;
      v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t i = 0; i < d8; i += 8) {
        const v8 x = load8(qg + i);
        a0 += x * load8(k + i);
        a1 += x * load8(k + stride + i);
        a2 += x * load8(k + 2 * stride + i);
        a3 += x * load8(k + 3 * stride + i);
      }
      float s0 = lane_sum(a0), s1 = lane_sum(a1), s2 = lane_sum(a2), s3 = lane_sum(a3);
      for (int64_t i = d8; i < d; ++i) {
        s0 += qg[i] * k[i];
        s1 += qg[i] * k[stride + i];
        s2 += qg[i] * k[2 * stride + i];
        s3 += qg[i] * k[3 * stride + i];
      }
      float* out = scores + g * len + j;
      out[0] = s0 * p.scale;
      out[1] = s1 * p.scale;
      out[2] = s2 * p.scale;
      out[3] = s3 * p.scale;
    }
  }
  for (; j < n; ++j, k += stride) {
    for (int64_t g = 0; g < p.group; ++g) scores[g * len + j] = dot(q + g * d, k, d) * p.scale;
  }
}

// Where block b's first position for KV head h starts, in keys or values.
__attribute__((always_inline)) inline const float* block_start(const Problem& p,
                                                               const float* half,
                                                               const int32_t* blocks, int64_t b,
                                                               int64_t h) {
  return half + (static_cast<int64_t>(blocks[b]) * p.block_size * p.kv_heads + h) * p.head_size;
}

// out[0 .. 8 * L) = sum over positions t of w[t] * (values of t)[c .. c + 8 * L), in position
// order, accumulated in registers.
template <int L>
__attribute__((always_inline)) inline void weigh(const Problem& p, int64_t h,
                                                 const int32_t* blocks, int64_t num_blocks,
                                                 int64_t len, const float* w, int64_t c,
                                                 float* out) {
  const int64_t bs = p.block_size, stride = p.kv_heads * p.head_size;
  v8 a[L] = {};
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n = b + 1 < num_blocks ? bs : len - b * bs;
    const float* v = block_start(p, p.values, blocks, b, h) + c;
    const float* next = b + kAhead < num_blocks
        ? block_start(p, p.values, blocks, b + kAhead, h) + c : nullptr;
    const float* wb = w + b * bs;
    for (int64_t j = 0; j < n; ++j, v += stride) {
      if (next != nullptr) prefetch_row(next + j * stride, 8 * L);
      const v8 x = {wb[j], wb[j], wb[j], wb[j], wb[j], wb[j], wb[j], wb[j]};
      for (int l = 0; l < L; ++l) a[l] += x * load8(v + 8 * l);
    }
  }
  for (int l = 0; l < L; ++l) store8(out + 8 * l, a[l]);
}

// The same for the G query heads that share KV head h, in one pass over the values (each
// read once, not once per query head): head g's weights at w + g * len, its output at
// out + g * p.head_size. Each output element is summed exactly as weigh<L> sums it.
template <int L, int G>
__attribute__((always_inline)) inline void weigh_heads(const Problem& p, int64_t h,
                                                       const int32_t* blocks,
                                                       int64_t num_blocks, int64_t len,
                                                       const float* w, int64_t c, float* out) {
  const int64_t bs = p.block_size, stride = p.kv_heads * p.head_size;
  v8 a[G][L] = {};
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n = b + 1 < num_blocks ? bs : len - b * bs;
    const float* v = block_start(p, p.values, blocks, b, h) + c;
    const float* next = b + kAhead < num_blocks
        ? block_start(p, p.values, blocks, b + kAhead, h) + c : nullptr;
    const float* wb = w + b * bs;
    for (int64_t j = 0; j < n; ++j, v += stride) {
      if (next != nullptr) prefetch_row(next + j * stride, 8 * L);
      v8 row[L];
      for (int l = 0; l < L; ++l) row[l] = load8(v + 8 * l);
      for (int g = 0; g < G; ++g) {
        const float wg = wb[g * len + j];
        const v8 x = {wg, wg, wg, wg, wg, wg, wg, wg};
        for (int l = 0; l < L; ++l) a[g][l] += x * row[l];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int l = 0; l < L; ++l) store8(out + g * p.head_size + 8 * l, a[g][l]);
  }
}

// Columns [c, d8) of the outputs of KV head h's G query heads (weights and outputs laid out
// as for weigh_heads), 8 * L columns per pass over the values while they last, the rest in
// narrower passes.
template <int L, int G>
__attribute__((always_inline)) inline void weigh_from(const Problem& p, int64_t h,
                                                      const int32_t* blocks,
                                                      int64_t num_blocks, int64_t len,
                                                      const float* w, int64_t c, int64_t d8,
                                                      float* out) {
  for (; c + 8 * L <= d8; c += 8 * L) {
    weigh_heads<L, G>(p, h, blocks, num_blocks, len, w, c, out + c);
  }
  if constexpr (L > 1) weigh_from<L / 2, G>(p, h, blocks, num_blocks, len, w, c, d8, out);
}

// Columns [0, d8) of the outputs of KV head h's G query heads. Each pass streams the values
// from memory, so a pass takes as many columns as 32 accumulators hold (a head of 64 or 128
// at G = 1 or 2): those past the registers spill to L1, which cost less than a second pass
// (one layer at 8k context, G = 2: 0.74 -> 0.66 ms with 64 columns per pass instead of 32).
template <int G>
__attribute__((always_inline)) inline void weigh_group(const Problem& p, int64_t h,
                                                       const int32_t* blocks,
                                                       int64_t num_blocks, int64_t len,
                                                       const float* w, int64_t d8,
                                                       float* out) {
  // A power of two (weigh_from halves it down to 1): 32 / G, at most 16, for 1, 2, 4 or 8
  // query heads; for other groups as many columns as 16 accumulators hold (3 heads per KV
  // head: 8 columns of 64-wide heads at 24 accumulators, spilled, were 5% slower than 4).
  constexpr bool power = (G & (G - 1)) == 0;
  constexpr int most = power ? (32 / G < 16 ? 32 / G : 16) : 16 / G;
  constexpr int L = most >= 16 ? 16 : most >= 8 ? 8 : most >= 4 ? 4 : most >= 2 ? 2 : 1;
  weigh_from<L, G>(p, h, blocks, num_blocks, len, w, 0, d8, out);
}

// Columns [d8, d) of one query head's output (a head size not a multiple of 8), in position
// order.
__attribute__((always_inline)) inline void tail_columns(const Problem& p, int64_t h,
                                                        const int32_t* blocks,
                                                        int64_t num_blocks, int64_t len,
                                                        const float* s, int64_t d8, float* og) {
  const int64_t bs = p.block_size, stride = p.kv_heads * p.head_size;
  for (int64_t c = d8; c < p.head_size; ++c) {
    float a = 0.0f;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t n = b + 1 < num_blocks ? bs : len - b * bs;
      const float* v = block_start(p, p.values, blocks, b, h) + c;
      for (int64_t j = 0; j < n; ++j) a += s[b * bs + j] * v[j * stride];
    }
    og[c] = a;
  }
}

// Attention of KV heads [h0, h1) for one request whose query is row `row`, block table row
// `table_row` and context `len` positions. scores: scratch of (h1 - h0) * group * len floats.
// A head's result does not depend on which others are computed with it: the heads of a block
// are read together only so that the block is read as one run.
__attribute__((always_inline)) inline void attend(const Problem& p, int64_t row,
                                                 int64_t table_row, int64_t len, int64_t h0,
                                                 int64_t h1, float* scores) {
  const int64_t d = p.head_size, d8 = d - d % 8, bs = p.block_size;
  const int64_t stride = p.kv_heads * d;  // between positions of one block
  const int32_t* blocks = p.block_table + table_row * p.table_stride;
  const int64_t num_blocks = (len + bs - 1) / bs;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n = b + 1 < num_blocks ? bs : len - b * bs;
    for (int64_t h = h0; h < h1; ++h) {
      const float* q = p.query + row * p.query_stride + h * p.group * d;
      const float* next = b + kAhead < num_blocks
          ? block_start(p, p.keys, blocks, b + kAhead, h) : nullptr;
      score_keys(p, q, block_start(p, p.keys, blocks, b, h), stride, n, len,
                 scores + (h - h0) * p.group * len + b * bs, next);
    }
  }
  // Query heads sharing a KV head (up to 8 of them) weigh its values in one pass.
  const bool one_pass = p.group <= 8;
  float totals[8];
  for (int64_t h = h0; h < h1; ++h) {
    float* sh = scores + (h - h0) * p.group * len;  // the group's rows, one per query head
    float* oh = p.out + row * p.out_stride + h * p.group * d;
    for (int64_t g = 0; g < p.group; ++g) {
      // Softmax numerators in place; the row's sum in position order.
      float* s = sh + g * len;
      float m = -INFINITY;
      for (int64_t i = 0; i < len; ++i) m = s[i] > m ? s[i] : m;
      exp_shifted(s, len, m);
      float total = 0.0f;
      for (int64_t i = 0; i < len; ++i) total += s[i];
      if (one_pass) {
        totals[g] = total;
        continue;
      }
      // Otherwise per query head: the values weighted and summed in position order, 32
      // columns at a time in registers, then divided by the total.
      float* og = oh + g * d;
      int64_t c = 0;
      for (; c + 32 <= d8; c += 32) weigh<4>(p, h, blocks, num_blocks, len, s, c, og + c);
      for (; c < d8; c += 8) weigh<1>(p, h, blocks, num_blocks, len, s, c, og + c);
      tail_columns(p, h, blocks, num_blocks, len, s, d8, og);
      const float inv = 1.0f / total;
      for (int64_t i = 0; i < d; ++i) og[i] *= inv;
    }
    if (!one_pass) continue;
    switch (p.group) {
      case 1: weigh_group<1>(p, h, blocks, num_blocks, len, sh, d8, oh); break;
      case 2: weigh_group<2>(p, h, blocks, num_blocks, len, sh, d8, oh); break;
      case 3: weigh_group<3>(p, h, blocks, num_blocks, len, sh, d8, oh); break;
      case 4: weigh_group<4>(p, h, blocks, num_blocks, len, sh, d8, oh); break;
      case 5: weigh_group<5>(p, h, blocks, num_blocks, len, sh, d8, oh); break;
      case 6: weigh_group<6>(p, h, blocks, num_blocks, len, sh, d8, oh); break;
      case 7: weigh_group<7>(p, h, blocks, num_blocks, len, sh, d8, oh); break;
      default: weigh_group<8>(p, h, blocks, num_blocks, len, sh, d8, oh); break;
    }
    for (int64_t g = 0; g < p.group; ++g) {
      float* og = oh + g * d;
      tail_columns(p, h, blocks, num_blocks, len, sh + g * len, d8, og);
      const float inv = 1.0f / totals[g];
      for (int64_t i = 0; i < d; ++i) og[i] *= inv;
    }
  }
}
#if defined(VLLM_X86_FMA)
__attribute__((target("avx2,fma"))) void attend_fma(const Problem& p, int64_t row,
                                                     int64_t table_row, int64_t len,
                                                     int64_t h0, int64_t h1, float* scores) {
  attend(p, row, table_row, len, h0, h1, scores);
}
#endif

void attend_any(const Problem& p, int64_t row, int64_t table_row, int64_t len, int64_t h0,
                int64_t h1, float* scores) {
#if defined(VLLM_X86_FMA)
  if (vllm_cpu::has_avx2_fma()) {
    attend_fma(p, row, table_row, len, h0, h1, scores);
    return;
  }
#endif
  attend(p, row, table_row, len, h0, h1, scores);
}
}  // namespace

// Decode attention of n requests, one query row each, written into their output rows (other
// rows untouched).
// query: float32 rows of num_heads * head_size contiguous values, row i at query + i *
// query_stride; kv_cache: float32 [2, num_blocks, block_size, kv_heads, head_size] contiguous;
// block_table: int32 rows of table_cols ids, row r at block_table + r * table_stride;
// rows[i], table_rows[i], seq_lens[i]: decode i's query/output row, block table row and context
// length (its query's position + 1); out: like query with out_stride. num_threads <= 0 means
// the OpenMP default; a call that reads little of the cache uses fewer threads (kGrainBytes).
// Returns 0, VLLM_BAD_DECODE when a table row or context length is out of range or a block id
// a context uses is outside the cache, VLLM_BAD_SHAPE for a non-positive size or num_heads not a
// multiple of kv_heads; nothing is written then.
VLLM_EXPORT int32_t vllm_paged_decode_attention(
    const float* query, int64_t num_query_rows, int64_t query_stride, const float* kv_cache,
    int64_t num_blocks, int64_t block_size, int64_t kv_heads, int64_t head_size,
    int64_t num_heads, const int32_t* block_table, int64_t table_rows, int64_t table_cols,
    int64_t table_stride, const int64_t* rows, const int64_t* table_row_of,
    const int64_t* seq_lens, int64_t n, float scale, float* out, int64_t out_stride,
    int32_t num_threads) {
  if (block_size <= 0 || kv_heads <= 0 || head_size <= 0 || num_heads <= 0 ||
      num_heads % kv_heads != 0) {
    return VLLM_BAD_SHAPE;
  }
  int64_t longest = 0, positions = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = seq_lens[i];
    if (rows[i] < 0 || rows[i] >= num_query_rows || table_row_of[i] < 0 ||
        table_row_of[i] >= table_rows || len <= 0 || len > table_cols * block_size) {
      return VLLM_BAD_DECODE;
    }
    const int32_t* ids = block_table + table_row_of[i] * table_stride;
    for (int64_t b = 0, nb = (len + block_size - 1) / block_size; b < nb; ++b) {
      if (ids[b] < 0 || ids[b] >= num_blocks) return VLLM_BAD_DECODE;
    }
    longest = len > longest ? len : longest;
    positions += len;
  }
  const int64_t group = num_heads / kv_heads;
  const Problem p{query, query_stride, kv_cache, kv_cache + num_blocks * block_size * kv_heads *
                  head_size, block_size, kv_heads, head_size, group, block_table, table_stride,
                  scale, out, out_stride};
#if defined(_OPENMP)
  int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int64_t grains = positions * kv_heads * head_size * 2 * int64_t{sizeof(float)} /
                         kGrainBytes;
  threads = vllm_cpu::threads_for(grains, threads);
#else
  const int threads = 1;
  (void)num_threads;
#endif
  // A work item is a request with all its KV heads (its blocks read as whole runs) when there
  // are enough requests to share out, else one KV head of one request.
  const int64_t heads_per_item = n >= 2 * threads ? kv_heads : 1;
  const int64_t items = n * (kv_heads / heads_per_item);
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) if (items > 1)
#endif
  {
    std::vector<float> scores(static_cast<size_t>(heads_per_item * group * longest));
#if defined(_OPENMP)
    // Dynamic: contexts differ in length; which thread takes an item never changes its result.
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t w = 0; w < items; ++w) {
      const int64_t i = w * heads_per_item / kv_heads, h0 = w * heads_per_item % kv_heads;
      attend_any(p, rows[i], table_row_of[i], seq_lens[i], h0, h0 + heads_per_item,
                 scores.data());
    }
  }
  return VLLM_OK;
}

// Greedy sampling on the CPU: the argmax of each float32 logits row, with an optional grammar
// bitmask applied in the same pass (disallowed tokens count as -inf, the logits are not written).
//
// torch's CPU argmax tracks an index per element and is several times slower than a plain max
// reduction. Here a row is read once in blocks: a vectorised max per block, and only a block
// whose max beats the best so far is searched again (it is in L1 by then) for the index. The
// result follows torch.argmax exactly: the first index of the largest value, the first NaN if
// the row has one, index 0 when every value is -inf. Masked words (32 tokens per bitmask word)
// that allow nothing are skipped without reading the logits.

#include <cmath>
#include <cstdint>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "export.h"

namespace {
constexpr int32_t VLLM_OK = 0;
constexpr int32_t VLLM_BAD_ROW = 6;
// Tokens per block of an unmasked row (a multiple of 32, so blocks align with mask words).
constexpr int64_t kBlock = 256;

// Running answer of one row: the best value and its index; `nan` set once a NaN was found.
struct Best {
  float value = -INFINITY;
  int64_t index = 0;
  bool nan = false;
};

// Max of x[0..n) (n > 0), and whether any element is NaN.
inline float block_max(const float* x, int64_t n, bool* has_nan) {
  int64_t i = 0;
  float m = -INFINITY;
  bool nan = false;
#if defined(__SSE2__)
  if (n >= 16) {
    __m128 m0 = _mm_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    __m128 u = _mm_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4);
      const __m128 c = _mm_loadu_ps(x + i + 8), d = _mm_loadu_ps(x + i + 12);
      // NaN never survives maxps reliably, so unordered lanes are collected apart.
      u = _mm_or_ps(u, _mm_or_ps(_mm_cmpunord_ps(a, b), _mm_cmpunord_ps(c, d)));
      m0 = _mm_max_ps(m0, a);
      m1 = _mm_max_ps(m1, b);
      m2 = _mm_max_ps(m2, c);
      m3 = _mm_max_ps(m3, d);
    }
    nan = _mm_movemask_ps(u) != 0;
    m0 = _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3));
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, m0);
    for (float v : lanes) m = v > m ? v : m;
  }
#endif
  for (; i < n; ++i) {
    const float v = x[i];
    if (v != v) nan = true;
    m = v > m ? v : m;
  }
  *has_nan = nan;
  return m;
}

// Folds tokens [base, base + n) of an unmasked stretch into best.
inline void scan_plain(const float* row, int64_t base, int64_t n, Best* best) {
  bool nan = false;
  const float m = block_max(row + base, n, &nan);
  if (nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (row[base + j] != row[base + j]) {
        best->index = base + j;
        best->nan = true;
        return;
      }
    }
  }
  if (m > best->value) {
    for (int64_t j = 0; j < n; ++j) {
      if (row[base + j] == m) {
        best->value = m;
        best->index = base + j;
        return;
      }
    }
  }
}

int64_t argmax_plain(const float* row, int64_t vocab) {
  Best best;
  for (int64_t base = 0; base < vocab && !best.nan; base += kBlock) {
    scan_plain(row, base, vocab - base < kBlock ? vocab - base : kBlock, &best);
  }
  return best.index;
}

#if defined(__SSE2__)
// Lane masks of 4 bits: kLanes[b] has lane j all ones where bit j of b is set.
struct LaneMasks {
  alignas(16) uint32_t words[16][4];
  constexpr LaneMasks() : words() {
    for (int b = 0; b < 16; ++b) {
      for (int j = 0; j < 4; ++j) words[b][j] = ((b >> j) & 1) ? 0xFFFFFFFFu : 0u;
    }
  }
};
constexpr LaneMasks kLanes;
#endif

// Folds the allowed tokens of one 32-token word (n <= 32 tokens from base) into best.
inline void scan_mixed(const float* row, int64_t base, int64_t n, uint32_t bits, Best* best) {
  float m = -INFINITY;
  bool nan = false;
  int64_t j = 0;
#if defined(__SSE2__)
  if (n == 32) {
    const __m128 neg_inf = _mm_set1_ps(-INFINITY);
    __m128 acc = neg_inf;
    __m128 u = _mm_setzero_ps();
    for (; j < 32; j += 4) {
      const __m128 keep = _mm_load_ps(reinterpret_cast<const float*>(kLanes.words[(bits >> j) & 15u]));
      const __m128 x = _mm_loadu_ps(row + base + j);
      // Disallowed lanes become -inf, whatever they held (NaN included).
      const __m128 v = _mm_or_ps(_mm_and_ps(keep, x), _mm_andnot_ps(keep, neg_inf));
      u = _mm_or_ps(u, _mm_cmpunord_ps(v, v));
      acc = _mm_max_ps(acc, v);
    }
    nan = _mm_movemask_ps(u) != 0;
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, acc);
    for (float v : lanes) m = v > m ? v : m;
  }
#endif
  for (; j < n; ++j) {
    if (!((bits >> j) & 1u)) continue;
    const float v = row[base + j];
    if (v != v) nan = true;
    m = v > m ? v : m;
  }
  if (!nan && !(m > best->value)) return;
  for (j = 0; j < n; ++j) {
    if (!((bits >> j) & 1u)) continue;
    const float v = row[base + j];
    if (nan ? v != v : v == m) {
      best->value = m;
      best->index = base + j;
      best->nan = nan;
      return;
    }
  }
}

int64_t argmax_masked(const float* row, int64_t vocab, const uint32_t* mask) {
  Best best;
  const int64_t num_words = (vocab + 31) / 32;
  for (int64_t w = 0; w < num_words && !best.nan; ++w) {
    const uint32_t bits = mask[w];
    if (bits == 0) continue;
    const int64_t base = w * 32;
    const int64_t n = vocab - base < 32 ? vocab - base : 32;
    if (bits == 0xFFFFFFFFu) {
      scan_plain(row, base, n, &best);
    } else {
      scan_mixed(row, base, n, bits, &best);
    }
  }
  return best.index;
}
}  // namespace

// For each row r in [0, num_rows) of logits ([num_rows, logits_stride] float32, vocab_size
// columns used): out[r] = the argmax of the row, where mask_rows[r] >= 0 selects the row of
// bitmask ([num_mask_rows, mask_stride] int32; bit j of word w allows token 32 * w + j) whose
// disallowed tokens count as -inf, and mask_rows[r] < 0 means no mask. mask_rows may be null
// (no row masked). Returns VLLM_BAD_ROW, writing nothing, if a mask row is out of range.
VLLM_EXPORT int32_t vllm_masked_argmax(const float* logits, int64_t num_rows,
                                       int64_t logits_stride, int64_t vocab_size,
                                       const int32_t* bitmask, int64_t num_mask_rows,
                                       int64_t mask_stride, const int64_t* mask_rows,
                                       int64_t* out) {
  if (mask_rows != nullptr) {
    for (int64_t r = 0; r < num_rows; ++r) {
      if (mask_rows[r] >= num_mask_rows) return VLLM_BAD_ROW;
    }
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* row = logits + r * logits_stride;
    const int64_t m = mask_rows != nullptr ? mask_rows[r] : -1;
    if (m < 0) {
      out[r] = argmax_plain(row, vocab_size);
    } else {
      const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask + m * mask_stride);
      out[r] = argmax_masked(row, vocab_size, mask);
    }
  }
  return VLLM_OK;
}

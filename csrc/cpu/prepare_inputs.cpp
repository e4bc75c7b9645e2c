// CPU helpers that build the model runner's flat varlen inputs every step.
//
// Plain C ABI on raw pointers so the library needs no torch or Python headers and is loaded with
// ctypes (vllm/_custom_ops.py). Callers validate dtypes, shapes and contiguity; these functions
// only check index ranges, because an out-of-range index would read or write foreign memory.
// Every function returns a VLLM_* status code and writes nothing when the status is not VLLM_OK.

#include <cstdint>

#include "export.h"

namespace {

// Bumped whenever a signature or status code changes, so a stale library is refused at load time.
constexpr int32_t kAbiVersion = 6;

constexpr int32_t VLLM_OK = 0;
constexpr int32_t VLLM_BAD_REQ_INDEX = 1;
constexpr int32_t VLLM_BAD_POSITION = 2;
constexpr int32_t VLLM_BAD_BLOCK_SIZE = 3;
constexpr int32_t VLLM_BAD_COUNT = 4;
constexpr int32_t VLLM_TOTAL_MISMATCH = 5;

// Writes the slots of already range-checked tokens; block_of(p) must equal p / block_size.
template <typename BlockOf>
void fill_slots(const int32_t* block_table, int64_t num_cols, const int32_t* req_indices,
                const int64_t* positions, int64_t num_tokens, int64_t* out, BlockOf block_of,
                int64_t block_size) {
  for (int64_t i = 0; i < num_tokens; ++i) {
    const int64_t p = positions[i];
    const int64_t block = block_of(p);
    const int64_t block_id = block_table[static_cast<int64_t>(req_indices[i]) * num_cols + block];
    out[i] = block_id * block_size + (p - block * block_size);
  }
}

}  // namespace

// Version of the functions below; vllm/_custom_ops.py refuses a library whose version differs.
VLLM_EXPORT int32_t vllm_native_abi_version() { return kAbiVersion; }

// out[i] = block_table[req_indices[i], positions[i] / block_size] * block_size
//          + positions[i] % block_size, for i in [0, num_tokens).
// block_table is C-contiguous [num_rows, num_cols] int32.
// Returns VLLM_BAD_BLOCK_SIZE if block_size <= 0, VLLM_BAD_REQ_INDEX if a request index is outside
// [0, num_rows), VLLM_BAD_POSITION if a position is negative or its block is outside [0, num_cols).
VLLM_EXPORT int32_t vllm_compute_slot_mapping(const int32_t* block_table, int64_t num_rows,
                                              int64_t num_cols, const int32_t* req_indices,
                                              const int64_t* positions, int64_t num_tokens,
                                              int64_t block_size, int64_t* out) {
  if (block_size <= 0) return VLLM_BAD_BLOCK_SIZE;
  // A separate checking pass keeps the promise of writing nothing on error; both passes stream
  // the same few KiB, which stay in L1/L2.
  const int64_t max_position = num_cols * block_size;
  for (int64_t i = 0; i < num_tokens; ++i) {
    const int64_t r = req_indices[i];
    const int64_t p = positions[i];
    if (r < 0 || r >= num_rows) return VLLM_BAD_REQ_INDEX;
    if (p < 0 || p >= max_position) return VLLM_BAD_POSITION;
  }
  if ((block_size & (block_size - 1)) == 0) {
    // Power-of-two block sizes (the usual case) avoid a 64-bit division per token.
    fill_slots(block_table, num_cols, req_indices, positions, num_tokens, out,
               [shift = __builtin_ctzll(static_cast<uint64_t>(block_size))](int64_t p) {
                 return p >> shift;
               },
               block_size);
  } else {
    fill_slots(block_table, num_cols, req_indices, positions, num_tokens, out,
               [block_size](int64_t p) { return p / block_size; }, block_size);
  }
  return VLLM_OK;
}

// Expands per-request (start, count) pairs into per-token rows: request r contributes tokens
// num_computed[r] .. num_computed[r] + num_scheduled[r] - 1, in request order.
// Returns VLLM_BAD_COUNT if a count or start is negative and VLLM_TOTAL_MISMATCH if the counts do
// not sum to num_tokens.
VLLM_EXPORT int32_t vllm_prepare_positions(const int32_t* num_computed,
                                           const int32_t* num_scheduled, int64_t num_reqs,
                                           int32_t* out_req_indices, int64_t* out_positions,
                                           int64_t num_tokens) {
  int64_t total = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    if (num_scheduled[r] < 0 || num_computed[r] < 0) return VLLM_BAD_COUNT;
    total += num_scheduled[r];
  }
  if (total != num_tokens) return VLLM_TOTAL_MISMATCH;
  int64_t t = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t start = num_computed[r];
    const int64_t count = num_scheduled[r];
    const int32_t req = static_cast<int32_t>(r);
    for (int64_t k = 0; k < count; ++k) {
      out_req_indices[t + k] = req;
      out_positions[t + k] = start + k;
    }
    t += count;
  }
  return VLLM_OK;
}

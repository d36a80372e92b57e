// Expert-major rows (docs/design.md, "Expert-major rows"): a rank's received
// rows regrouped by local expert, and their weighted reduction back. Local:
// no peers, no Buffer memory. Every launcher only enqueues work on `stream`.
// Their FP8 transposed gather is kernels/fp8_quant.h's LaunchTransposedRows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/limits.h"  // kMaxLocalExperts, kMaxRowArrays

namespace deep_ep_jax {

// Pair p = n * K + k of topk_idx int32 [num_pairs = N * K] names local expert
// topk_idx[p] (ids outside [0, num_local_experts) name none). Group e starts at
// offset(e) = sum over e' < e of AlignUp(count(e'), alignment) and holds e's
// pairs in p order; rows from num_rows on are dropped. Writes group_sizes [L]
// (rows of e below num_rows), group_offsets [L] (min(offset(e), num_rows)),
// pair_row [num_pairs] (-1: none or dropped), row_pair [num_rows] (-1: unused)
// and num_dropped [1]; pair_counts [L] is scratch. Deterministic: one block per
// expert places its pairs with block-wide prefix sums, no atomics decide an order.
cudaError_t LaunchExpertLayout(const int* topk_idx, int64_t num_pairs, int num_local_experts, int64_t alignment,
                               int num_rows, int* pair_counts, int* group_sizes, int* group_offsets, int* pair_row,
                               int* row_pair, int* num_dropped, cudaStream_t stream);

// Row i of each dst array = row row_pair[i] / num_topk of the src array, or
// zeros where row_pair[i] is outside [0, num_src_rows * num_topk). Arrays with
// row_bytes 0 are skipped; row_bytes are multiples of 4.
struct ExpandArrays {
  const char* src[kMaxRowArrays];
  char* dst[kMaxRowArrays];
  int64_t row_bytes[kMaxRowArrays];
};
cudaError_t LaunchExpandRows(const ExpandArrays& arrays, const int* row_pair, int num_rows, int num_src_rows,
                             int num_topk, cudaStream_t stream);

// out[n] = bf16(0 + term(n, 0) + term(n, 1) + ...) in float32 over k with
// pair_row[n, k] in [0, num_rows): term = weight * float32(expert_y row),
// rounded to float32 before the add (no fused multiply-add), or the row
// itself when weights is null. hidden % 8 == 0 (16-byte rows).
cudaError_t LaunchReduceRows(const __nv_bfloat16* expert_y, int num_rows, const float* weights, const int* pair_row,
                             int num_tokens, int num_topk, int hidden, __nv_bfloat16* out, cudaStream_t stream);

}  // namespace deep_ep_jax
